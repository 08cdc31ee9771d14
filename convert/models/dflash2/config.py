"""DFlash2: the drafter's constants, its args (refusing what it does not implement) and the shapes a checkpoint
must have."""

from __future__ import annotations

import math
from dataclasses import dataclass

from convert import fields
from convert.errors import InputError, quote
from convert.export.names import RING_KEYS, RING_LAPS, RING_VALUES
from convert.models.qwen3.config import layer_shapes

ARCHITECTURES = ("DFlash2DraftModel", "DFlashDraftModel")
TAP_CONVENTION = "output-of-layer-0-based"
SELECTOR_FILE = "selector.safetensors"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
ALIASES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
STATE_NAMES = (RING_KEYS, RING_VALUES, RING_LAPS)
MASK_BIAS = -1e4  # additive bias of a hidden key; exp(-1e4) is 0 in fp16 and fp32, and -1e4 is finite in fp16
# options declared all or none (a DFlash2DraftModel has both)
GROUPS = {"conv": ("conv_kernel_size", "conv_group_size"), "selector": ("selector_rank", "selector_top_k")}


def _integer(draft: bool = False, **how):
    """A drafter's integer field (0 or more; a size's lower bound is ``DFlash2Args.check``'s): top-level, or
    (``draft``) dflash_config's, then the top level's (as upstream's _draft_value)."""
    found = dict(sources=("draft", ""), skip_null=True, prefix="dflash_config.") if draft else {}
    return fields.declared(kind=fields.NATURAL, **found, **how)


@dataclass(frozen=True)
class DFlash2Args:
    architecture: str
    hidden_size: int = _integer()
    intermediate_size: int = _integer()
    num_hidden_layers: int = _integer(maximum=fields.MAX_LAYERS)
    num_attention_heads: int = _integer()
    num_key_value_heads: int = _integer(zero_unset=True, default=lambda r: r["num_attention_heads"])
    head_dim: int = _integer(zero_unset=True, default=lambda r: r["hidden_size"] // r["num_attention_heads"]
                             if r["num_attention_heads"] else 0)
    vocab_size: int = _integer()
    rms_norm_eps: float = fields.declared(kind=float, default=1e-6)
    rope_theta: float = fields.rope_theta()
    # per draft layer: the sliding window, None = unlimited
    layer_windows: tuple[int | None, ...] = fields.derived(
        lambda r: _layer_windows(r.sources[""], r["num_hidden_layers"], r.where))
    target_layer_ids: tuple[int, ...]
    block_size: int = _integer(draft=True)
    mask_token_id: int = _integer(draft=True)
    conv_kernel_size: int | None = _integer(draft=True, default=None, init=None)
    conv_group_size: int | None = _integer(draft=True, default=None, init=None)
    selector_rank: int | None = _integer(draft=True, default=None, init=None)
    selector_top_k: int | None = _integer(draft=True, default=None, init=None)
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
        """The drafter's args from its config.json (``dflash_config`` holds the drafting fields); what it does not
        implement is refused, never ignored."""
        archs = fields.strings(config, "architectures", where) or []
        found = [a for a in archs if a in ARCHITECTURES]
        if len(archs) != 1 or not found:
            raise InputError(f"{where}: field 'architectures' is {quote(archs)}; expected one of "
                             f"{list(ARCHITECTURES)}")
        architecture, draft = found[0], config.get("dflash_config")
        if not isinstance(draft, dict):
            raise InputError(f"{where}: field 'dflash_config' is missing; a DFlash drafter needs it")
        rope = _refuse_unsupported(config, draft, where)
        r = fields.Reader(cls, where, {"": config, "draft": draft, "rope": rope},
                          missing=f"field {{field!r}} is missing; a {architecture} drafter needs it")
        taps = _target_layer_ids(r, draft, where)
        r.take("hidden_size", "num_attention_heads", "num_hidden_layers")
        if r.raw("block_size") is None:
            raise InputError(f"{where}: field 'dflash_config.block_size' (or top-level 'block_size') is missing")
        for kind, group in GROUPS.items():
            missing = [k for k in group if r.raw(k) is None]
            if 0 < len(missing) < len(group) or (architecture == "DFlash2DraftModel" and missing):
                raise InputError(f"{where}: field 'dflash_config.{missing[0]}' is missing; a {architecture} {kind} "
                                 f"needs {' and '.join(group)}")
        args = r.build(architecture=architecture, target_layer_ids=taps)
        args.check(where)
        return args

    def check(self, where: str) -> None:
        """Refuse sizes the model cannot be built with, naming the field."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "vocab_size", "num_key_value_heads"):
            if getattr(self, name) < 1:
                raise InputError(f"{where}: field {name!r} is {getattr(self, name)}; expected at least 1")
        fields.check_heads(self.num_attention_heads, self.num_key_value_heads, where)
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


def _refuse_unsupported(config: dict, draft: dict, where: str) -> dict:
    """Options that change the forward and that this converter does not implement: refused, never ignored; gives
    ``rope_parameters``."""
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
    return fields.rope(config, where, "")


def _target_layer_ids(r: fields.Reader, draft: dict, where: str) -> tuple[int, ...]:
    """The tapped target layers: an explicit list, no layer twice, each below ``num_target_layers`` if given."""
    taps = draft.get("target_layer_ids")
    if not isinstance(taps, list) or not taps or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < fields.INT_LIMIT for t in taps):
        raise InputError(
            f"{where}: field 'dflash_config.target_layer_ids' is {quote(taps)}; expected the explicit list of "
            "tapped target layers (0-based, output of layer i); it is never recomputed from a formula"
        )
    if len(set(taps)) != len(taps):
        raise InputError(f"{where}: field 'dflash_config.target_layer_ids' {taps} repeats a layer")
    target_layers = r.read(fields.Declared("num_target_layers", kind=fields.NATURAL, default=None))
    if target_layers is not None and max(taps) >= target_layers:
        raise InputError(f"{where}: field 'dflash_config.target_layer_ids' {taps} names a layer past the target's "
                         f"num_target_layers {target_layers}")
    return tuple(taps)


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
