"""DFlash2 (and DFlash) block drafter: config args, checkpoint key mapping, a plain torch reference and the export core.

A drafter reads the target's tapped hidden states ("context") and drafts ``block_size - 1`` tokens after an anchor
in one forward pass of a few layers over the block [anchor, mask x (B-1)]. The forward follows
``../shared/reference/drafter-formats.md`` ("DFlash2 block forward, step by step"), which was checked against
z-lab's ``DFlash2DraftModel``:

* context: ``fused = hidden_norm(fc(concat(taps)))``; per draft layer K = rope(k_norm(k_proj(fused))) and
  V = v_proj(fused) at the rows' absolute positions.
* block: per layer ``x = input_layernorm(h)``; the dynamic grouped conv mixes ``x`` (side 0) before attention and the
  attention output (side 1) after it, with coefficients ``base_kernel[side, j] + kernel_projection(x)`` (per group of
  ``conv_group_size`` channels) and zeros before the block start; same around the MLP. Attention: queries from the
  block (q_norm, then NeoX rotate-half RoPE), keys/values = context rows + block rows, NON-causal inside the block,
  visible when ``|q_pos - k_pos| < sliding_window`` on sliding layers.
* output: the drafter's ``norm`` on rows 1..B-1, the TARGET's ``lm_head``, top-k candidates, then the selector walk:
  ``pred = anchor``; per row ``s = unary + successor_codebook[cand] @ (predecessor_codebook[pred] *
  hidden_projection(h))``; ``pred = cand[argmax s]``.

The unary term is the candidates' own ``lm_head`` logits, i.e. the values ``torch.topk`` returns with the
candidates. Sources (public code, 2026): anemll-forge ``scripts/dflash2_drafter_ref.py`` (``unary, cand =
torch.topk(logits, self.top_k)``; its ``validate`` checks it against z-lab's model), Qualcomm's DFlash-2 port
(``unary, candidates = torch.topk(logits, self.top_k, ...)``, "mirrors upstream select at temperature 0"),
sglang PR 35371 (``edge(p->c) = <A[p] * project(h), B[c]> + unary[c]`` over "the target head's top-K") and
speculators PR 1006 ("reranks unary top-K candidates"). Raw logits or log-probabilities give the same greedy walk:
they differ by one constant per row.

``DFlashDraftModel`` (DFlash v1) is the same model without the conv (identity) and without the selector (draft ids =
argmax of the logits). Per sglang, the conv and the selector are each switched on by their config fields, so a
``DFlashDraftModel`` config that declares them gets them; ``DFlash2DraftModel`` must declare both.

Taps (``target_layer_ids``) are kept exactly as written; their convention is z-lab's: 0-based "output of layer i",
i.e. transformers ``hidden_states[i + 1]`` (``TAP_CONVENTION``). They are never recomputed from a formula.

Export (static shapes, one ``DFlash2Core`` shared by three functions, see ``function_specs``): the context functions
write K/V of context rows into a ring of R rows (``ring_keys``/``ring_values`` [layers, kv_heads, R, head_dim]), slot
= position mod R, and ``ring_laps`` [1, R] = position // R + 1 (0 = empty), so a slot's key position is
``(laps - 1) * R + slot``. The draft reads the ring: a slot is visible when filled, its position is below p0 (rows
left from before a rollback stay hidden) and within the layer's sliding window. The ring holds the last R positions
written: after a rollback by d rows, the oldest d positions of the window are gone unless R >= window + d (with
R = window = 2048, the oldest few of 2048 context rows; exact when R > window + draft width).

The draft does not change the ring, but it declares the ring as its states (one package, shared states), and both
backends take a state to be a buffer the function writes in place (a buffer that is only read would be frozen into a
constant by torch.export); so the draft writes one row of each state back unchanged (``_touch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from convert import fields
from convert.errors import InputError, quote
from convert.export.functions import ExportModules, FunctionModule
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.inputs.sources import check_safetensors, read_json, weight_files
from convert.models.qwen3.config import layer_shapes
from convert.models.qwen3.core import MLP, RMSNorm, rotate, scaled_scores

ARCHITECTURES = ("DFlash2DraftModel", "DFlashDraftModel")
TAP_CONVENTION = "output-of-layer-0-based"
SELECTOR_FILE = "selector.safetensors"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
ALIASES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
STATE_NAMES = ("ring_keys", "ring_values", "ring_laps")
MASK_BIAS = -1e4  # additive bias of a hidden key; exp(-1e4) is 0 in fp16 and fp32, and -1e4 is finite in fp16


@dataclass(frozen=True)
class DFlash2Args:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_windows: tuple[int | None, ...]  # per draft layer: the sliding window, None = unlimited
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    tap_convention: str = TAP_CONVENTION

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def has_selector(self) -> bool:
        return self.selector_rank is not None

    @property
    def feature_size(self) -> int:
        """Width of one context row: the taps concatenated in ``target_layer_ids`` order."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> DFlash2Args:
        archs = fields.strings(config, "architectures", where) or []
        found = [a for a in archs if a in ARCHITECTURES]
        if len(archs) != 1 or not found:
            raise InputError(f"{where}: field 'architectures' is {quote(archs)}; expected one of "
                             f"{list(ARCHITECTURES)}")
        architecture = found[0]
        draft = config.get("dflash_config")
        if not isinstance(draft, dict):
            raise InputError(f"{where}: field 'dflash_config' is missing; a DFlash drafter needs it")
        _refuse_unsupported(config, draft, where)

        def value(name):  # dflash_config wins, then the top level (as upstream's _draft_value)
            return draft[name] if draft.get(name) is not None else config.get(name)

        def integer(name, in_draft=False, required=True, maximum=fields.INT_LIMIT - 1):
            """A top-level field, or (``in_draft``) a dflash_config field that may also sit at the top level."""
            raw = value(name) if in_draft else config.get(name)
            field = f"dflash_config.{name}" if in_draft else name
            if raw is None:
                if required:
                    raise InputError(f"{where}: field {field!r} is missing; a {architecture} drafter needs it")
                return None
            if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= maximum:
                bound = "below 2**31" if maximum == fields.INT_LIMIT - 1 else f"at most {maximum}"
                raise InputError(f"{where}: field {field!r} is {quote(raw)}; expected a non-negative integer ({bound})")
            return raw

        taps = draft.get("target_layer_ids")
        if not isinstance(taps, list) or not taps or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < fields.INT_LIMIT for t in taps):
            raise InputError(
                f"{where}: field 'dflash_config.target_layer_ids' is {quote(taps)}; expected the explicit list of "
                "tapped target layers (0-based, output of layer i); it is never recomputed from a formula"
            )
        if len(set(taps)) != len(taps):
            raise InputError(f"{where}: field 'dflash_config.target_layer_ids' {taps} repeats a layer")
        target_layers = integer("num_target_layers", required=False)
        if target_layers is not None and max(taps) >= target_layers:
            raise InputError(f"{where}: field 'dflash_config.target_layer_ids' {taps} names a layer past the target's "
                             f"num_target_layers {target_layers}")
        hidden, heads = integer("hidden_size"), integer("num_attention_heads")
        layers = integer("num_hidden_layers", maximum=fields.MAX_LAYERS)
        if value("block_size") is None:
            raise InputError(f"{where}: field 'dflash_config.block_size' (or top-level 'block_size') is missing")
        conv = {k: value(k) for k in ("conv_kernel_size", "conv_group_size")}
        selector = {k: value(k) for k in ("selector_rank", "selector_top_k")}
        for group, kind in ((conv, "conv"), (selector, "selector")):
            declared = [k for k, v in group.items() if v is not None]
            if (declared and len(declared) != len(group)) or (architecture == "DFlash2DraftModel" and not declared):
                missing = [k for k, v in group.items() if v is None]
                raise InputError(
                    f"{where}: field 'dflash_config.{missing[0]}' is missing; a {architecture} {kind} needs "
                    f"{' and '.join(group)}"
                )
        rope = fields.mapping(config, "rope_parameters", where)
        theta = fields.number(config, "rope_theta", where, 10000.0)
        args = cls(
            architecture=architecture,
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=integer("num_key_value_heads", required=False) or heads,
            head_dim=integer("head_dim", required=False) or (hidden // heads if heads else 0),
            vocab_size=integer("vocab_size"),
            rms_norm_eps=fields.number(config, "rms_norm_eps", where, 1e-6),
            rope_theta=fields.number(rope, "rope_theta", where, theta, field="rope_parameters.rope_theta"),
            layer_windows=_layer_windows(config, layers, where),
            target_layer_ids=tuple(taps),
            block_size=integer("block_size", in_draft=True),
            mask_token_id=integer("mask_token_id", in_draft=True),
            conv_kernel_size=integer("conv_kernel_size", in_draft=True, required=False),
            conv_group_size=integer("conv_group_size", in_draft=True, required=False),
            selector_rank=integer("selector_rank", in_draft=True, required=False),
            selector_top_k=integer("selector_top_k", in_draft=True, required=False),
        )
        args.check(where)
        return args

    def check(self, where: str) -> None:
        """Refuse sizes the model cannot be built with, naming the field."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "vocab_size", "num_key_value_heads"):
            if getattr(self, name) < 1:
                raise InputError(f"{where}: field {name!r} is {getattr(self, name)}; expected at least 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError(f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise InputError(f"{where}: head_dim {self.head_dim} is odd; rotate-half RoPE needs an even head_dim")
        if self.block_size < 2:
            raise InputError(f"{where}: block_size {self.block_size} must be at least 2 (anchor + one mask)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise InputError(f"{where}: mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"({self.vocab_size} ids)")
        if self.has_conv and (self.conv_kernel_size < 1 or self.conv_group_size < 1
                              or self.hidden_size % self.conv_group_size):
            raise InputError(f"{where}: conv_group_size {self.conv_group_size} must divide hidden_size "
                             f"{self.hidden_size} (and conv_kernel_size {self.conv_kernel_size} be at least 1)")
        if self.has_selector and not (1 <= self.selector_top_k <= self.vocab_size and self.selector_rank >= 1):
            raise InputError(f"{where}: selector_top_k {self.selector_top_k} must be in 1..vocab_size and "
                             f"selector_rank {self.selector_rank} at least 1")
        for window in self.layer_windows:
            if window is not None and window < self.block_size:
                raise InputError(f"{where}: sliding_window {window} is smaller than block_size {self.block_size}")

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(s) for s in expected_shapes(self).values())


def _refuse_unsupported(config: dict, draft: dict, where: str) -> None:
    """Options that change the forward and that this converter does not implement: refused, never ignored."""
    checks = (
        ("is_causal", config.get("is_causal"), lambda v: v is True, "a causal draft block"),
        ("dflash_config.causal", draft.get("causal"), lambda v: v is True, "a causal draft block"),
        ("is_neox_style", config.get("is_neox_style"), lambda v: v is False, "GPT-J (interleaved) RoPE"),
        ("attention_bias", config.get("attention_bias"), lambda v: v is True, "attention biases"),
        ("dflash_config.output_multiplier", draft.get("output_multiplier"), lambda v: v not in (None, 1, 1.0),
         "a logit multiplier"),
        ("dflash_config.final_logit_softcapping", draft.get("final_logit_softcapping"), lambda v: bool(v),
         "logit soft-capping"),
        ("dflash_config.input_embedding_scale", draft.get("input_embedding_scale"), lambda v: v not in (None, 1, 1.0),
         "a block embedding scale"),
        ("dflash_config.sample_from_anchor", draft.get("sample_from_anchor"), lambda v: v is True,
         "sampling from the anchor row"),
    )
    for field, found, unsupported, what in checks:
        if unsupported(found):
            raise InputError(f"{where}: field {field!r} is {quote(found)}: {what} is not supported")
    rope = fields.mapping(config, "rope_parameters", where)
    scaling = fields.mapping(config, "rope_scaling", where)
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise InputError(f"{where}: rope type {quote(rope_type)} is not supported (only 'default')")


def _layer_windows(config: dict, layers: int, where: str) -> tuple[int | None, ...]:
    """The sliding window of each draft layer: ``sliding_window`` on ``sliding_attention`` layers, None otherwise.

    Without ``layer_types``, transformers' Qwen3 rule: sliding when ``use_sliding_window`` and the layer index is at
    least ``max_window_layers``.
    """
    window = config.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InputError(f"{where}: field 'sliding_window' is {window!r}; expected a positive integer or null")
    types = config.get("layer_types")
    if types is None:
        start = fields.integer(config, "max_window_layers", where, 28, minimum=0)
        sliding = fields.flag(config, "use_sliding_window", where) and window is not None
        return tuple(window if sliding and i >= start else None for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise InputError(f"{where}: field 'layer_types' has {len(types) if isinstance(types, list) else quote(types)} "
                         f"entries; expected one per draft layer ({layers})")
    unknown = sorted(set(fields.strings(config, "layer_types", where)) - {"sliding_attention", "full_attention"})
    if unknown:
        raise InputError(f"{where}: field 'layer_types' has {quote(unknown)}; expected sliding_attention or "
                         "full_attention")
    return tuple(window if t == "sliding_attention" else None for t in types)


# --------------------------------------------------------------------------------------------------------------
# checkpoint keys


def expected_shapes(args: DFlash2Args) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint must hold, by canonical key (z-lab's, no prefix), with its shape."""
    h = args.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, args.feature_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(args.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(layer_shapes(p, h, args.head_dim, args.num_attention_heads, args.num_key_value_heads,
                                   args.intermediate_size))
        if args.has_conv:
            k, groups = args.conv_kernel_size, h // args.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{p}{conv}.base_kernel"] = (2, k, h)
                shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * k * groups, h)
    if args.has_selector:
        shapes["candidate_selector.hidden_projection.weight"] = (args.selector_rank, h)
        for name in CODEBOOKS:
            shapes[name] = (args.vocab_size, args.selector_rank)
    return shapes


def canonical_key(key: str) -> str:
    """A checkpoint key in canonical form: ``model.`` prefix dropped, aliases and codebook ``.weight`` resolved."""
    if key.startswith("model."):
        key = key[len("model."):]
    for alias, canonical in ALIASES:
        if key.startswith(alias):
            key = canonical + key[len(alias):]
            break
    if key.endswith(".weight") and key[: -len(".weight")] in CODEBOOKS:
        key = key[: -len(".weight")]
    return key


def sanitize(files: dict[str, dict[str, tuple[int, ...]]], args: DFlash2Args) -> dict[str, tuple[str, str]]:
    """Map every canonical key to (file, key in that file), refusing anything but exactly a drafter's tensors.

    ``files`` is {file name: {key: shape}} over the checkpoint's weight files and, when present,
    ``selector.safetensors``. Fused ``qkv_proj`` weights are refused (split them into q/k/v first).
    """
    expected = expected_shapes(args)
    found: dict[str, tuple[str, str]] = {}
    for file, shapes in files.items():
        for key, shape in shapes.items():
            canonical = canonical_key(key)
            if canonical.endswith("self_attn.qkv_proj.weight"):
                raise InputError(f"checkpoint: {file}: tensor {key!r} is a fused qkv_proj, which is not supported; "
                                 "split it into q_proj, k_proj and v_proj")
            if canonical not in expected:
                raise InputError(f"checkpoint: {file}: unexpected tensor {key!r} for a {args.architecture} drafter "
                                 f"with {args.num_hidden_layers} layers")
            if canonical in found:
                other = found[canonical]
                raise InputError(f"checkpoint: tensor {canonical!r} appears twice: {other[1]!r} in {other[0]} and "
                                 f"{key!r} in {file}")
            if tuple(shape) != expected[canonical]:
                raise InputError(f"checkpoint: {file}: tensor {key!r} has shape {list(shape)}, expected "
                                 f"{list(expected[canonical])}")
            found[canonical] = (file, key)
    for key, shape in expected.items():
        if key not in found:
            where = f" (main weights or {SELECTOR_FILE})" if key in CODEBOOKS else ""
            raise InputError(f"checkpoint: tensor {key!r} is missing{where} (expected shape {list(shape)})")
    return found


def checkpoint_files(directory: Path) -> list[Path]:
    """The drafter's safetensors files: its weights (single, sharded or any ``*.safetensors``) and the selector file."""
    files = weight_files(directory)
    selector = directory / SELECTOR_FILE
    if selector.is_file() and selector not in files:
        files.append(selector)
    return files


def load_checkpoint(directory: Path) -> tuple[DFlash2Args, dict[str, torch.Tensor]]:
    """Read config and tensors of a drafter checkpoint (safetensors only): canonical key -> tensor as stored."""
    directory = Path(directory)
    config_path = directory / "config.json"
    args = DFlash2Args.from_config(read_json(config_path), str(config_path))
    files = checkpoint_files(directory)
    mapping = sanitize({f.name: check_safetensors(f) for f in files}, args)
    by_name = {f.name: f for f in files}
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({file for file, _ in mapping.values()}):
        with safe_open(str(by_name[file]), framework="pt") as handle:
            for canonical, (source_file, key) in mapping.items():
                if source_file == file:
                    tensors[canonical] = handle.get_tensor(key)
    return args, tensors


# --------------------------------------------------------------------------------------------------------------
# modules (parameter names = canonical checkpoint keys)


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
        context = F.embedding(predecessors, self.predecessor_codebook) * projected
        successors = F.embedding(candidates, self.successor_codebook)
        return unary + (successors @ context.unsqueeze(-1)).squeeze(-1)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, rows: int):
        """Greedy walk from ``anchor`` [1] over ``rows`` rows of hidden [n, H] and logits [n, V] -> ids [n],
        scores [n, k], candidates [n, k]. Unrolled (``rows`` is a Python int, never read from a shape), each step on
        [1, ...] slices, so the export core uses it as is."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        projected = self.hidden_projection(hidden)
        predecessor, ids, scores = anchor, [], []
        for i in range(rows):
            s = self.scores(projected[i:i + 1], unary[i:i + 1], candidates[i:i + 1], predecessor)
            predecessor = torch.gather(candidates[i:i + 1], 1, s.argmax(-1, keepdim=True))[:, 0]
            ids.append(predecessor)
            scores.append(s)
        return torch.cat(ids), torch.cat(scores), candidates


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
        """Fill every parameter from canonical keys (as ``load_checkpoint`` returns them)."""
        own = {k: v for k, v in self.state_dict().items() if k in expected_shapes(self.args)}
        missing = sorted(set(expected_shapes(self.args)) - set(tensors))
        if missing:
            raise InputError(f"drafter weights: tensor {missing[0]!r} is missing")
        with torch.no_grad():
            for key, param in own.items():
                param.copy_(tensors[key].to(param.dtype))

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


# --------------------------------------------------------------------------------------------------------------
# plain torch reference (and the training forward)


@dataclass
class ReferenceDraft:
    draft_ids: torch.Tensor  # [B-1] int64
    logits: torch.Tensor  # [B-1, vocab]
    hidden: torch.Tensor  # [B-1, H], after the drafter's norm
    scores: torch.Tensor | None  # [B-1, k] selector scores (None for DFlash v1)
    candidates: torch.Tensor | None  # [B-1, k]


class DFlash2Reference(DFlash2Weights):
    """Eager, readable reference (no ring, no static shapes): ``draft`` for one block, ``forward_blocks`` to train."""

    def draft(self, features, anchor_embedding, mask_embedding, lm_head_weight, anchor_id: int, p0: int,
              positions=None, mask_scale: float = 1.0) -> ReferenceDraft:
        """One block at positions p0..p0+B-1 after context ``features`` [N, T*H] (rows at ``positions``, default
        0..N-1; rows at or past p0 are ignored). ``anchor_embedding`` and ``mask_embedding`` [H] are the target's
        embedding rows of the anchor and of ``mask_token_id``; ``lm_head_weight`` [vocab, H] is the target's head."""
        args = self.args
        dtype, device = self.fc.weight.dtype, features.device
        positions = torch.arange(len(features)) if positions is None else torch.as_tensor(positions)
        positions = positions.to(device)
        keep = positions < p0
        fused = self.fuse(features[keep].to(dtype))
        ctx_positions = positions[keep]
        mask_row = (mask_embedding.float() * mask_scale).to(dtype).reshape(1, -1)
        block = torch.cat([anchor_embedding.to(dtype).reshape(1, -1), mask_row.expand(args.block_size - 1, -1)])
        block_positions = torch.arange(p0, p0 + args.block_size, device=device)
        h = block
        for layer, window in zip(self.layers, args.layer_windows, strict=True):
            def attend(attn, x, window=window):
                return self._attend(attn, x, fused, ctx_positions, block_positions, window)

            h = layer(h, attend)
        hidden = self.norm(h[1:])
        logits = hidden @ lm_head_weight.to(dtype).T
        if not args.has_selector:
            return ReferenceDraft(logits.argmax(-1), logits, hidden, None, None)
        ids, scores, candidates = self.candidate_selector.walk(
            hidden, logits, torch.tensor([anchor_id], device=device), args.block_size - 1
        )
        return ReferenceDraft(ids, logits, hidden, scores, candidates)

    def _attend(self, attn, x, fused, ctx_positions, block_positions, window):
        """Block queries over [context rows, block rows]; non-causal; |q - k| < window where the layer slides."""
        cos_b, sin_b = self.rope_angles(block_positions)
        cos_c, sin_c = self.rope_angles(ctx_positions)
        dtype = x.dtype
        q = rotate(attn.queries(x).transpose(0, 1), cos_b.to(dtype), sin_b.to(dtype))  # [heads, B, D]
        k_ctx, v_ctx = attn.keys_values(fused)
        k_blk, v_blk = attn.keys_values(x)
        k_ctx = rotate(k_ctx.transpose(0, 1), cos_c.to(dtype), sin_c.to(dtype))
        k_blk = rotate(k_blk.transpose(0, 1), cos_b.to(dtype), sin_b.to(dtype))
        keys = torch.cat([k_ctx, k_blk], dim=1)  # [kv_heads, N + B, D]
        values = torch.cat([v_ctx.transpose(0, 1), v_blk.transpose(0, 1)], dim=1)
        group = attn.heads // attn.kv_heads
        keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        key_positions = torch.cat([ctx_positions, block_positions])
        visible = torch.ones(len(block_positions), len(key_positions), dtype=torch.bool, device=x.device)
        if window is not None:
            visible &= (block_positions[:, None] - key_positions[None, :]).abs() < window
        scores = (q @ keys.transpose(1, 2)) * attn.head_dim**-0.5
        scores = scores.float().masked_fill(~visible, float("-inf"))
        out = torch.softmax(scores, dim=-1).to(dtype) @ values  # [heads, B, D]
        return attn.o_proj(out.transpose(0, 1).reshape(len(block_positions), -1))

    def forward_blocks(self, features, block_embeddings, anchor_positions) -> torch.Tensor:
        """Training forward: several blocks per sequence at once, the same math as ``draft``.

        ``features`` [b, N, T*H] (row j at position j), ``block_embeddings`` [b, m, B, H] (row 0 the anchor's
        embedding, the rest the mask row), ``anchor_positions`` [b, m] (block at a..a+B-1 sees context rows j < a).
        Returns the final-normed hidden states [b, m, B, H] (row 0 included; the loss reads rows 1..B-1).
        """
        args = self.args
        b, m, block, _ = block_embeddings.shape
        n = features.shape[1]
        fused = self.fuse(features)
        ctx_positions = torch.arange(n, device=features.device)
        block_positions = anchor_positions[..., None] + torch.arange(block, device=features.device)  # [b, m, B]
        cos_c, sin_c = self.rope_angles(ctx_positions)
        cos_b, sin_b = self.rope_angles(block_positions.reshape(b, m * block))
        queries = block_positions.reshape(b, m * block)
        block_of_query = torch.arange(m, device=features.device).repeat_interleave(block)
        ctx_visible = ctx_positions[None, None, :] < anchor_positions.repeat_interleave(block, dim=1)[..., None]
        blk_visible = (block_of_query[:, None] == block_of_query[None, :]).expand(b, -1, -1)
        masks = {}
        for window in dict.fromkeys(args.layer_windows):
            ctx, blk = ctx_visible, blk_visible
            if window is not None:
                ctx = ctx & (queries[..., None] - ctx_positions[None, None, :] < window)
                blk = blk & ((queries[..., None] - queries[:, None, :]).abs() < window)
            masks[window] = torch.cat([ctx, blk], dim=-1)[:, None]  # [b, 1, mB, N + mB]

        def attend(attn, x, window):
            dtype = x.dtype
            x = x.reshape(b, m * block, -1)
            q = rotate(attn.queries(x).transpose(1, 2), cos_b[:, None].to(dtype), sin_b[:, None].to(dtype))
            k_ctx, v_ctx = attn.keys_values(fused)
            k_blk, v_blk = attn.keys_values(x)
            k_ctx = rotate(k_ctx.transpose(1, 2), cos_c.to(dtype), sin_c.to(dtype))
            k_blk = rotate(k_blk.transpose(1, 2), cos_b[:, None].to(dtype), sin_b[:, None].to(dtype))
            keys = torch.cat([k_ctx, k_blk], dim=2).to(q.dtype)
            values = torch.cat([v_ctx.transpose(1, 2), v_blk.transpose(1, 2)], dim=2).to(q.dtype)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[window], enable_gqa=True)
            return attn.o_proj(out.transpose(1, 2).reshape(b, m, block, -1))

        h = block_embeddings
        for layer, window in zip(self.layers, args.layer_windows, strict=True):
            h = layer(h, lambda attn, x, window=window: attend(attn, x, window))
        return self.norm(h)


# --------------------------------------------------------------------------------------------------------------
# export core


class DFlash2Core(DFlash2Weights):
    """The shared computation behind the drafter's functions (static shapes, ring states passed in).

    Holds the drafter weights once plus the borrowed target constants: ``lm_head`` (a Linear, so the build can
    quantize it as the target's) and ``mask_embedding`` [H] (the target's mask row times the mask scale).
    ``context`` and ``draft`` return every output a function may expose; each function picks its spec's outputs.
    """

    def __init__(self, args: DFlash2Args, ring_rows: int, max_positions: int, draft_width: int | None = None):
        super().__init__(args)
        self.ring_rows, self.max_positions = ring_rows, max_positions
        self.draft_width = draft_width or args.block_size
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("mask_embedding", torch.zeros(args.hidden_size))
        # rows for every position of a block that starts below max_positions
        rows = max_positions + self.draft_width
        angles = torch.arange(rows, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        # constants rather than torch.arange in forward: coremltools warns on every int64 arange it meets
        self.register_buffer("ring_slots", torch.arange(ring_rows, dtype=torch.int32), persistent=False)
        self.register_buffer("kv_head_index", torch.arange(args.num_key_value_heads)[:, None], persistent=False)

    def set_target(self, lm_head_weight: torch.Tensor, mask_embedding: torch.Tensor, mask_scale: float = 1.0) -> None:
        """Borrow the target's ``lm_head`` [vocab, H] and mask row [H] (scaled in fp32, then cast)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight.to(self.lm_head.weight.dtype))
            self.mask_embedding.copy_((mask_embedding.float() * mask_scale).to(self.mask_embedding.dtype))

    def context(self, taps, position_ids, ring_keys, ring_values, ring_laps):
        """Write the K/V of S context rows (``taps`` [1,S,T*H] at ``position_ids`` [1,S]) into the ring."""
        dtype = self.fc.weight.dtype
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
        args, dtype = self.args, self.fc.weight.dtype
        positions = position_ids[0]
        index = positions.long()
        cos, sin = self.rope_cos[index].to(dtype), self.rope_sin[index].to(dtype)
        masks = self._ring_masks(positions, ring_laps, dtype)
        block = torch.cat([anchor_embedding[0].to(dtype), self.mask_embedding[None].expand(self.draft_width - 1, -1)])
        h = block
        for i, layer in enumerate(self.layers):
            def attend(attn, x, i=i):
                return self._attend(attn, x, i, cos, sin, masks[args.layer_windows[i]], ring_keys, ring_values)

            h = layer(h, attend)
        hidden = self.norm(h[1:])
        logits = self.lm_head(hidden)
        out = {"logits": logits[None]}
        if args.has_selector:
            ids, scores, _ = self.candidate_selector.walk(hidden, logits, anchor_id[0].long(), self.draft_width - 1)
            out["selector_scores"] = scores[None]
        else:
            ids = logits.argmax(-1)
        out["draft_ids"] = ids.to(torch.int32)[None]
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
        """Write the ring row of p0's slot back unchanged (see the module docstring: the draft's states must be
        written in place to stay states)."""
        p0 = positions[:1]
        slot = (p0 - torch.div(p0, self.ring_rows, rounding_mode="floor") * self.ring_rows).long()  # [1]
        zero = torch.zeros_like(slot)
        ring_keys.index_put_((zero, zero, slot), ring_keys[zero, zero, slot])
        ring_values.index_put_((zero, zero, slot), ring_values[zero, zero, slot])
        ring_laps.index_put_((zero, slot), ring_laps[zero, slot])

    def ring_shape(self) -> tuple[int, int, int, int]:
        a = self.args
        return (a.num_hidden_layers, a.num_key_value_heads, self.ring_rows, a.head_dim)


class DrafterFunction(FunctionModule):
    """A FunctionModule that calls one entry of the shared core (``context`` or ``draft``); the core is stored under
    ``core`` in every function, so parameter names (and the package's weights) are shared."""

    def __init__(self, core: DFlash2Core, spec: FunctionSpec, states: dict[str, torch.Tensor], entry: str):
        super().__init__(core, spec, states)
        self.entry = entry

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        produced = getattr(self.core, self.entry)(*inputs, *(getattr(self, s.name) for s in self.spec.states))
        return tuple(produced[o.name] for o in self.spec.outputs)


ENTRIES = {"context_update": "context", "context_append": "context", "draft": "draft"}


def function_specs(args: DFlash2Args, update_width: int = 64, append_width: int = 8, ring_rows: int = 2048,
                   dtype: torch.dtype = torch.float16, draft_width: int | None = None,
                   logits: bool = False) -> list[FunctionSpec]:
    """context_update / context_append (write context rows into the ring) and draft, sharing the ring states."""
    draft_width = draft_width or args.block_size
    if not 2 <= draft_width <= args.block_size:
        raise InputError(f"draft width {draft_width} must be in 2..block_size ({args.block_size})")
    if ring_rows < max(update_width, append_width):
        raise InputError(f"ring rows {ring_rows} must hold one context chunk ({max(update_width, append_width)} rows)")
    fdtype = DTYPE_NAMES[dtype]
    ring = (args.num_hidden_layers, args.num_key_value_heads, ring_rows, args.head_dim)
    states = (TensorSpec("ring_keys", ring, fdtype), TensorSpec("ring_values", ring, fdtype),
              TensorSpec("ring_laps", (1, ring_rows), fdtype))
    specs = []
    for name, width in (("context_update", update_width), ("context_append", append_width)):
        inputs = (TensorSpec("taps", (1, width, args.feature_size), fdtype),
                  TensorSpec("position_ids", (1, width), "int32"))
        specs.append(FunctionSpec(name, inputs, (TensorSpec("written", (1, width), "int32"),), states))
    inputs = (TensorSpec("anchor_embedding", (1, 1, args.hidden_size), fdtype),
              TensorSpec("anchor_id", (1, 1), "int32"),
              TensorSpec("position_ids", (1, draft_width), "int32"))
    outputs = [TensorSpec("draft_ids", (1, draft_width - 1), "int32")]
    if logits:
        outputs.append(TensorSpec("logits", (1, draft_width - 1, args.vocab_size), fdtype))
    specs.append(FunctionSpec("draft", inputs, tuple(outputs), states))
    return specs


@dataclass
class DrafterModules(ExportModules):
    core: DFlash2Core

    def call(self, name: str, **inputs) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states with inputs by name (arrays or tensors, cast to the
        spec's dtypes); returns every core output (``logits`` and ``selector_scores`` included)."""
        module, spec = self.functions[name]
        if set(inputs) != {t.name for t in spec.inputs}:
            raise ValueError(f"{name} takes inputs {[t.name for t in spec.inputs]}, got {sorted(inputs)}")
        dtypes = {"int32": torch.int32, "float16": torch.float16, "float32": torch.float32}
        tensors = []
        for t in spec.inputs:
            value = torch.as_tensor(inputs[t.name]).to(dtypes[t.dtype])
            if tuple(value.shape) != t.shape:
                raise ValueError(f"{name} takes {t.name} of shape {list(t.shape)}, got {list(value.shape)}")
            tensors.append(value)
        with torch.no_grad():
            return getattr(self.core, module.entry)(*tensors, *(getattr(module, s.name) for s in spec.states))


def build_modules(args: DFlash2Args, tensors: dict[str, torch.Tensor], lm_head_weight: torch.Tensor,
                  mask_embedding: torch.Tensor, dtype: torch.dtype, max_positions: int, ring_rows: int = 2048,
                  update_width: int = 64, append_width: int = 8, mask_scale: float = 1.0,
                  draft_width: int | None = None, logits: bool = False) -> DrafterModules:
    """Export modules in ``dtype`` over one core (drafter ``tensors`` by canonical key, the target's ``lm_head``
    weight [vocab, H] and raw mask row [H], scaled here by ``mask_scale``) and one set of ring states.

    ``max_positions`` sizes the fp32 RoPE tables: context rows and block anchors must sit below it (a block
    starting at ``max_positions - 1`` still fits). ``logits`` adds the [1, S-1, vocab] logits output to ``draft``.
    """
    for name, tensor, shape in (("lm_head weight", lm_head_weight, (args.vocab_size, args.hidden_size)),
                                ("mask embedding row", mask_embedding, (args.hidden_size,))):
        if tuple(tensor.shape) != shape:
            raise InputError(f"the target's {name} is {list(tensor.shape)}; this drafter needs {list(shape)}")
    specs = function_specs(args, update_width, append_width, ring_rows, dtype, draft_width, logits)
    # the fp32 RoPE tables are cast with the core: the same values as a lookup in fp32 followed by the cast
    core = DFlash2Core(args, ring_rows, max_positions, draft_width).to(dtype).eval()
    core.load_weights(tensors)
    core.set_target(lm_head_weight, mask_embedding, mask_scale)
    for p in core.parameters():
        p.requires_grad_(False)
    states = {s.name: torch.zeros(s.shape, dtype=dtype) for s in specs[0].states}
    functions = {s.name: (DrafterFunction(core, s, states, ENTRIES[s.name]), s) for s in specs}
    return DrafterModules(core=core, functions=functions)
