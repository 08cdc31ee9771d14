"""DFlash2: the drafter's constants, its args (refusing what it does not implement) and the shapes a checkpoint
must have."""

from __future__ import annotations

import math
from dataclasses import dataclass

from convert import fields
from convert.errors import InputError, quote
from convert.models.qwen3.config import layer_shapes

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
