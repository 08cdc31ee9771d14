"""Qwen3.5 family targets (Qwen3.5 / 3.6 / 3.8, and the unpacked Ternary Bonsai 2): hybrid Gated DeltaNet + gated
attention, with a rollback that is exact for any accepted prefix.

Semantics are transformers' (models/qwen3_5/modeling_qwen3_5.py, the reference of every test and gate):

* Layers follow ``layer_types`` (or ``full_attention_interval``, default 4: every 4th layer full attention), any mix
  and order. Decoder norms are zero-centred, ``x_normed * (1 + w)``.
* Full attention (``Qwen3_5Attention``): gated (``q_proj`` gives [query | gate] per head; the output is multiplied by
  ``sigmoid(gate)`` before ``o_proj``), q_norm / k_norm zero-centred, partial RoPE on the first
  ``int(head_dim * partial_rotary_factor)`` dims. Qwen3.5's multimodal RoPE (``mrope_section``) equals plain RoPE on
  text positions (its three position rows are equal), so the functions take 1-D positions.
* Gated DeltaNet (``Qwen3_5GatedDeltaNet``): ``in_proj_qkv`` -> depthwise causal conv (kernel K) -> SiLU -> q | k | v;
  value head j reads key head j // (value heads / key heads); q and k l2-normalised (eps 1e-6), q scaled by
  ``key_head_dim ** -0.5``; ``beta = sigmoid(in_proj_b x)``, ``g = -exp(A_log) * softplus(in_proj_a x + dt_bias)``
  (fp32); per token ``S <- e^g S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q``; then
  ``out_proj(w * rmsnorm(o) * silu(z))`` with the gated norm's weight used as is (not 1 + w).

The export core computes the delta rule in fp32 in chunks (the WY form transformers' ``torch_chunk_gated_delta_rule``
uses, with the unit-triangular inverse as a product of ``log2(chunk)`` factors instead of a row-by-row solve), and
in the device-safe forms of ``docs/hybrid.md``: softplus as ``relu(x) + log1p(exp(-|x|))``, SiLU as
``x / (1 + exp(-x))``, q and v scaled by powers of two (so the state update has no subnormal products in fp16; exact
in any binary format, the outputs are scaled back).

Rollback (the host contract, ``host_contract``): ``decode`` and ``verify`` never commit their own rows to the
Gated DeltaNet states. They leave them pending (the pre-conv ``in_proj_qkv`` rows and the raw ``in_proj_b`` /
``in_proj_a`` rows, in ``pending_qkv`` / ``pending_ba``); every call first commits the first ``accept`` pending rows
(``accept`` is an input, 0..rows of the previous call), by running them through the conv and the delta rule with
the rows past ``accept`` made identities (g = 0, beta = 0: ``e^0 S + k (0)^T = S``), then runs its own rows from
there.
``prefill`` commits its own first ``valid`` rows itself (a prompt's tokens are never rejected; a padded last chunk
passes its real row count) and leaves nothing pending. Attention layers keep positional KV rows as the dense target
does. The state after any accept is therefore exactly the state of running only the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2

import torch
from torch import nn

from convert import fields
from convert.errors import InputError, quote
from convert.export.functions import NamedFunction
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models import qwen3
from convert.models.layout import Layout
from convert.models.part import (
    Part,
    build_embedding,
    build_head,
    function_widths,
    part_input,
    part_outputs,
    part_tensors,
)
from convert.models.qwen3 import (
    MLP,
    Attention,
    Qwen3Args,
    RMSNorm,
    causal_attention,
    load_checkpoint_tensors,
    position_inputs,
    register_positions,
    rotate,
)

FAMILY = "qwen3_5"
ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR, FULL = "linear_attention", "full_attention"
TEXT_PREFIXES = ("model.language_model.", "model.")  # Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM
VISION_PREFIX, MTP_PREFIX = "model.visual.", "mtp."
FUSED_MARKERS = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next's per-key-head-group fused projections
# transformers' Qwen3_5TextConfig defaults, used where config.json leaves a field out
DEFAULTS = dict(head_dim=256, partial_rotary_factor=0.25, full_attention_interval=4, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, intermediate_size=12288,
                vocab_size=248320)
# Device-safe scaling (docs/hybrid.md): powers of two, so exact in fp32 and fp16 alike.
QUERY_SCALE, VALUE_SCALE = 16.0, 64.0
CHUNK = 64  # rows per chunk of the delta rule (a call's rows are processed in chunks of at most this many)
STATE_NAMES = ("key_cache", "value_cache", "conv_state", "recurrent_state", "pending_qkv", "pending_ba")
HOST_CONTRACT_NAME, HOST_CONTRACT_VERSION = "spec-convert/commit-next-call", 1
LAZY_FUNCTIONS = ("decode", "verify")  # rows left pending, committed by the next call's `accept`


def accepts(config: dict) -> bool:
    text = config.get("text_config", config)
    archs = set(config.get("architectures") or [])
    return bool(archs & set(ARCHITECTURES)) or str(text.get("model_type", config.get("model_type"))) in MODEL_TYPES


@dataclass(frozen=True)
class Qwen35Args:
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    rope_type = "default"
    family = FAMILY
    unsafe_ops = ("silu", "softplus")  # replaced by device-safe forms; no package function may hold them

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> Qwen35Args:
        """The args from config.json (``text_config`` when nested); a field of the wrong type or a size below 1 is
        refused naming it (``convert/fields.py``); an absent field takes transformers' default (``DEFAULTS``)."""
        nested = "text_config" in config
        text = fields.section(config, where)
        if text.get("hidden_act", "silu") != "silu":
            raise InputError(f"{where}: hidden_act {quote(text['hidden_act'])}: only silu is supported")
        rope = fields.mapping(text, "rope_parameters", where)
        scaling = fields.mapping(text, "rope_scaling", where)
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise InputError(f"{where}: rope type {quote(rope_type)} is not supported yet (only 'default')")
        need = " needed for a Qwen3.5 model"
        layers = fields.integer(text, "num_hidden_layers", where, maximum=fields.MAX_LAYERS, needed=need)
        hidden = fields.integer(text, "hidden_size", where, needed=need)
        heads = fields.integer(text, "num_attention_heads", where, needed=need)
        layer_types = _layer_types(text, layers, where)

        def size(name: str) -> int:  # a size field, transformers' default when absent
            return fields.integer(text, name, where, DEFAULTS[name])

        head_dim = size("head_dim")
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
        partial = fields.check_number(DEFAULTS["partial_rotary_factor"] if partial is None else partial,
                                      "partial_rotary_factor", where, positive=False)
        rotary_dim = int(head_dim * partial) if 0 < partial <= 1 else 0  # compute_default_rope_parameters
        if not (0 < partial <= 1 and rotary_dim > 0 and rotary_dim % 2 == 0):
            raise InputError(f"{where}: partial_rotary_factor={partial} gives {rotary_dim} rotary dims of head_dim "
                             f"{head_dim}: needs a positive even number, at most head_dim")
        key_heads, value_heads = size("linear_num_key_heads"), size("linear_num_value_heads")
        if LINEAR in layer_types and value_heads % key_heads:
            raise InputError(f"{where}: linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads "
                             f"{key_heads} (value head j reads key head j // (value heads / key heads))")
        kv_heads = fields.integer(text, "num_key_value_heads", where, heads)
        if FULL in layer_types and heads % kv_heads:
            raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads}")
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        # a nested config's tying is the top-level field (what Qwen3_5ForConditionalGeneration ties by)
        tie = fields.flag(config if nested else text, "tie_word_embeddings", where)
        theta = fields.number(text, "rope_theta", where, DEFAULTS["rope_theta"])
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=fields.number(rope, "rope_theta", where, theta, field="rope_parameters.rope_theta"),
            intermediate_size=size("intermediate_size"),
            vocab_size=size("vocab_size"),
            rms_norm_eps=fields.number(text, "rms_norm_eps", where, DEFAULTS["rms_norm_eps"]),
            tie_word_embeddings=tie,
            max_position_embeddings=size("max_position_embeddings"),
            attention_bias=fields.flag(text, "attention_bias", where),
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            linear_key_head_dim=size("linear_key_head_dim"),
            linear_value_head_dim=size("linear_value_head_dim"),
            linear_conv_kernel_dim=size("linear_conv_kernel_dim"),
            bos_token_id=fields.token_id(text.get("bos_token_id", config.get("bos_token_id")), "bos_token_id", where),
            eos_token_id=fields.token_id(eos, "eos_token_id", where),
            pad_token_id=fields.token_id(text.get("pad_token_id", config.get("pad_token_id")), "pad_token_id", where),
        )

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: the q | k | v rows of ``in_proj_qkv``."""
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_args(self) -> Qwen3Args:
        """A full-attention layer's shapes, for the shared attention and MLP modules."""
        return Qwen3Args(
            hidden_size=self.hidden_size, num_hidden_layers=len(self.full_layers),
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings, attention_bias=self.attention_bias,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )

    @property
    def parameter_count(self) -> int:
        return sum(torch.Size(s).numel() for s in expected_shapes(self).values())


def _layer_types(text: dict, layers: int, where: str) -> tuple[str, ...]:
    types = fields.strings(text, "layer_types", where)
    if types is None:
        interval = fields.integer(text, "full_attention_interval", where, DEFAULTS["full_attention_interval"])
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(layers))
    if len(types) != layers:
        raise InputError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers {layers}")
    for i, kind in enumerate(types):
        if kind not in (LINEAR, FULL):
            raise InputError(f"{where}: layer_types[{i}] is {quote(kind)}: a Qwen3.5 layer is {LINEAR!r} or "
                             f"{FULL!r}")
    return tuple(types)


# ----------------------------------------------------------------------------------------------- checkpoint keys


def layer_shapes(args: Qwen35Args, i: int) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s tensors, canonical keys (``model.layers.{i}.``...), with their shapes."""
    h, p, inter = args.hidden_size, f"model.layers.{i}.", args.intermediate_size
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
              p + "mlp.down_proj.weight": (h, inter)}
    if args.layer_types[i] == LINEAR:
        a, hv = p + "linear_attn.", args.linear_num_value_heads
        shapes.update({a + "in_proj_qkv.weight": (args.conv_dim, h), a + "in_proj_z.weight": (args.value_dim, h),
                       a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                       a + "conv1d.weight": (args.conv_dim, 1, args.linear_conv_kernel_dim),
                       a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (args.linear_value_head_dim,),
                       a + "out_proj.weight": (h, args.value_dim)})
        return shapes
    a, d = p + "self_attn.", args.head_dim
    q, kv = args.num_attention_heads * d, args.num_key_value_heads * d
    shapes.update({a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                   a + "o_proj.weight": (h, q), a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    if args.attention_bias:
        shapes.update({a + "q_proj.bias": (2 * q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                       a + "o_proj.bias": (h,)})
    return shapes


def expected_shapes(args: Qwen35Args) -> dict[str, tuple[int, ...]]:
    """Every tensor of the text model, by canonical key (``model.*``, ``lm_head.weight``), with its shape."""
    shapes = {"model.embed_tokens.weight": (args.vocab_size, args.hidden_size),
              "model.norm.weight": (args.hidden_size,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, args.hidden_size)
    for i in range(args.num_hidden_layers):
        shapes.update(layer_shapes(args, i))
    return shapes


def sanitize(shapes_in_checkpoint: dict[str, tuple[int, ...]], args: Qwen35Args, where: str = "checkpoint") -> Layout:
    """Refuse a checkpoint whose text-model keys or shapes are not exactly this config's, naming the tensor.

    The vision tower (``model.visual.*``) is left out of the target and the MTP head (``mtp.*``) is the MTP
    drafter's; both are counted in the returned layout. A tied checkpoint may still carry ``lm_head.weight``.
    """
    fused = sorted(k for k in shapes_in_checkpoint if any(f".{m}." in k for m in FUSED_MARKERS))
    if fused:
        raise InputError(f"{where}: tensor {fused[0]!r}: Qwen3-Next's fused in_proj_qkvz / in_proj_ba layout is not "
                         "supported (Qwen3.5 checkpoints store in_proj_qkv, in_proj_z, in_proj_b, in_proj_a apart)")
    prefix = next((p for p in TEXT_PREFIXES if any(k.startswith(p + "layers.") or k == p + "embed_tokens.weight"
                                                    for k in shapes_in_checkpoint)), None)
    if prefix is None:
        raise InputError(f"{where}: no text-model tensors (expected model.language_model.* or model.*)")
    groups = {"vision tower (model.visual.*)": VISION_PREFIX, "MTP head (mtp.*)": MTP_PREFIX}
    counts = {what: sum(k.startswith(start) for k in shapes_in_checkpoint) for what, start in groups.items()}
    layout = Layout(prefix, tuple((what, n) for what, n in counts.items() if n))
    present = {k: tuple(v) for k, v in shapes_in_checkpoint.items() if not k.startswith((VISION_PREFIX, MTP_PREFIX))}
    if args.tie_word_embeddings:
        present.pop("lm_head.weight", None)
    by_canonical = {layout.canonical(k): k for k in present}
    for key, shape in expected_shapes(args).items():
        stored = layout.stored(key)
        if key not in by_canonical:
            raise InputError(f"{where}: tensor {stored!r} is missing (expected shape {list(shape)})")
        if present[by_canonical[key]] != shape:
            raise InputError(f"{where}: tensor {stored!r} has shape {list(present[by_canonical[key]])}, expected "
                             f"{list(shape)}")
    unknown = sorted(set(by_canonical) - set(expected_shapes(args)))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise InputError(f"{where}: unexpected tensor {by_canonical[unknown[0]]!r}{more} for this Qwen3.5 config")
    return layout


# ------------------------------------------------------------------------------------------------ device-safe forms


def softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus as ``relu(x) + log1p(exp(-|x|))``: never exponentiates a large argument (fp16's exp(x) overflows
    above 11, and the ANE's native softplus returns 0 there)."""
    return torch.relu(x) + torch.log1p(torch.exp(-x.abs()))


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU as ``x / (1 + exp(-x))``: the ANE's native silu has ~1e-3 absolute error near 0, and coremltools fuses
    ``x * sigmoid(x)`` back into that op (``mil_backend::fuse_activation_silu``); this form has no sigmoid to fuse.
    For x below about -11, fp16's exp(-x) overflows to inf and the quotient is -0, the right limit."""
    return x / (1.0 + torch.exp(-x))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` (the FLA form): ``x * rsqrt(sum x^2 + eps)``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(window: torch.Tensor, weight: torch.Tensor, channels: int) -> torch.Tensor:
    """Depthwise causal conv: ``window`` [K-1+S, C] (history, then the S new rows), ``weight`` [C, 1, K] -> [S, C];
    row t is ``sum_j weight[:, 0, j] * window[t + j]``, transformers' ``F.conv1d`` over [history | rows], one op."""
    return torch.nn.functional.conv1d(window.T[None], weight, groups=channels)[0].T


def unit_lower_inverse(a: torch.Tensor, masks: ChunkMasks) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``a`` [..., C, C] (C = ``masks.size``): with N = -A nilpotent
    (N^C = 0) the inverse is sum_m N^m = prod_j (I + N^(2^j)), j < ceil(log2 C): 2 ceil(log2 C) - 2 matmuls of C x C
    where a row-by-row solve takes C - 1 dependent steps."""
    n = -a
    inverse = masks.eye.to(a.dtype) + n
    for _ in range(1, ceil(log2(masks.size))):
        n = n @ n
        inverse = inverse + inverse @ n
    return inverse


@dataclass(frozen=True)
class ChunkMasks:
    """Constants of a chunk of C > 1 rows, bool [C, C] (so a module's ``.to(dtype)`` leaves them alone): strictly
    lower and lower-with-diagonal masks, and the identity."""

    size: int
    strict: torch.Tensor
    lower: torch.Tensor
    eye: torch.Tensor

    @classmethod
    def of(cls, size: int) -> ChunkMasks:
        lower = torch.ones(size, size, dtype=torch.bool).tril()
        return cls(size, lower.tril(-1), lower, torch.eye(size, dtype=torch.bool))


def delta_rule_chunk(state, q, k, v, g, beta, masks: ChunkMasks | None):
    """One chunk of the gated delta rule in WY form, fp32, head-major: ``state`` [H, dk, dv]; ``q`` (None when only
    the state is wanted) and ``k`` [H, C, dk]; ``v`` [H, C, dv]; ``g`` (log decay) and ``beta`` [H, C]; ``masks``
    None for a single row (the recurrence itself), else the chunk's ``ChunkMasks``.

    Returns (outputs [H, C, dv] or None, the state after the chunk): the C steps of ``S <- e^g S;
    delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q`` (tests/test_qwen3_5.py compares them). With
    G_i = g_1 + ... + g_i and T = (I + A)^-1, A_ij = beta_i e^(G_i - G_j) k_i . k_j (j < i):
    Delta = T (beta (V - e^G K S)), O = e^G Q S + (Q K^T . e^(G_i - G_j), j <= i) Delta,
    S' = e^(G_C) S + (K e^(G_C - G))^T Delta.
    """
    if masks is None:
        decayed = state * torch.exp(g)[:, :, None]
        delta = beta[:, :, None] * (v - k @ decayed)
        state = decayed + k.transpose(1, 2) @ delta
        return (None if q is None else q @ state), state
    cumulative = torch.cumsum(g, dim=1)  # [H, C]
    gaps = cumulative[:, :, None] - cumulative[:, None, :]  # G_i - G_j
    decay = torch.exp(torch.where(masks.lower, gaps, -1e4))  # e^(G_i - G_j) for j <= i, else 0
    system = torch.where(masks.strict, beta[:, :, None] * (k @ k.transpose(1, 2)) * decay, 0.0)
    from_start = torch.exp(cumulative)[:, :, None]  # e^(G_i)
    delta = unit_lower_inverse(system, masks) @ (beta[:, :, None] * (v - from_start * (k @ state)))
    outputs = None if q is None else from_start * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ delta
    last = cumulative[:, -1:]  # [H, 1]
    state = torch.exp(last)[:, :, None] * state + (k * torch.exp(last - cumulative)[:, :, None]).transpose(1, 2) @ delta
    return outputs, state


def chunk_sizes(widths) -> set[int]:
    """The sizes (> 1) of the chunks ``delta_rule`` cuts calls of these widths into."""
    return {min(CHUNK, w - start) for w in widths for start in range(0, w, CHUNK)} - {1}


def delta_rule(state, q, k, v, g, beta, rows: int, masks):
    """The gated delta rule over ``rows`` rows in chunks of at most ``CHUNK`` (``delta_rule_chunk``); row-major
    inputs ``q``/``k`` [rows, H, dk], ``v`` [rows, H, dv], ``g``/``beta`` [rows, H]; ``masks(size)`` gives a chunk's
    ``ChunkMasks``."""
    outputs = []
    for start in range(0, rows, CHUNK):
        end = min(rows, start + CHUNK)
        part = [None if t is None else t[start:end].transpose(0, 1) for t in (q, k, v, g, beta)]
        out, state = delta_rule_chunk(state, *part, masks(end - start))
        if out is not None:
            outputs.append(out.transpose(0, 1))
    return (torch.cat(outputs) if outputs else None), state


# ----------------------------------------------------------------------------------------------------- modules


class ZeroCentredRMSNorm(RMSNorm):
    """The family's RMSNorm: ``x_normed * (1 + w)``, the gain stored around 0 (``Qwen3_5RMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((1.0 + self.weight.float()) * x32).to(x.dtype)


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
                    with_query: bool = True):
        """q (None without ``with_query``: a commit needs no outputs), k, v, g, beta of the ``rows`` rows a conv
        ``window`` [K-1+rows, C] ends with, from their raw [b | a] rows ``ba`` [rows, 2 Hv]; rows where ``keep``
        [rows] is false become identities (g = 0, beta = 0). fp32, by value head (key heads repeated), q and v
        carrying the device-safe scales."""
        a = self.args
        hk, hv = a.linear_num_key_heads, a.linear_num_value_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        mixed = silu(causal_conv(window, self.conv1d.weight.to(window.dtype), a.conv_dim))
        q, k, v = mixed.split([a.key_dim, a.key_dim, a.value_dim], dim=-1)

        def by_value_head(t: torch.Tensor) -> torch.Tensor:  # value head j reads key head j // (hv / hk)
            return t[:, :, None, :].expand(rows, hk, hv // hk, dk).reshape(rows, hv, dk)

        if with_query:
            q = by_value_head(l2norm(q.reshape(rows, hk, dk).float()) * (dk**-0.5 * QUERY_SCALE))
        k = by_value_head(l2norm(k.reshape(rows, hk, dk).float()))
        v = v.reshape(rows, hv, dv).float() * VALUE_SCALE
        beta = torch.sigmoid(ba[:, :hv]).float()
        g = -torch.exp(self.A_log.float()) * softplus(ba[:, hv:].float() + self.dt_bias.float())
        if keep is not None:
            beta, g = torch.where(keep[:, None], beta, 0.0), torch.where(keep[:, None], g, 0.0)
        return (q if with_query else None), k, v, g, beta

    def forward(self, x, call: Call, core: Qwen35Core, conv_state, recurrent_state, pending_qkv, pending_ba):
        """x [S, H] -> [S, H]; reads and writes this layer's rows of the GDN states (module docstring: rollback)."""
        s, slot, pending = call.width, self.slot, core.pending
        # 1. commit the first `accept` rows left pending by the previous call
        window = torch.cat([conv_state[slot].to(x.dtype), pending_qkv[slot].to(x.dtype)])
        kept = core.rows[:pending] < call.accept
        _, k, v, g, beta = self.rule_inputs(window, pending_ba[slot].to(x.dtype), pending, kept, with_query=False)
        _, state = delta_rule(recurrent_state[slot].float(), None, k, v, g, beta, pending, core.chunk_masks)
        history = core.select_rows(window, call.accept)
        # 2. this call's rows, from the committed state
        mixed = self.in_proj_qkv(x)
        ba = torch.cat([self.in_proj_b(x), self.in_proj_a(x)], dim=-1)
        # before the recurrence: a GPTQ pass capturing in_proj_qkv / in_proj_z stops before it (quant/calibrate.py)
        z = self.in_proj_z(x).view(s, self.args.linear_num_value_heads, self.args.linear_value_head_dim)
        window = torch.cat([history, mixed])
        keep = None if call.valid is None else core.rows[:s] < call.valid
        q, k, v, g, beta = self.rule_inputs(window, ba, s, keep)
        out, after = delta_rule(state, q, k, v, g, beta, s, core.chunk_masks)
        # 3. states: a prefill commits its valid rows; decode / verify leave theirs pending
        if call.valid is not None:
            state, history = after, core.select_rows(window, call.valid)
            # nothing is pending after a prefill, but every function must write every state for it to stay a state
            # (an unwritten buffer converts to a constant): write a row back unchanged
            pending_qkv[slot : slot + 1, 0:1] = pending_qkv[slot : slot + 1, 0:1].clone()
            pending_ba[slot : slot + 1, 0:1] = pending_ba[slot : slot + 1, 0:1].clone()
        else:
            pending_qkv[slot : slot + 1, 0:s] = mixed[None].to(pending_qkv.dtype)
            pending_ba[slot : slot + 1, 0:s] = ba[None].to(pending_ba.dtype)
        recurrent_state[slot : slot + 1] = state[None].to(recurrent_state.dtype)
        conv_state[slot : slot + 1] = history[None].to(conv_state.dtype)
        out = (out * (1.0 / (QUERY_SCALE * VALUE_SCALE))).to(x.dtype)  # [S, Hv, dv]
        return self.out_proj(self.norm(out, z).reshape(s, self.args.value_dim))


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
            h = self.linear_attn(h, call, core, states["conv_state"], states["recurrent_state"],
                                 states["pending_qkv"], states["pending_ba"])
        else:
            h = self.self_attn(h, *attention, states["key_cache"], states["value_cache"])
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def layers_before(kind: tuple[int, ...], index: int, first: int) -> int:
    """How many layers of a kind (``kind``: their indices) lie in ``first .. index-1``: layer ``index``'s row of that
    kind's states in a core whose layers start at ``first``."""
    return sum(first <= i < index for i in kind)


class Qwen35Core(nn.Module):
    """The shared computation behind every function of a hybrid target (see the module docstring).

    ``forward(input_ids, position_ids, accept, <states>, valid=None, width=...)`` returns ``argmax_ids`` [1,S]
    int32, ``logits``, ``hidden`` (final-norm output) and, with taps, ``taps`` (output of layer i, 0-based, in the
    given order). ``width`` is the function's static S (a Python int: no tensor shape is read in the graph);
    ``pending`` is the rows of ``pending_qkv`` / ``pending_ba``, at least the widest decode / verify.
    """

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
        for size in chunk_sizes((*widths, pending)):  # only the chunks the functions use: each buffer is an input
            masks = ChunkMasks.of(size)
            for name in ("strict", "lower", "eye"):
                self.register_buffer(f"chunk{size}_{name}", getattr(masks, name), persistent=False)

    def chunk_masks(self, size: int) -> ChunkMasks | None:
        """The constants of a chunk of ``size`` rows (None for one row: the recurrence needs none); sizes no function
        has (a calibration sample's last chunk) are made on the spot."""
        if size == 1:
            return None
        if not hasattr(self, f"chunk{size}_eye"):
            masks = ChunkMasks.of(size)
            return ChunkMasks(size, *(getattr(masks, n).to(self.rows.device) for n in ("strict", "lower", "eye")))
        return ChunkMasks(size, *(getattr(self, f"chunk{size}_{name}") for name in ("strict", "lower", "eye")))

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
            states = {"key_cache": key_cache, "value_cache": value_cache, "conv_state": conv_state,
                      "recurrent_state": recurrent_state, "pending_qkv": pending_qkv, "pending_ba": pending_ba}
            call = Call(width, accept, valid)
            for i, layer in zip(self.part.layer_indices, self.layers, strict=True):
                x = layer(x, attention, call, self, states)
                if i in self.taps:
                    tapped.append((self.taps.index(i), x))
        return part_outputs(self, x, tapped)


# ------------------------------------------------------------------------------------------------ function specs


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
        specs += [TensorSpec("key_cache", kv, dtype), TensorSpec("value_cache", kv, dtype)]
    if linear:
        specs += [
            TensorSpec("conv_state", (linear, a.linear_conv_kernel_dim - 1, a.conv_dim), dtype),
            TensorSpec("recurrent_state", (linear, a.linear_num_value_heads, a.linear_key_head_dim,
                                           a.linear_value_head_dim), dtype),
            TensorSpec("pending_qkv", (linear, pending, a.conv_dim), dtype),
            TensorSpec("pending_ba", (linear, pending, 2 * a.linear_num_value_heads), dtype),
        ]
    return tuple(specs)


# ------------------------------------------------------------------------------------------ registry hooks

Args = Qwen35Args
PLAN_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "layer_types", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
PLAN_ALTERNATIVES = {"layer_types": ("full_attention_interval",)}
FunctionModule = NamedFunction
KEEP_FP16 = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")  # see docs/hybrid.md, "What stays fp16"
GDN_GROUPS = (("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"), ("linear_attn.out_proj",))
ATTENTION_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",))
MLP_GROUPS = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def pending_rows(target) -> int:
    """Rows of the pending buffers: the widest function that leaves its rows pending (decode 1, verify)."""
    return max(1, target.graphs.verify)


def build_core(args: Qwen35Args, target, part: Part | None = None) -> Qwen35Core:
    widths = tuple(width for _, width in function_widths(target))
    return Qwen35Core(args, target.context, tuple(target.taps or ()), pending_rows(target), widths, part)


def function_specs(args: Qwen35Args, target, dtype: torch.dtype = torch.float16,
                   part: Part | None = None) -> list[FunctionSpec]:
    """prefill / decode / verify over the same states; every function with layers takes ``accept``, prefill also
    ``valid``; a part's take and return what it needs (``convert/pipeline/partition.py``)."""
    part = part or Part.whole(args)
    fdtype = DTYPE_NAMES[dtype]
    states = state_specs(args, target.context, pending_rows(target), fdtype, part.layer_indices)
    specs = []
    for name, width in function_widths(target):
        inputs, outputs = part_tensors(args, target, part, width, fdtype)
        if part.layer_indices:
            inputs += (TensorSpec("accept", (1,), "int32"),)
            if name not in LAZY_FUNCTIONS:
                inputs += (TensorSpec("valid", (1,), "int32"),)
        specs.append(FunctionSpec(name, inputs, outputs, states))
    return specs


def host_contract(args: Qwen35Args, target) -> dict:
    """What a runtime does between calls (README "Hybrid targets", docs/hybrid.md): the rows a call leaves pending
    are committed, or dropped, by the next call's ``accept``."""
    return {
        "name": HOST_CONTRACT_NAME,
        "version": HOST_CONTRACT_VERSION,
        "rollback": "commit-next-call",
        "inputs": {
            "accept": "int32 [1], every function: how many rows of the previous call to keep, counted from its "
                      "first row (0..that call's real rows); 0 after a prefill, at a session's start and after a reset",
            "valid": "int32 [1], prefill only: its real rows (the rest is right padding); a prefill commits them "
                     "itself and leaves nothing pending",
        },
        "pending_rows": {name: width for name, width in function_widths(target) if name in LAZY_FUNCTIONS},
        "rules": [
            "decode and verify leave their rows pending; the next call (any function) commits its first `accept` "
            "of them before its own rows: after a verify, the anchor and the accepted drafts (1..verify rows; 0 "
            "rejects the whole block); after a kept decode, 1",
            "the next call starts at position_ids[0] = the previous call's first position + accept; the rows of "
            "calls before the previous one are committed and cannot be rolled back",
            "never pass accept above the rows the previous call left pending; pass it on every call, also a decode "
            "after a decode (accept 1), or the previous call's rows are dropped",
            "attention KV rows are positional as in a dense target: cache row c holds position c, a query at p reads "
            "rows 0..p, rejected rows are overwritten later; positions stay below the context",
            "a fresh session zeroes every state",
        ],
    }


def architecture_record(args: Qwen35Args, target) -> dict:
    return {
        **qwen3.architecture_record(args, target),
        "family": FAMILY,
        "hybrid": {
            "layer_types": list(args.layer_types), "rotary_dim": args.rotary_dim, "attention_output_gate": True,
            "linear_num_key_heads": args.linear_num_key_heads, "linear_num_value_heads": args.linear_num_value_heads,
            "linear_key_head_dim": args.linear_key_head_dim, "linear_value_head_dim": args.linear_value_head_dim,
            "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
            "recurrent_state_scale": VALUE_SCALE,
        },
    }


def rollback_cost(args: Qwen35Args, target, dtype_bytes: int = 2) -> dict:
    """What the commit-next-call rollback costs at this shape (computed from the shapes; docs/hybrid.md):
    ``pending_bytes`` (the extra state), ``snapshot_bytes`` (per-row recurrent-state snapshots, vLLM's design, for
    comparison), ``commit_flops`` per call (the pending rows through the conv and the delta rule), ``verify_flops``
    (about 2 x linear weights x verify rows), and the GDN state bytes every call writes."""
    a, v = args, pending_rows(target)
    n = len(a.linear_layers)
    hv, dk, dv = a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    recurrent = n * hv * dk * dv * dtype_bytes
    pending = n * v * (a.conv_dim + 2 * hv) * dtype_bytes
    per_head = 4 * v * dk * dv + 2 * v * v * (dk + dv) + 2 * (2 * ceil(log2(max(v, 2))) - 2) * v**3
    commit = n * (hv * per_head + 2 * a.conv_dim * a.linear_conv_kernel_dim * v)
    linear = a.parameter_count - (0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size)  # lookups are free
    return {
        "pending_rows": v,
        "pending_bytes": pending,
        "recurrent_state_bytes": recurrent,
        "snapshot_bytes": v * recurrent,
        "commit_flops": commit,
        "verify_flops": 2 * linear * v,
        "state_bytes_written": recurrent + n * (a.linear_conv_kernel_dim - 1) * a.conv_dim * dtype_bytes + pending,
    }


def plan_lines(args: Qwen35Args, target) -> list[str]:
    a = args
    pattern = "".join("L" if t == LINEAR else "F" for t in a.layer_types)
    cost = rollback_cost(a, target)
    mib = 2**20
    return [
        f"  qwen3_5 (hybrid): {a.num_hidden_layers} layers {pattern} ({len(a.linear_layers)} Gated DeltaNet L, "
        f"{len(a.full_layers)} gated attention F), hidden {a.hidden_size}, vocab {a.vocab_size}, "
        f"{'tied' if a.tie_word_embeddings else 'untied'} lm_head, context {target.context}",
        f"    attention: heads {a.num_attention_heads}/{a.num_key_value_heads} (head_dim {a.head_dim}, RoPE on "
        f"{a.rotary_dim} dims); Gated DeltaNet: {a.linear_num_key_heads} key / {a.linear_num_value_heads} value heads "
        f"(dims {a.linear_key_head_dim}/{a.linear_value_head_dim}), conv kernel {a.linear_conv_kernel_dim}",
        f"    rollback: {HOST_CONTRACT_NAME} v{HOST_CONTRACT_VERSION} (decode / verify rows pending, committed by the "
        f"next call's `accept`; prefill takes `valid`): pending {cost['pending_bytes'] / mib:.2f} MiB (per-row "
        f"snapshots would be {cost['snapshot_bytes'] / mib:.1f} MiB), commit {cost['commit_flops'] / 1e9:.3g} GFLOP "
        f"per call ({100 * cost['commit_flops'] / cost['verify_flops']:.2g}% of a verify)",
    ]


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


def reference_layers(model) -> nn.ModuleList:
    """The decoder layers of transformers' Qwen3_5ForCausalLM or Qwen3_5ForConditionalGeneration."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
