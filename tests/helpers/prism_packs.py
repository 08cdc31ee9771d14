"""Seeded tiny Ternary Bonsai 2 packs in the published MLX 2-bit layout (``prism_hadamard_qwen35``, schema 2), written
from the published description by this file's own code, never through convert/inputs/prism.py (its docstring says where
each fact comes from: mlx-vlm's loader, MLX's affine 2-bit layout, the hadamard.json keys).

``write_pack(directory, unfolded, seed)`` first saves a seeded random Qwen3.5 vision-language checkpoint with
transformers' ``save_pretrained`` (``qwen3_5_checkpoints.py``, fp32, tokenizer included) to ``unfolded``. Every
matrix the published pack rotates (each Gated DeltaNet ``in_proj_qkv`` / ``in_proj_z`` / ``out_proj``, each attention
``q/k/v/o_proj``, each MLP ``gate/up/down_proj``, ``lm_head``, and ``embed_tokens`` inversely) gets ternary codes
(0, 1, 2 with zero point 1, so -s, 0, +s), one fp16 scale per 128 input columns and one +-1 sign vector per input
width; ``unfolded``'s tensor is replaced by the logical weight ``W = W' H S`` (fp64, then fp32), so ``unfolded`` is
the stock-HF form of the pack's model. The pack in ``directory`` holds, for those matrices, ``weight`` uint32
[out, in/16] (16 codes a word, the first in the lowest bits), ``scales`` and ``biases = -scales`` fp16
[out, in/128] and ``signs`` fp32 [in]; the other language tensors in MLX's layout (the five zero-centred norms
stored as 1 + w, ``conv1d`` as [channels, kernel, 1]); the vision tower's tensors under ``vision_tower.`` as
transformers saved them (only their keys matter: readers of the text model skip them); config.json (the HF config
with the Prism fields and the ``modules`` list) and hadamard.json.

The pack's dense tensors are fp32 unless ``dense_dtype`` says otherwise: the published dtypes of the un-rotated
tensors were not established (the reference notes bf16 for ``in_proj_a`` / ``in_proj_b``); the build tests store them
in bf16, which fp16 holds exactly at these magnitudes, and in fp32 (what ``exact`` ships of them then:
``convert/weights/precision.py``). The default block (64) is below mlx-vlm's smallest (512),
so that rows of the tiny widths (128, 256) hold several blocks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import write_tokenizer
from tests.helpers.qwen3_5_checkpoints import F, L, write_checkpoint

GEOMETRY = dict(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, layer_types=[L, F],
    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
)
ROTATED_SUFFIXES = (
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")
GROUP = 128


@dataclass
class WrittenPack:
    """What the writer put in the pack, by module path (``model.layers.0.mlp.down_proj``, ``lm_head`` ...)."""

    block: int
    codes: dict[str, torch.Tensor]  # uint8 [out, in], 0..2
    scales: dict[str, torch.Tensor]  # fp16 [out, in/128]
    signs: dict[int, torch.Tensor]  # fp32 [width], by input width
    logical: dict[str, torch.Tensor]  # fp32 W = W' H S, as ``unfolded`` holds it
    unfolded_keys: dict[str, str]  # the module's tensor name in ``unfolded``
    vision_keys: list[str]  # the pack's vision_tower.* tensors


def sylvester(n: int) -> np.ndarray:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(n), fp64."""
    index = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(index[:, None] & index[None, :])
    return (1.0 - 2.0 * parity) / math.sqrt(n)


def pack_words(codes: np.ndarray) -> np.ndarray:
    """uint8 [rows, width] codes -> uint32 [rows, width/16], code k of each word in bits 2k..2k+1."""
    lanes = codes.reshape(codes.shape[0], -1, 16).astype(np.uint32)
    return np.bitwise_or.reduce(lanes << (2 * np.arange(16, dtype=np.uint32)), axis=-1)


def pack_path(unfolded_key: str) -> str | None:
    """The loader's module path of a rotated matrix (``model.language_model.X.weight`` -> ``model.X``), else None."""
    if unfolded_key == "lm_head.weight":
        return "lm_head"
    if unfolded_key == "model.language_model.embed_tokens.weight" or unfolded_key.endswith(ROTATED_SUFFIXES):
        return "model." + unfolded_key.removeprefix("model.language_model.").removesuffix(".weight")
    return None


def mlx_key(unfolded_key: str) -> str:
    """mlx-vlm qwen3_5 ``sanitize``'s renaming."""
    if unfolded_key.startswith("model.visual."):
        return "vision_tower." + unfolded_key.removeprefix("model.visual.")
    if unfolded_key.startswith("model.language_model."):
        return "language_model.model." + unfolded_key.removeprefix("model.language_model.")
    return "language_model." + unfolded_key


def mlx_layout(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """mlx-vlm qwen3_5 ``sanitize``'s layout changes: the zero-centred norms stored as 1 + w, conv1d [C, K, 1]."""
    if key.endswith(OFFSET_NORMS) and tensor.dim() == 1:
        return tensor + 1.0
    if key.endswith("conv1d.weight") and tensor.shape[-1] != 1:
        return tensor.movedim(2, 1).contiguous()
    return tensor


def write_pack(directory: Path, unfolded: Path, seed: int = 0, block: int = 64, dense_dtype=torch.float32,
               **overrides) -> WrittenPack:
    """A tiny pack in ``directory`` and its unfolded HF checkpoint in ``unfolded`` (see the module docstring);
    ``dense_dtype``: the pack's dense language tensors in that dtype (bf16 as published for in_proj_a / in_proj_b),
    ``unfolded`` holding the same values in fp32 (an offset norm as the stored ``1 + w`` less 1)."""
    write_checkpoint(unfolded, seed=seed, conditional=True, **{**GEOMETRY, **overrides})
    hf = load_file(str(unfolded / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 1)
    widths = sorted({t.shape[1] for k, t in hf.items() if pack_path(k)})
    signs = {w: (torch.randint(0, 2, (w,), generator=generator) * 2 - 1).to(torch.float32) for w in widths}
    h = torch.from_numpy(sylvester(block))
    written = WrittenPack(block, {}, {}, signs, {}, {}, [])
    tensors, modules = {}, []
    for key, tensor in hf.items():
        path = pack_path(key)
        if path is None:
            mlx = mlx_key(key)
            if mlx.startswith("vision_tower."):
                written.vision_keys.append(mlx)
                tensors[mlx] = mlx_layout(mlx, tensor).contiguous()
                continue
            stored = mlx_layout(mlx, tensor).to(dense_dtype).contiguous()
            tensors[mlx] = stored
            offset = mlx.endswith(OFFSET_NORMS) and tensor.dim() == 1
            hf[key] = stored.float() - 1.0 if offset else stored.float().movedim(2, 1).contiguous() \
                if stored.dim() == 3 else stored.float()
            continue
        rows, width = tensor.shape
        codes = torch.randint(0, 3, (rows, width), generator=generator, dtype=torch.uint8)
        scales = (0.04 + 0.08 * torch.rand(rows, width // GROUP, generator=generator)).to(torch.float16)
        rotated = (codes.double() - 1.0).reshape(rows, -1, GROUP) * scales.double()[..., None]
        logical = (rotated.reshape(rows, -1, block) @ h).reshape(rows, width) * signs[width].double()
        hf[key] = logical.to(torch.float32)
        prefix = "language_model." + path
        tensors[prefix + ".weight"] = torch.from_numpy(pack_words(codes.numpy()))
        tensors[prefix + ".scales"] = scales
        tensors[prefix + ".biases"] = -scales
        tensors[prefix + ".signs"] = signs[width].clone()  # safetensors refuses tensors that share memory
        modules.append({"path": path, "block": block, "embedding": path == "model.embed_tokens", "dtype": "float16"})
        written.codes[path], written.scales[path], written.logical[path] = codes, scales, hf[key]
        written.unfolded_keys[path] = key
    save_file(hf, str(unfolded / "model.safetensors"), metadata={"format": "pt"})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((unfolded / "config.json").read_text())
    config.update(
        model_type="prism_hadamard_qwen35", schema_version=2, base_model_type="qwen3_5",
        tensor_namespace="mlx-vlm-qwen3_5", requires_runtime="runtime/artifact.py", hadamard_config="hadamard.json",
        gdn_activation_layout="grouped", components={"text": True, "vision": True, "mtp": False},
        quantization={"bits": 2, "group_size": GROUP, "mode": "affine"}, modules=modules,
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    forward = [m for m in modules if not m["embedding"]]
    hadamard = {
        "prism.hadamard.version": 1, "prism.hadamard.block_size": block,
        "prism.hadamard.transform": "normalized-sylvester-walsh-hadamard",
        "prism.hadamard.axis": "input-last-dimension", "prism.hadamard.sign_mode": "explicit",
        "prism.hadamard.weight_names": [f"language_model.{m['path']}.weight" for m in forward],
        "prism.hadamard.inverse_weight_names": ["language_model.model.embed_tokens.weight"],
        "prism.hadamard.sign_widths": widths,
        "prism.hadamard.sign_values": [v for w in widths for v in signs[w].tolist()],
        "prism.hadamard.gdn_v_grouped": True,
    }
    (directory / "hadamard.json").write_text(json.dumps(hadamard, indent=2))
    write_tokenizer(directory)
    return written


def edit_tensors(directory: Path, edit) -> None:
    """Apply ``edit(tensors)`` to a pack's model.safetensors (for the malformed-pack tests)."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def edit_json(path: Path, edit) -> None:
    """Apply ``edit(dict)`` to a pack's config.json or hadamard.json."""
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document, indent=2))
