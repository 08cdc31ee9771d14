"""MTP head: the two checkpoint layouts (Qwen3.5, DeepSeek), their keys checked and read, and the target's borrowed
tables checked against the head's copies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from convert.errors import InputError
from convert.inputs.sources import tensor_shapes, weight_files
from convert.models.mtp.config import (
    DEEPSEEK,
    DEEPSEEK_ALIASES,
    DEEPSEEK_COPIES,
    MLA_MARKERS,
    MOE_MARKERS,
    QWEN35,
    MTPArgs,
    canonical_shapes,
)


def head_prefix(args: MTPArgs, layout: str) -> str:
    return "mtp." if layout == QWEN35 else f"model.layers.{args.num_hidden_layers}."


def checkpoint_key(canonical: str, args: MTPArgs, layout: str) -> str:
    """The key a canonical tensor has in a checkpoint of ``layout``."""
    if layout == QWEN35:
        return "mtp." + canonical
    alias = {v: k for k, v in DEEPSEEK_ALIASES.items()}.get(canonical)
    return head_prefix(args, layout) + (alias or canonical.removeprefix("layers.0."))


def expected_shapes(args: MTPArgs, layout: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the head must have, by checkpoint key, with its shape."""
    return {checkpoint_key(k, args, layout): v for k, v in canonical_shapes(args).items()}


def optional_shapes(args: MTPArgs, layout: str) -> dict[str, tuple[int, ...]]:
    """Tensors a head may carry besides its own: DeepSeek's copies of the target's embedding and lm_head."""
    if layout != DEEPSEEK:
        return {}
    shape = (args.vocab_size, args.hidden_size)
    return {head_prefix(args, layout) + k: shape for k in DEEPSEEK_COPIES}


def detect_layout(shapes: dict[str, tuple[int, ...]], args: MTPArgs, where: str = "checkpoint") -> str:
    qwen35 = any(k.startswith("mtp.") for k in shapes)
    deepseek = any(k.startswith(head_prefix(args, DEEPSEEK)) for k in shapes)
    if qwen35 and deepseek:
        raise InputError(
            f"{where}: holds both mtp.* and {head_prefix(args, DEEPSEEK)}* tensors; keep one MTP head layout"
        )
    if not (qwen35 or deepseek):
        raise InputError(
            f"{where}: no MTP head tensors: expected mtp.* (Qwen3.5 style) or {head_prefix(args, DEEPSEEK)}* "
            f"(DeepSeek style, N = num_hidden_layers = {args.num_hidden_layers})"
        )
    return QWEN35 if qwen35 else DEEPSEEK


def sanitize(shapes_in_checkpoint: dict[str, tuple[int, ...]], args: MTPArgs, where: str = "checkpoint") -> str:
    """Refuse a head whose keys or shapes are not exactly a dense MTP head's, naming the tensor; return the layout.

    Only the head's tensors (under its prefix) are checked; the target's own tensors in the same checkpoint are
    ignored here (the target's sanitize checks them).
    """
    layout = detect_layout(shapes_in_checkpoint, args, where)
    prefix = head_prefix(args, layout)
    present = {k: tuple(v) for k, v in shapes_in_checkpoint.items() if k.startswith(prefix)}
    for key in sorted(present):
        if any(m in key for m in MLA_MARKERS):
            raise InputError(
                f"{where}: tensor {key!r}: MLA attention in the MTP head is not supported (dense GQA only)"
            )
        if any(m in key for m in MOE_MARKERS):
            raise InputError(
                f"{where}: tensor {key!r}: a mixture-of-experts MLP in the MTP head is not supported "
                "(dense SwiGLU MLP only)"
            )
    expected = expected_shapes(args, layout)
    q_key = checkpoint_key("layers.0.self_attn.q_proj.weight", args, layout)
    plain_rows = args.num_attention_heads * args.head_dim
    other = (plain_rows if args.attn_output_gate else 2 * plain_rows, args.hidden_size)
    if present.get(q_key) == other:
        found = "heads x head_dim rows: no" if args.attn_output_gate else "2 x heads x head_dim rows: an"
        wants = "asks for" if args.attn_output_gate else "has no"
        raise InputError(
            f"{where}: tensor {q_key!r} has shape {list(other)} ({found} attention output gate), but the config "
            f"{wants} gated attention (attn_output_gate={str(args.attn_output_gate).lower()}; absent, it is true "
            f"for the Qwen3-Next / Qwen3.5 model types, false otherwise); expected {list(expected[q_key])}"
        )
    for key, shape in expected.items():
        if key not in present:
            raise InputError(f"{where}: tensor {key!r} is missing (expected shape {list(shape)})")
        if present[key] != shape:
            raise InputError(f"{where}: tensor {key!r} has shape {list(present[key])}, expected {list(shape)}")
    optional = optional_shapes(args, layout)
    for key, shape in optional.items():
        if key in present and present[key] != shape:
            raise InputError(f"{where}: tensor {key!r} has shape {list(present[key])}, expected {list(shape)}")
    unknown = sorted(set(present) - set(expected) - set(optional))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise InputError(
            f"{where}: unexpected tensor {unknown[0]!r}{more} in the MTP head (a dense one-layer head has "
            f"{len(expected)} tensors under {prefix!r})"
        )
    return layout


@dataclass
class HeadWeights:
    """A checked head: its layout, its tensors by canonical name and DeepSeek's copies (by target key)."""

    layout: str
    tensors: dict[str, torch.Tensor]
    copies: dict[str, torch.Tensor]  # "model.embed_tokens.weight" / "lm_head.weight" -> the head's copy


def head_weights(tensors: dict[str, torch.Tensor], args: MTPArgs, where: str = "checkpoint") -> HeadWeights:
    """Check and rename a head from checkpoint tensors (the target's own tensors may be among them)."""
    layout = sanitize({k: tuple(v.shape) for k, v in tensors.items()}, args, where)
    return _rename(layout, tensors, args)


def load_head(directory: Path, args: MTPArgs) -> HeadWeights:
    """Read only the head's tensors of a safetensors checkpoint (the target's, if present, are not read)."""
    where = f"checkpoint {directory}"
    layout = sanitize(tensor_shapes(directory), args, where)
    prefix = head_prefix(args, layout)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    tensors[name] = f.get_tensor(name)
    return _rename(layout, tensors, args)


def _rename(layout: str, tensors: dict[str, torch.Tensor], args: MTPArgs) -> HeadWeights:
    own = {c: tensors[checkpoint_key(c, args, layout)] for c in canonical_shapes(args)}
    prefix = head_prefix(args, layout)
    copies = {
        t: tensors[prefix + k] for k, t in DEEPSEEK_COPIES.items() if layout == DEEPSEEK and prefix + k in tensors
    }
    return HeadWeights(layout=layout, tensors=own, copies=copies)


def borrowed_tables(
    args: MTPArgs, head: HeadWeights, target_tensors: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding table and lm_head (the embedding again when tied), checked against the head.

    A copy the head carries (DeepSeek layout) must equal the target's tensor exactly, or the head would run
    against tables it was not trained with: refused naming the tensor.
    """
    shape = (args.vocab_size, args.hidden_size)
    keys = {"model.embed_tokens.weight": "model.embed_tokens.weight"}
    keys["lm_head.weight"] = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    tables = {}
    for role, key in keys.items():
        if key not in target_tensors:
            raise InputError(f"target checkpoint: tensor {key!r} is missing (expected shape {list(shape)})")
        if tuple(target_tensors[key].shape) != shape:
            raise InputError(
                f"target checkpoint: tensor {key!r} has shape {list(target_tensors[key].shape)}, the MTP head needs "
                f"{list(shape)}"
            )
        tables[role] = target_tensors[key]
    for role, copy in head.copies.items():
        if not torch.equal(copy.to(tables[role].dtype), tables[role]):
            name = next(k for k, t in DEEPSEEK_COPIES.items() if t == role)
            raise InputError(
                f"MTP head tensor {head_prefix(args, head.layout) + name!r} differs from the target's {role!r}: the "
                "head was trained against other tables than this target's; use the matching target"
            )
    return tables["model.embed_tokens.weight"], tables["lm_head.weight"]
