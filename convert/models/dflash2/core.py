"""DFlash2: the torch modules (parameter names = canonical checkpoint keys) and the export core."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from convert.errors import InputError
from convert.export.functions import set_parameter
from convert.export.names import DRAFT_IDS, LOGITS, ROPE_COS, ROPE_SIN, SELECTOR_SCORES
from convert.export.selector import selector_scores, selector_walk
from convert.models.dflash2.config import MASK_BIAS, DFlash2Args, expected_shapes
from convert.models.qwen3.core import MLP, RMSNorm, rotate, scaled_scores


class GroupedConv(nn.Module):
    """Dynamic grouped depthwise conv inside a block: ``out[t] = sum_j (base[side, j] + dyn[t, side, j]) * x[t-j]``.

    ``dyn`` comes from ``kernel_projection(x_normed)`` laid out [side, tap, group]; one coefficient per group of
    ``group`` channels (channel c is in group c // group). Works on [..., T, H]; rows before the block start are 0.
    """

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.groups = kernel, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        # group -> channels as a 0/1 matrix: a matmul spreads each group's coefficient over its channels exactly
        # (one product by 1 per output), with no reshape of a dynamic shape and no repeat_interleave to convert.
        spread = torch.arange(hidden)[None, :] // group == torch.arange(self.groups)[:, None]
        self.register_buffer("group_spread", spread.float(), persistent=False)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel_projection(x)

    def mix(self, x: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        out = None
        for j in range(self.kernel):
            start = (side * self.kernel + j) * self.groups
            coefficient = self.base_kernel[side, j] + dyn[..., start:start + self.groups] @ self.group_spread
            shifted = x if j == 0 else torch.cat([torch.zeros_like(x[..., :j, :]), x[..., :-j, :]], dim=-2)
            term = coefficient * shifted
            out = term if out is None else out + term
        return out


class Attention(nn.Module):
    def __init__(self, args: DFlash2Args):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps)
        self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[..., T, H] -> [..., T, heads, D] (q_norm applied, no RoPE)."""
        return self.q_norm(_split_heads(self.q_proj(x), self.heads, self.head_dim))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., T, H] -> K (k_norm applied, no RoPE), V: [..., T, kv_heads, D]."""
        k = self.k_norm(_split_heads(self.k_proj(x), self.kv_heads, self.head_dim))
        return k, _split_heads(self.v_proj(x), self.kv_heads, self.head_dim)


def _split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[..., heads * D] -> [..., heads, D]; rank 2 (the export core) as a view with -1, so that no Python int is read
    from a tensor shape (coremltools rejects the aten::Int nodes tracing makes of them)."""
    return x.view(-1, heads, head_dim) if x.dim() == 2 else x.unflatten(-1, (heads, head_dim))


class DraftLayer(nn.Module):
    """One draft layer over a block [..., T, H]; ``attend(self_attn, x)`` supplies the attention (context + block),
    which differs between the reference, training and the export core. Everything else is shared."""

    def __init__(self, args: DFlash2Args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.has_conv:
            self.attention_conv = GroupedConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
            self.mlp_conv = GroupedConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def forward(self, h: torch.Tensor, attend) -> torch.Tensor:
        h = h + self._around(self.input_layernorm(h), getattr(self, "attention_conv", None),
                             lambda x: attend(self.self_attn, x))
        return h + self._around(self.post_attention_layernorm(h), getattr(self, "mlp_conv", None), self.mlp)

    @staticmethod
    def _around(x, conv, sublayer):
        if conv is None:
            return sublayer(x)
        dyn = conv.coefficients(x)
        return conv.mix(sublayer(conv.mix(x, dyn, 0)), dyn, 1)


class CandidateSelector(nn.Module):
    def __init__(self, args: DFlash2Args):
        super().__init__()
        self.top_k = args.selector_top_k
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(args.vocab_size, args.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(args.vocab_size, args.selector_rank))

    def scores(self, projected, unary, candidates, predecessors):
        """``unary + successor[cand] @ (predecessor[pred] * projected)``: projected [..., rank], unary and candidates
        [..., k], predecessors [...] -> [..., k]."""
        return selector_scores(projected, unary, candidates, predecessors, *self.codebook_lookups())

    def codebook_lookups(self):
        """The (predecessor, successor) codebooks' rows of ids, as ``selector_walk`` takes them."""
        return (lambda ids: F.embedding(ids, self.predecessor_codebook),
                lambda ids: F.embedding(ids, self.successor_codebook))

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, rows: int):
        """Greedy walk from ``anchor`` [1] over ``rows`` rows of hidden [n, H] and logits [n, V] -> ids [n],
        scores [n, k], candidates [n, k] (``selector_walk``, in the graph)."""
        projected = self.hidden_projection(hidden)
        return selector_walk(projected, logits, anchor, self.top_k, *self.codebook_lookups(), rows)


class DFlash2Weights(nn.Module):
    """The drafter's own parameters under their canonical checkpoint names (no target tensors)."""

    def __init__(self, args: DFlash2Args):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(args.feature_size, args.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.has_selector:
            self.candidate_selector = CandidateSelector(args)
        exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim
        self.register_buffer("inv_freq", 1.0 / (args.rope_theta**exponents), persistent=False)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from canonical keys (as ``load_checkpoint`` returns them), each tensor taken out of
        ``tensors`` as it is cast to its parameter's dtype and set in its place. A core built with its parameters on
        meta (``export.build_modules``) gets them here, and a checkpoint's memory-mapped tensor is let go once cast: at
        the 27B drafters' size, a core made in fp32 first beside the checkpoint's pages held 12.2 GiB at the peak
        (``bench/drafter_load.py``)."""
        keys = expected_shapes(self.args)
        missing = sorted(set(keys) - set(tensors))
        if missing:
            raise InputError(f"drafter weights: tensor {missing[0]!r} is missing")
        for key in keys:
            set_parameter(self, key, tensors.pop(key).to(self.get_parameter(key).dtype, copy=True))

    def drafter_state(self) -> dict[str, torch.Tensor]:
        """The parameters by canonical key (what a checkpoint stores)."""
        keys = expected_shapes(self.args)
        return {k: v for k, v in self.state_dict().items() if k in keys}

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [..., D/2] of integer positions (the same products as the export core's tables)."""
        angles = positions.float()[..., None] * self.inv_freq
        return angles.cos(), angles.sin()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))


class DFlash2Core(DFlash2Weights):
    """The shared computation behind the drafter's functions (static shapes, ring states passed in).

    Holds the drafter weights once plus the borrowed target constants: ``lm_head`` (a Linear, so the build can
    quantize it as the target's) and ``mask_embedding`` [H] (the target's mask row times the mask scale).
    ``context`` and ``draft`` return every output a function may expose; each function picks its spec's outputs.
    """

    def __init__(self, args: DFlash2Args, ring_rows: int, max_positions: int, draft_width: int | None = None):
        super().__init__(args)
        self.ring_rows, self.max_positions = ring_rows, max_positions
        self.residual_scale = 1.0  # what the anchor row is multiplied by as it enters (export.build_modules)
        self.draft_width = draft_width or args.block_size
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("mask_embedding", torch.zeros(args.hidden_size))
        # rows for every position of a block that starts below max_positions
        rows = max_positions + self.draft_width
        angles = torch.arange(rows, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
        self.register_buffer(ROPE_COS, angles.cos(), persistent=False)
        self.register_buffer(ROPE_SIN, angles.sin(), persistent=False)
        # constants rather than torch.arange in forward: coremltools warns on every int64 arange it meets
        self.register_buffer("ring_slots", torch.arange(ring_rows, dtype=torch.int32), persistent=False)
        self.register_buffer("kv_head_index", torch.arange(args.num_key_value_heads)[:, None], persistent=False)

    def set_target(self, lm_head_weight: torch.Tensor, mask_embedding: torch.Tensor, mask_scale: float = 1.0) -> None:
        """Borrow the target's ``lm_head`` [vocab, H] (its tensor itself when it is in this core's dtype, not a copy: at
        27B a head is 2.5 GB in fp16) and mask row [H] (scaled in fp32, then cast)."""
        dtype = self.lm_head.weight.dtype
        self.lm_head.weight = nn.Parameter(lm_head_weight.detach().to(dtype), requires_grad=False)
        with torch.no_grad():
            self.mask_embedding.copy_((mask_embedding.float() * mask_scale).to(self.mask_embedding.dtype))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the core computes in: its norms' (a weight-sharing compute copy's linears keep fp16 weights,
        ``export.functions.compute_copy``)."""
        return self.norm.weight.dtype

    def context(self, taps, position_ids, ring_keys, ring_values, ring_laps):
        """Write the K/V of S context rows (``taps`` [1,S,T*H] at ``position_ids`` [1,S]) into the ring."""
        dtype = self.compute_dtype
        positions = position_ids[0]
        laps = torch.div(positions, self.ring_rows, rounding_mode="floor") + 1  # int32 [S]
        slots = positions - (laps - 1) * self.ring_rows  # position mod R (coreai-torch has no aten.remainder)
        index = positions.long()
        cos, sin = self.rope_cos[index].to(dtype), self.rope_sin[index].to(dtype)
        fused = self.fuse(taps[0].to(dtype))
        rows = slots.long()[None, :].expand(self.args.num_key_value_heads, -1)  # [Hkv, S]
        heads = self.kv_head_index.expand_as(rows)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(fused)
            k = rotate(k.transpose(0, 1), cos, sin)
            write = (torch.full_like(rows, i), heads, rows)
            ring_keys.index_put_(write, k.to(ring_keys.dtype))
            ring_values.index_put_(write, v.transpose(0, 1).to(ring_values.dtype))
        ring_laps.index_put_((torch.zeros_like(rows[0]), rows[0]), laps.to(ring_laps.dtype))
        return {"written": slots[None]}

    def draft(self, anchor_embedding, anchor_id, position_ids, ring_keys, ring_values, ring_laps):
        """Draft ``draft_width - 1`` ids after the anchor at p0 = ``position_ids[0, 0]`` (positions p0..p0+S-1)."""
        args, dtype = self.args, self.compute_dtype
        positions = position_ids[0]
        index = positions.long()
        cos, sin = self.rope_cos[index].to(dtype), self.rope_sin[index].to(dtype)
        masks = self._ring_masks(positions, ring_laps, dtype)
        anchor = anchor_embedding[0].to(dtype)
        if self.residual_scale != 1:
            anchor = anchor * self.residual_scale
        block = torch.cat([anchor, self.mask_embedding[None].expand(self.draft_width - 1, -1)])
        h = block
        for i, layer in enumerate(self.layers):
            def attend(attn, x, i=i):
                return self._attend(attn, x, i, cos, sin, masks[args.layer_windows[i]], ring_keys, ring_values)

            h = layer(h, attend)
        hidden = self.norm(h[1:])
        logits = self.lm_head(hidden)
        out = {LOGITS: logits[None]}
        if args.has_selector:
            ids, scores, _ = self.candidate_selector.walk(hidden, logits, anchor_id[0].long(), self.draft_width - 1)
            out[SELECTOR_SCORES] = scores[None]
        else:
            ids = logits.argmax(-1)
        out[DRAFT_IDS] = ids.to(torch.int32)[None]
        self._touch(positions, ring_keys, ring_values, ring_laps)
        return out

    def _ring_masks(self, positions, ring_laps, dtype) -> dict[int | None, torch.Tensor]:
        """Additive masks [S, R + S] per distinct window: a ring slot is visible when filled, below p0 and in the
        window; block rows all see each other (non-causal; windows are at least block_size, checked in the args)."""
        laps = ring_laps[0]
        key_positions = (laps.to(torch.int32) - 1) * self.ring_rows + self.ring_slots  # [R] int32
        filled = (laps > 0) & (key_positions < positions[:1])
        distance = positions[:, None] - key_positions[None, :]  # [S, R]
        block = torch.zeros_like(positions[:, None] - positions[None, :]).to(dtype)  # [S, S]
        masks = {}
        for window in dict.fromkeys(self.args.layer_windows):  # ordered: the same graph in every process
            ring = filled[None, :].expand_as(distance)
            if window is not None:
                ring = ring & (distance < window)
            masks[window] = torch.cat([torch.where(ring, 0.0, MASK_BIAS).to(dtype), block], dim=1)
        return masks

    def _attend(self, attn, x, layer_index, cos, sin, mask_bias, ring_keys, ring_values):
        q = rotate(attn.queries(x).transpose(0, 1), cos, sin)  # [heads, S, D]
        k, v = attn.keys_values(x)
        k = rotate(k.transpose(0, 1), cos, sin)  # [Hkv, S, D]
        keys = torch.cat([ring_keys[layer_index].to(x.dtype), k], dim=1)  # [Hkv, R + S, D]
        values = torch.cat([ring_values[layer_index].to(x.dtype), v.transpose(0, 1)], dim=1)
        group = attn.heads // attn.kv_heads
        q = q.reshape(attn.kv_heads, -1, attn.head_dim)  # GQA: a KV head serves `group` query heads
        scores = scaled_scores(q, keys, attn.head_dim) + mask_bias.repeat(group, 1)
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = (probs @ values).view(attn.heads, -1, attn.head_dim).transpose(0, 1)
        return attn.o_proj(out.reshape(-1, attn.heads * attn.head_dim))

    def _touch(self, positions, ring_keys, ring_values, ring_laps) -> None:
        """Write the ring row of p0's slot back unchanged (see the package docstring, __init__.py: the draft's states
        must be written in place to stay states)."""
        p0 = positions[:1]
        slot = (p0 - torch.div(p0, self.ring_rows, rounding_mode="floor") * self.ring_rows).long()  # [1]
        zero = torch.zeros_like(slot)
        ring_keys.index_put_((zero, zero, slot), ring_keys[zero, zero, slot])
        ring_values.index_put_((zero, zero, slot), ring_values[zero, zero, slot])
        ring_laps.index_put_((zero, slot), ring_laps[zero, slot])

    def ring_shape(self) -> tuple[int, int, int, int]:
        a = self.args
        return (a.num_hidden_layers, a.num_key_value_heads, self.ring_rows, a.head_dim)
