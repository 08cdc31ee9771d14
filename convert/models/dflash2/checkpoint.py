"""DFlash2: checkpoint keys mapped to canonical ones, checked against the config, and the tensors loaded."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from convert.errors import InputError
from convert.inputs.sources import check_safetensors, read_json, weight_files
from convert.models.dflash2.config import ALIASES, CODEBOOKS, SELECTOR_FILE, DFlash2Args, expected_shapes


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
    """Read config and tensors of a drafter checkpoint (safetensors only): canonical key -> tensor as stored, each
    memory-mapped on its own (its pages held while it is, not while every tensor of its file is)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    args = DFlash2Args.from_config(read_json(config_path), str(config_path))
    files = checkpoint_files(directory)
    mapping = sanitize({f.name: check_safetensors(f) for f in files}, args)
    by_name = {f.name: f for f in files}
    tensors: dict[str, torch.Tensor] = {}
    for canonical, (file, key) in sorted(mapping.items(), key=lambda item: item[1]):
        with safe_open(str(by_name[file]), framework="pt") as handle:
            tensors[canonical] = handle.get_tensor(key)
    return args, tensors
