"""Qwen3 dense: the torch modules, the export core and how GPTQ calibrates and quantizes its layers."""

from __future__ import annotations

import torch
from torch import nn

from convert.export.ane import rope_rows
from convert.export.names import ROPE_COS, ROPE_SIN
from convert.models.layout import Layout
from convert.models.part import Part, build_embedding, build_head, part_input, part_outputs
from convert.models.qwen3.checkpoint import load_checkpoint_tensors
from convert.models.qwen3.config import Qwen3Args

KEEP_FP16 = ()  # every 2-D weight of a dense layer is a large linear
# (the linear the MLP's intermediate is linear in, the linear that reads it): ``convert/weights/rescale.py`` divides
# the first and multiplies the second by one power of two
MLP_REBALANCE = ("mlp.up_proj", "mlp.down_proj")
# a decoder layer's linears whose outputs join the residual stream (a drafter's range scale multiplies them)
RESIDUAL_WRITERS = ("self_attn.o_proj", "mlp.down_proj")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def gain(self) -> torch.Tensor:
        """What the normed values are multiplied by (the ane layout's norm, ``export.ane.rms_norm``, reads it)."""
        return self.weight


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        h, d = args.hidden_size, args.head_dim
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        bias = args.attention_bias
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, args.rms_norm_eps)
        self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def forward(self, x, cos, sin, heads_rows, mask_bias, key_cache, value_cache):
        """``heads_rows`` = (kv head, cache row) index tensors [Hkv, S] addressing this call's cache rows.

        No Python int is read from a tensor shape (``-1`` in views instead): coremltools rejects the
        ``aten::Int`` nodes that tracing makes of them.
        """
        q, k, v, gate = self.project(x, cos, sin)
        heads, rows = heads_rows
        write_index = (torch.full_like(rows, self.layer_index), heads, rows)
        key_cache.index_put_(write_index, k.to(key_cache.dtype))
        value_cache.index_put_(write_index, v.to(value_cache.dtype))
        keys = key_cache[self.layer_index].to(x.dtype)
        values = value_cache[self.layer_index].to(x.dtype)
        group = self.heads // self.kv_heads
        q = q.reshape(self.kv_heads, -1, self.head_dim)  # GQA: a KV head serves `group` query heads
        scores = scaled_scores(q, keys, self.head_dim) + mask_bias.repeat(group, 1)
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = (probs @ values).view(self.heads, -1, self.head_dim).transpose(0, 1)
        out = out.reshape(-1, self.heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def project(self, x, cos, sin):
        """q [heads, S, d] and k, v [kv heads, S, d], normed and rotated; and the output gate (None: Qwen3 has none)."""
        q = self.q_norm(self.q_proj(x).view(-1, self.heads, self.head_dim)).transpose(0, 1)
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim).transpose(0, 1)
        return rotate(q, cos, sin), rotate(k, cos, sin), v, None


def scaled_scores(q: torch.Tensor, keys: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``q k^T / sqrt(head_dim)`` with the scale on the queries before the product: in fp16 the unscaled product of
    normed queries and keys overflows (65504) once ``head_dim x gain_q x gain_k`` nears it, e.g. a head of 128 with
    q_norm and k_norm gains of 23 on a token that attends to itself (``tests/test_fp16.py``)."""
    return (q * head_dim**-0.5) @ keys.transpose(-1, -2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' rotate-half layout; cos/sin are [S, head_dim/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``; ``activation`` is SiLU (a hybrid target passes its device-safe form)."""

    def __init__(self, args: Qwen3Args, activation=nn.functional.silu):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.activation = activation

    def forward(self, x):
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3Args, layer_index: int, first: int = 0):
        """Layer ``layer_index`` of a core whose layers start at ``first`` (a part's): its cache row is counted from
        there."""
        super().__init__()
        self.self_attn = Attention(args, layer_index - first)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, heads_rows, mask_bias, key_cache, value_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, heads_rows, mask_bias, key_cache, value_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Core(nn.Module):
    """The shared computation behind every target function, or behind one part's (``convert/pipeline/partition.py``).

    ``forward`` returns every output a function may expose: ``argmax_ids`` [1,S] int32, ``logits``
    [1,S,V], ``hidden`` [1,S,H] (the final-norm output: an MTP head's input) and, when taps are set,
    ``taps`` [1,S,len(taps)*hidden] (output of layer i, 0-based, in the given order); a part without the head
    returns its last layer's rows as ``hidden_states`` instead. Each FunctionModule picks the outputs its spec names.
    """

    def __init__(self, args: Qwen3Args, context: int, taps: tuple[int, ...] = (), part: Part | None = None):
        super().__init__()
        self.part = part or Part.whole(args)
        self.args, self.context, self.taps = args, context, self.part.own_taps(taps)
        build_embedding(self, args)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self.part.layers[0]) for i in self.part.layer_indices)
        build_head(self, args, RMSNorm)
        if self.layers:
            register_positions(self, args.head_dim, args.rope_theta, context, args.num_key_value_heads)

    def load_weights(self, tensors: dict[str, torch.Tensor], layout: Layout | None = None) -> None:
        """Fill from transformers keys (already checked by ``sanitize``)."""
        load_checkpoint_tensors(self, tensors, layout or Layout())

    def forward(self, input_ids=None, position_ids=None, key_cache=None, value_cache=None, hidden_states=None, *,
                width: int = 0):
        x = part_input(self, input_ids, hidden_states)
        tapped = []
        if self.layers:
            attention = position_inputs(self, position_ids, x.dtype)
            for i, layer in zip(self.part.layer_indices, self.layers, strict=True):
                x = layer(x, *attention, key_cache, value_cache)
                if i in self.taps:
                    tapped.append((self.taps.index(i), x))
        return part_outputs(self, x, tapped)

    def cache_shape(self) -> tuple[int, int, int, int]:
        a = self.args
        return (len(self.layers), a.num_key_value_heads, self.context, a.head_dim)


def register_positions(module: nn.Module, rotary_dim: int, theta: float, rows: int, kv_heads: int) -> None:
    """The constants an export core reads positions through: RoPE cos/sin tables [rows, rotary_dim/2] in fp32
    (``inv_freq`` as transformers' ``compute_default_rope_parameters``), the cache row numbers and the KV head index
    (constants rather than aranges in forward: coremltools warns on every int64 arange it meets)."""
    cos, sin = rope_rows(torch.arange(rows), rotary_dim, theta)
    module.register_buffer(ROPE_COS, cos, persistent=False)
    module.register_buffer(ROPE_SIN, sin, persistent=False)
    module.register_buffer("cache_rows", torch.arange(rows, dtype=torch.int32), persistent=False)
    module.register_buffer("kv_head_index", torch.arange(kv_heads)[:, None], persistent=False)


def position_inputs(core: nn.Module, position_ids, dtype: torch.dtype) -> tuple:
    """What the attention layers of a call read, from its positions: cos, sin, the (KV head, cache row) write
    indices [Hkv, S] and the causal mask bias [S, context] (row c holds position c), in ``dtype``."""
    positions = position_ids[0].long()
    cos, sin = core.rope_cos[positions].to(dtype), core.rope_sin[positions].to(dtype)
    visible = core.cache_rows[None, :] <= position_ids[0][:, None]
    mask_bias = torch.where(visible, 0.0, -1e4).to(dtype)
    rows = positions[None, :].expand(core.args.num_key_value_heads, -1)
    return cos, sin, (core.kv_head_index.expand_as(rows), rows), mask_bias


def causal_attention(core: nn.Module, length: int) -> tuple:
    """``attention_inputs``' attention part for one sequence at positions 0..length-1 (GPTQ calibration)."""
    dtype, device = core.embed_tokens.weight.dtype, core.embed_tokens.weight.device
    positions = torch.arange(length, device=device)
    mask_bias = torch.where(positions[None, :] <= positions[:, None], 0.0, -1e4).to(dtype)
    rows = positions[None, :].expand(core.args.num_key_value_heads, -1)
    cos, sin = core.rope_cos[:length].to(dtype), core.rope_sin[:length].to(dtype)
    return cos, sin, (core.kv_head_index.expand_as(rows), rows), mask_bias


class CausalRunner:
    """Runs one decoder layer of ``core`` over a sequence of ``length`` tokens at positions 0..length-1 (GPTQ
    calibration, ``quant/calibrate.py``).

    The same inputs ``Qwen3Core.forward`` builds, for a zeroed cache holding exactly this sequence (each call
    writes every cache row before reading, so the cache is reused across samples without clearing).
    """

    def __init__(self, core: Qwen3Core, length: int):
        if length > core.context:
            raise ValueError(f"calibration length {length} exceeds the core's context {core.context}")
        args, dtype, device = core.args, core.embed_tokens.weight.dtype, core.embed_tokens.weight.device
        self.attention = causal_attention(core, length)
        cache = (args.num_hidden_layers, args.num_key_value_heads, length, args.head_dim)
        self.key_cache = torch.zeros(cache, dtype=dtype, device=device)
        self.value_cache = torch.zeros(cache, dtype=dtype, device=device)

    def __call__(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """``x`` [n, length, hidden] -> the layer's outputs, sample by sample."""
        return torch.stack([layer(s, *self.attention, self.key_cache, self.value_cache) for s in x])


LINEAR_GROUPS = (  # GPTQ's "true sequential" order: o_proj's Hessian sees the quantized q/k/v, and so on
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def calibration_runner(core: Qwen3Core, length: int) -> CausalRunner:
    return CausalRunner(core, length)


def linear_groups(core: Qwen3Core, layer: DecoderLayer) -> tuple[tuple[str, ...], ...]:
    return LINEAR_GROUPS


def cached_blocks(core: Qwen3Core, layer: DecoderLayer) -> tuple[tuple[str, str], ...]:
    """The layer's blocks whose output is their last linear's, each with that linear: ``Attention.forward`` returns
    ``o_proj(...)``, ``MLP.forward`` ``down_proj(...)``."""
    return ("self_attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")
