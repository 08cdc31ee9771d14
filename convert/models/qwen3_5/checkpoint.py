"""Qwen3.5: the checkpoint's text-model keys checked against the config, its layout (prefix, left-out groups)."""

from __future__ import annotations

from convert.errors import InputError
from convert.models.layout import Layout
from convert.models.qwen3_5.config import (
    FUSED_MARKERS,
    MTP_PREFIX,
    TEXT_PREFIXES,
    VISION_PREFIX,
    Qwen35Args,
    expected_shapes,
)


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
