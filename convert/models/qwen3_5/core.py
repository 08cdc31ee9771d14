"""Qwen3.5: the torch modules (Gated DeltaNet, gated attention), the export core, its states and how GPTQ
calibrates and quantizes its layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from convert.export.ane import rms_norm, silu
from convert.export.names import CONV_STATE, KEY_CACHE, PENDING_BA, PENDING_QKV, RECURRENT_STATE, VALUE_CACHE
from convert.export.spec import DTYPE_NAMES, TensorSpec
from convert.models.layout import Layout
from convert.models.part import Part, build_embedding, build_head, part_input, part_outputs
from convert.models.qwen3.checkpoint import load_checkpoint_tensors
from convert.models.qwen3.config import Qwen3Args
from convert.models.qwen3.core import (
    MLP,
    Attention,
    RMSNorm,
    causal_attention,
    position_inputs,
    register_positions,
    rotate,
)
from convert.models.qwen3_5.config import LINEAR, QUERY_SCALE, VALUE_SCALE, Qwen35Args
from convert.models.qwen3_5.gated_delta import (
    ChunkMasks,
    causal_conv,
    chunk_sizes,
    delta_rule,
    l2norm,
    scaled_l2norm,
    softplus,
)


class ZeroCentredRMSNorm(RMSNorm):
    """The family's RMSNorm: ``x_normed * (1 + w)``, the gain stored around 0 (``Qwen3_5RMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((1.0 + self.weight.float()) * x32).to(x.dtype)

    def gain(self) -> torch.Tensor:
        return 1.0 + self.weight


def zero_centre_norms(module: nn.Module) -> None:
    """Replace every plain ``RMSNorm`` under ``module`` by a ``ZeroCentredRMSNorm``."""
    for name, child in module.named_children():
        if type(child) is RMSNorm:
            setattr(module, name, ZeroCentredRMSNorm(child.weight.shape[0], child.eps))
        else:
            zero_centre_norms(child)


class GatedAttention(Attention):
    """The family's full attention: Qwen3's (GQA, q_norm / k_norm, positional KV writes), plus the output gate and
    partial RoPE, as transformers' ``Qwen3_5Attention.forward`` / ``Qwen3NextAttention.forward``.

    With the gate, ``q_proj(x)`` is viewed [rows, heads, 2 x head_dim] and chunked into query and gate; the gate,
    flattened, multiplies the attention output by ``sigmoid(gate)`` before ``o_proj``. RoPE rotates the first
    ``rotary_dim`` dims of each q/k head after the norms (rotate-half) and passes the rest through; the cache holds
    the keys so rotated. Static-shape: views with ``-1``, constant slices, ``index_put_`` cache writes.
    """

    def __init__(self, args: Qwen3Args, layer_index: int, gated: bool, rotary_dim: int):
        super().__init__(args, layer_index)
        self.gated, self.rotary_dim = gated, rotary_dim
        if gated:
            rows = 2 * args.num_attention_heads * args.head_dim
            self.q_proj = nn.Linear(args.hidden_size, rows, bias=args.attention_bias)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on the leading ``rotary_dim`` dims (cos/sin [S, rotary_dim/2]), the rest unchanged."""
        if self.rotary_dim == self.head_dim:
            return rotate(x, cos, sin)
        return torch.cat([rotate(x[..., : self.rotary_dim], cos, sin), x[..., self.rotary_dim :]], dim=-1)

    def project(self, x, cos, sin):
        """q [heads, S, d] and k, v [kv heads, S, d], normed and rotated, and the gate [S, heads x d] (or None)."""
        d = self.head_dim
        if self.gated:
            q, gate = self.q_proj(x).view(-1, self.heads, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(-1, self.heads * d)
        else:
            q, gate = self.q_proj(x).view(-1, self.heads, d), None
        q = self.q_norm(q).transpose(0, 1)
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, d)).transpose(0, 1)
        v = self.v_proj(x).view(-1, self.kv_heads, d).transpose(0, 1)
        return self.rope(q, cos, sin), self.rope(k, cos, sin), v, gate


class GatedRMSNorm(nn.Module):
    """``Qwen3_5RMSNormGated``: ``w * rmsnorm(o) * silu(z)``, the weight used as is (not 1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = z.dtype
        o32 = o.float()
        normed = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return ((self.weight * normed).float() * silu(z.float())).to(dtype)

    def gain(self) -> torch.Tensor:
        return self.weight


class CausalConvWeight(nn.Module):
    """The depthwise conv's weight, [C, 1, K] as transformers stores it (``conv1d.weight``; no bias)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))


@dataclass
class Call:
    """What every layer of one call needs besides its input rows: the call's static width and its commit inputs,
    ``accept`` [1] int32 (rows left pending by the previous call to commit first) and, for a call that commits its
    own rows at once (prefill), ``valid`` [1] int32 (its real rows; None for decode / verify)."""

    width: int
    accept: torch.Tensor
    valid: torch.Tensor | None

    def commit(self, core: Qwen35Core) -> Commit:
        """The call's commits as the stateful graph computes them from ``accept`` and ``valid``: comparisons with
        the row numbers and a gather of the conv history."""
        valid = self.valid
        return Commit(self.width, core.rows[: core.pending] < self.accept,
                      lambda window: core.select_rows(window, self.accept),
                      None if valid is None else core.rows[: self.width] < valid,
                      None if valid is None else lambda window: core.select_rows(window, valid))


@dataclass
class Commit:
    """How a call's Gated DeltaNet layers commit rows (package docstring: rollback): ``kept`` [pending], the pending
    rows of the previous call to commit (bool, or 1.0 / 0.0), and ``history(window)``, the conv history after them
    (rows of the [history | pending] window); for a call that commits its own rows (prefill), ``valid`` [width] and
    ``valid_history(window)`` the same for its rows (None for decode / verify, which leave them pending)."""

    width: int
    kept: torch.Tensor
    history: Callable[[torch.Tensor], torch.Tensor]
    valid: torch.Tensor | None
    valid_history: Callable[[torch.Tensor], torch.Tensor] | None


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer of the export core; ``slot`` is its index among the linear-attention layers (its
    row of the stacked GDN states)."""

    def __init__(self, args: Qwen35Args, slot: int):
        super().__init__()
        h, hv = args.hidden_size, args.linear_num_value_heads
        self.slot, self.args = slot, args
        self.in_proj_qkv = nn.Linear(h, args.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, args.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, hv, bias=False)
        self.in_proj_a = nn.Linear(h, hv, bias=False)
        self.conv1d = CausalConvWeight(args.conv_dim, args.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.norm = GatedRMSNorm(args.linear_value_head_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(args.value_dim, h, bias=False)

    def rule_inputs(self, window: torch.Tensor, ba: torch.Tensor, rows: int, keep: torch.Tensor | None,
                    core: Qwen35Core, with_query: bool = True):
        """q (None without ``with_query``: a commit needs no outputs), k, v, g, beta of the ``rows`` rows a conv
        ``window`` [K-1+rows, C] ends with, from their raw [b | a] rows ``ba`` [rows, 2 Hv]; rows where ``keep``
        [rows] is false (or 0.0) become identities (g = 0, beta = 0). In ``core.recurrence_dtype`` (fp32, or the
        activations' dtype), by value head (key heads repeated through the core's ``value_heads`` map), q and v
        carrying the device-safe scales. The conv computes in its weight's dtype where that is fp32 (kept), else in
        the window's."""
        a, value_heads = self.args, core.value_heads
        dtype, norm = recurrence(core, window.dtype)
        hk, hv = a.linear_num_key_heads, a.linear_num_value_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        weight = self.conv1d.weight
        if weight.dtype == torch.float32 and window.dtype != torch.float32:  # kept (an exact pack's): an fp32 conv
            mixed = silu(causal_conv(window.float(), weight, a.conv_dim))
        else:  # no cast of the window where there is none to make: the other packages' programs as they were
            mixed = silu(causal_conv(window, weight.to(window.dtype), a.conv_dim))
        q, k, v = mixed.split([a.key_dim, a.key_dim, a.value_dim], dim=-1)

        def by_value_head(t: torch.Tensor) -> torch.Tensor:  # value head j reads key head j // (hv / hk)
            if hk == hv:
                return t
            # the 0 / 1 [hv, hk] map times the rows, summed over the key heads, rather than a repeat (which lowers to
            # tile) or a product with a constant (which Core ML makes a linear layer): convert/verify/placement.py
            return (value_heads.to(t.dtype)[:, :, None] * t[:, None]).sum(2)

        if with_query:
            q = by_value_head(norm(q.reshape(rows, hk, dk).to(dtype)) * (dk**-0.5 * QUERY_SCALE))
        k = by_value_head(norm(k.reshape(rows, hk, dk).to(dtype)))
        v = v.reshape(rows, hv, dv).to(dtype) * VALUE_SCALE
        beta = torch.sigmoid(ba[:, :hv]).to(dtype)
        g = -torch.exp(self.A_log.to(dtype)) * softplus(ba[:, hv:].to(dtype) + self.dt_bias.to(dtype))
        if keep is not None and keep.dtype == torch.bool:
            beta, g = torch.where(keep[:, None], beta, 0.0), torch.where(keep[:, None], g, 0.0)
        elif keep is not None:  # 1.0 / 0.0 (the host's masks, ane layout): no select
            beta, g = beta * keep[:, None].to(dtype), g * keep[:, None].to(dtype)
        return (q if with_query else None), k, v, g, beta

    def forward(self, x, call: Call, core: Qwen35Core, conv_state, recurrent_state, pending_qkv, pending_ba):
        """x [S, H] -> [S, H]; reads and writes this layer's rows of the GDN states (package docstring: rollback)."""
        s, slot = call.width, self.slot
        mixed = self.in_proj_qkv(x)
        ba = torch.cat([self.in_proj_b(x), self.in_proj_a(x)], dim=-1)
        # before the recurrence: a GPTQ pass capturing in_proj_qkv / in_proj_z stops before it (quant/calibrate.py)
        z = self.in_proj_z(x)
        out, state, history = self.recur(mixed, ba, call.commit(core), core, conv_state[slot], recurrent_state[slot],
                                         pending_qkv[slot], pending_ba[slot])
        if call.valid is not None:
            # nothing is pending after a prefill, but every function must write every state for it to stay a state
            # (an unwritten buffer converts to a constant): write a row back unchanged
            pending_qkv[slot : slot + 1, 0:1] = pending_qkv[slot : slot + 1, 0:1].clone()
            pending_ba[slot : slot + 1, 0:1] = pending_ba[slot : slot + 1, 0:1].clone()
        else:
            pending_qkv[slot : slot + 1, 0:s] = mixed[None].to(pending_qkv.dtype)
            pending_ba[slot : slot + 1, 0:s] = ba[None].to(pending_ba.dtype)
        recurrent_state[slot : slot + 1] = state[None].to(recurrent_state.dtype)
        conv_state[slot : slot + 1] = history[None].to(conv_state.dtype)
        return self.out_proj(self.gated_output(out, z, core))

    def recur(self, mixed, ba, commit: Commit, core: Qwen35Core, conv_state, recurrent_state, pending_qkv,
              pending_ba):
        """The recurrence of one call from this layer's states (``conv_state`` [K-1, C], ``recurrent_state`` [Hv, dk,
        dv], ``pending_qkv`` [P, C], ``pending_ba`` [P, 2 Hv]) and its rows ``mixed`` [S, C] (in_proj_qkv's) and
        ``ba`` [S, 2 Hv]: 1. the previous call's pending rows the commit keeps, committed; 2. this call's rows from
        the committed state. Returns the outputs [S, Hv, dv] (in the recurrence's dtype, still carrying the
        device-safe scales), the recurrent state and the conv
        history to keep: after this call's valid rows for a prefill, else the committed ones (decode and verify
        leave their rows pending)."""
        s, dtype = commit.width, mixed.dtype
        window = torch.cat([conv_state.to(dtype), pending_qkv.to(dtype)])
        _, k, v, g, beta = self.rule_inputs(window, pending_ba.to(dtype), core.pending, commit.kept, core,
                                            with_query=False)
        state = recurrent_state.to(recurrence(core, dtype)[0])
        _, state = delta_rule(state, None, k, v, g, beta, core.pending, core.chunk_masks)
        history = commit.history(window)
        window = torch.cat([history, mixed])
        q, k, v, g, beta = self.rule_inputs(window, ba, s, commit.valid, core)
        out, after = delta_rule(state, q, k, v, g, beta, s, core.chunk_masks)
        if commit.valid is not None:
            state, history = after, commit.valid_history(window)
        return out, state, history

    def gated_output(self, out: torch.Tensor, z: torch.Tensor, core: Qwen35Core) -> torch.Tensor:
        """The recurrence's outputs [S, Hv, dv] (carrying the device-safe scales) through the gated norm with ``z``
        [S, value_dim]: out_proj's input [S, value_dim]. With the recurrence in the activations' dtype (the ane
        layout) the norm is taken of the scaled outputs, finite in fp16 (``export.ane.rms_norm``, its eps scaled
        with them: the same quotient), where the unscaled ones would be subnormal."""
        a, scale = self.args, QUERY_SCALE * VALUE_SCALE
        z = z.view(-1, a.linear_num_value_heads, a.linear_value_head_dim)
        if core.recurrence_dtype is None:
            normed = rms_norm(self.norm, out.to(z.dtype), dim=-1, eps=self.norm.eps * scale**2)
            return (normed * silu(z)).reshape(-1, a.value_dim)
        out = (out * (1.0 / scale)).to(z.dtype)
        return self.norm(out, z).reshape(-1, a.value_dim)


def recurrence(core: Qwen35Core, activations: torch.dtype) -> tuple[torch.dtype, Callable]:
    """The dtype the delta rule runs in and the l2norm it takes: fp32 and transformers' form (the stateful cores), or
    the activations' dtype and the form finite in fp16 (the ane layout's, ``recurrence_dtype`` None: the Neural
    Engine computes in fp16 only)."""
    if core.recurrence_dtype is None:
        return activations, scaled_l2norm
    return core.recurrence_dtype, l2norm


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen35Args, index: int, first: int = 0):
        """Layer ``index`` of a core whose layers start at ``first`` (a part's): its row of the states of its kind is
        counted from there."""
        super().__init__()
        self.kind = args.layer_types[index]
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(args, layers_before(args.linear_layers, index, first))
        else:
            slot = layers_before(args.full_layers, index, first)
            self.self_attn = GatedAttention(args.attention_args, slot, True, args.rotary_dim)
        self.mlp = MLP(args.attention_args, activation=silu)
        self.input_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)
        zero_centre_norms(self)

    def forward(self, x, attention: tuple, call: Call, core: Qwen35Core, states: dict):
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            h = self.linear_attn(h, call, core, states[CONV_STATE], states[RECURRENT_STATE],
                                 states[PENDING_QKV], states[PENDING_BA])
        else:
            h = self.self_attn(h, *attention, states[KEY_CACHE], states[VALUE_CACHE])
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def layers_before(kind: tuple[int, ...], index: int, first: int) -> int:
    """How many layers of a kind (``kind``: their indices) lie in ``first .. index-1``: layer ``index``'s row of that
    kind's states in a core whose layers start at ``first``."""
    return sum(first <= i < index for i in kind)


class Qwen35Core(nn.Module):
    """The shared computation behind every function of a hybrid target (see the package docstring, __init__.py).

    ``forward(input_ids, position_ids, accept, <states>, valid=None, width=...)`` returns ``argmax_ids`` [1,S]
    int32, ``logits``, ``hidden`` (final-norm output) and, with taps, ``taps`` (output of layer i, 0-based, in the
    given order). ``width`` is the function's static S (a Python int: no tensor shape is read in the graph);
    ``pending`` is the rows of ``pending_qkv`` / ``pending_ba``, at least the widest decode / verify.
    """

    recurrence_dtype: torch.dtype | None = torch.float32  # None: the activations' dtype (``recurrence``)

    def __init__(self, args: Qwen35Args, context: int, taps: tuple[int, ...] = (), pending: int = 8,
                 widths: tuple[int, ...] = (64, 1, 8), part: Part | None = None):
        super().__init__()
        self.part = part or Part.whole(args)
        self.args, self.context, self.taps, self.pending = args, context, self.part.own_taps(taps), pending
        build_embedding(self, args)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self.part.layers[0]) for i in self.part.layer_indices)
        build_head(self, args, ZeroCentredRMSNorm)
        if not self.layers:
            return
        register_positions(self, args.rotary_dim, args.rope_theta, context, args.num_key_value_heads)
        self.register_buffer("rows", torch.arange(max(pending, context) + args.linear_conv_kernel_dim,
                                                  dtype=torch.int32), persistent=False)
        # value head j reads key head j // (hv / hk): a 0 / 1 map (bool: a module's .to(dtype) leaves it alone)
        ratio = args.linear_num_value_heads // args.linear_num_key_heads
        heads = torch.arange(args.linear_num_value_heads)[:, None] // ratio == torch.arange(args.linear_num_key_heads)
        self.register_buffer("value_heads", heads, persistent=False)
        for size in chunk_sizes((*widths, pending)):  # only the chunks the functions use: each buffer is an input
            masks = ChunkMasks.of(size)
            for name in ChunkMasks.names():
                self.register_buffer(f"chunk{size}_{name}", getattr(masks, name), persistent=False)

    def chunk_masks(self, size: int) -> ChunkMasks | None:
        """The constants of a chunk of ``size`` rows (None for one row: the recurrence needs none); sizes no function
        has (a calibration sample's last chunk) are made on the spot."""
        if size == 1:
            return None
        if not hasattr(self, f"chunk{size}_eye"):
            masks = ChunkMasks.of(size)
            return ChunkMasks(size, *(getattr(masks, n).to(self.rows.device) for n in ChunkMasks.names()))
        return ChunkMasks(size, *(getattr(self, f"chunk{size}_{name}") for name in ChunkMasks.names()))

    def select_rows(self, window: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Rows ``start .. start+K-2`` of ``window`` (``start`` [1] int32, a runtime value): the conv history that
        ends at the last of ``start`` committed rows (a gather by index)."""
        return window.index_select(0, (self.rows[: self.args.linear_conv_kernel_dim - 1] + start).long())

    def load_weights(self, tensors: dict[str, torch.Tensor], layout: Layout) -> None:
        """Fill from checkpoint tensors (already checked by ``sanitize``) under their ``layout`` keys."""
        load_checkpoint_tensors(self, tensors, layout)

    def forward(self, input_ids=None, position_ids=None, accept=None, key_cache=None, value_cache=None,
                conv_state=None, recurrent_state=None, pending_qkv=None, pending_ba=None, valid=None,
                hidden_states=None, *, width: int):
        x = part_input(self, input_ids, hidden_states)
        tapped = []
        if self.layers:
            attention = position_inputs(self, position_ids, x.dtype)
            states = {KEY_CACHE: key_cache, VALUE_CACHE: value_cache, CONV_STATE: conv_state,
                      RECURRENT_STATE: recurrent_state, PENDING_QKV: pending_qkv, PENDING_BA: pending_ba}
            call = Call(width, accept, valid)
            for i, layer in zip(self.part.layer_indices, self.layers, strict=True):
                x = layer(x, attention, call, self, states)
                if i in self.taps:
                    tapped.append((self.taps.index(i), x))
        return part_outputs(self, x, tapped)


def state_specs(args: Qwen35Args, context: int, pending: int, dtype: str,
                layers: range | None = None) -> tuple[TensorSpec, ...]:
    """The states every function shares: KV caches for the attention layers, and per GDN layer the committed conv
    history, the recurrent state and the pending rows of the last decode / verify; of ``layers`` only (a part's;
    default every layer). Kinds with no layer are left out."""
    a = args
    layers = range(a.num_hidden_layers) if layers is None else layers
    full = sum(i in layers for i in a.full_layers)
    linear = sum(i in layers for i in a.linear_layers)
    specs = []
    if full:
        kv = (full, a.num_key_value_heads, context, a.head_dim)
        specs += [TensorSpec(KEY_CACHE, kv, dtype), TensorSpec(VALUE_CACHE, kv, dtype)]
    if linear:
        specs += [
            TensorSpec(CONV_STATE, (linear, a.linear_conv_kernel_dim - 1, a.conv_dim), dtype),
            TensorSpec(RECURRENT_STATE, (linear, a.linear_num_value_heads, a.linear_key_head_dim,
                                           a.linear_value_head_dim), dtype),
            TensorSpec(PENDING_QKV, (linear, pending, a.conv_dim), dtype),
            TensorSpec(PENDING_BA, (linear, pending, 2 * a.linear_num_value_heads), dtype),
        ]
    return tuple(specs)


KEEP_FP16 = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")  # see docs/hybrid.md, "What stays fp16"
GDN_GROUPS = (("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"), ("linear_attn.out_proj",))
ATTENTION_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",))
MLP_GROUPS = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


class HybridRunner:
    """Runs one decoder layer of ``core`` over a whole sample of ``length`` tokens from zeroed states, as a prefill
    that commits every row (GPTQ calibration, ``quant/calibrate.py``)."""

    def __init__(self, core: Qwen35Core, length: int):
        if length > core.context:
            raise ValueError(f"calibration length {length} exceeds the core's context {core.context}")
        dtype, device = core.embed_tokens.weight.dtype, core.embed_tokens.weight.device
        a = core.args
        self.attention = causal_attention(core, length)
        self.core = core
        self.call = Call(length, torch.zeros(1, dtype=torch.int32, device=device),
                         torch.full((1,), length, dtype=torch.int32, device=device))
        self.states = {s.name: torch.zeros(s.shape, dtype=dtype, device=device)
                       for s in state_specs(a, length, core.pending, DTYPE_NAMES[dtype])}

    def __call__(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """``x`` [n, length, hidden] -> the layer's outputs, sample by sample, each from zeroed GDN states."""
        outputs = []
        for sample in x:
            for state in self.states.values():
                state.zero_()
            outputs.append(layer(sample, self.attention, self.call, self.core, self.states))
        return torch.stack(outputs)


def calibration_runner(core: Qwen35Core, length: int) -> HybridRunner:
    return HybridRunner(core, length)


def linear_groups(core: Qwen35Core, layer: DecoderLayer) -> tuple[tuple[str, ...], ...]:
    return (GDN_GROUPS if layer.kind == LINEAR else ATTENTION_GROUPS) + MLP_GROUPS


def cached_blocks(core: Qwen35Core, layer: DecoderLayer) -> tuple[tuple[str, str], ...]:
    """The layer's blocks whose output is their last linear's, each with that linear: ``GatedDeltaNet.forward``
    returns ``out_proj(...)``, ``GatedAttention`` (``Attention.forward``) ``o_proj(...)``, ``MLP.forward``
    ``down_proj(...)``."""
    mixer = ("linear_attn", "linear_attn.out_proj") if layer.kind == LINEAR else ("self_attn", "self_attn.o_proj")
    return mixer, ("mlp", "mlp.down_proj")
