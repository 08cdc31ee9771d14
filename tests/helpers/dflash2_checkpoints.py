"""Seeded tiny DFlash2 / DFlash drafter checkpoints in each real on-disk layout, plus tiny target tensors.

Layouts (``LAYOUTS``):

* ``plain``: z-lab's keys in ``model.safetensors``, codebooks in ``selector.safetensors`` without ``.weight``
  (the anemll-forge bundle / speculators layout).
* ``selector_weight``: the same, codebooks stored as ``...codebook.weight`` (a module state_dict).
* ``main_file``: the codebooks in ``model.safetensors`` (no selector file).
* ``model_prefix``: every key under ``model.``, codebooks in the main file with ``.weight``.
* ``aliases``: one-layer drafter written EAGLE/speculators-style: ``midlayer.``, ``encoder.fc``,
  ``encoder.output_norm_enc``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from convert.models.dflash2 import DFlash2Args, DFlash2Reference
from convert.models.dflash2.config import CODEBOOKS

LAYOUTS = ("plain", "selector_weight", "main_file", "model_prefix", "aliases")
HIDDEN, VOCAB, TAPS = 64, 512, [0, 2, 3]


def tiny_config(version: str = "dflash2", layers: int = 2, window: int | None = 48, **overrides) -> dict:
    """A config.json dict as z-lab writes it (transformers v5 style), tiny sizes."""
    draft = {"target_layer_ids": list(TAPS), "block_size": 8, "mask_token_id": 3}
    if version == "dflash2":
        draft.update(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)
    config = {
        "architectures": ["DFlash2DraftModel" if version == "dflash2" else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": ["sliding_attention" if window else "full_attention"] * layers,
        "sliding_window": window,
        "tie_word_embeddings": False,
        "num_target_layers": 4,
        "dflash_config": draft,
        "dtype": "float32",
    }
    config.update(overrides)
    return config


def random_reference(config: dict, seed: int = 0) -> DFlash2Reference:
    """A seeded drafter with weights wide enough that its logits and selector scores are well separated."""
    args = DFlash2Args.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    model = DFlash2Reference(args)
    with torch.no_grad():
        for name, p in model.drafter_state().items():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            elif name.endswith("base_kernel"):
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
                p[:, 0] += 1.0  # near identity, as trained drafters start
            elif name in CODEBOOKS:
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    return model.eval()


def target_tensors(seed: int = 1, hidden: int = HIDDEN, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """The target's embedding table and lm_head (what the drafter borrows), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed_tokens": torch.randn(vocab, hidden, generator=generator),
        "lm_head": torch.randn(vocab, hidden, generator=generator) * 0.6,
    }


def write_drafter(directory: Path, layout: str = "plain", config: dict | None = None, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> tuple[DFlash2Reference, dict]:
    """Write config.json and safetensors for a seeded drafter in ``layout``; return the model and its config."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    config = config or tiny_config(layers=1 if layout == "aliases" else 2)
    model = random_reference(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.drafter_state().items()}
    codebooks = {k: state.pop(k) for k in CODEBOOKS if k in state}
    if layout == "aliases":
        renames = (("layers.0.", "midlayer."), ("fc.", "encoder.fc."), ("hidden_norm.", "encoder.output_norm_enc."))
        state = {_rename(k, renames): v for k, v in state.items()}
    if layout == "model_prefix":
        state = {f"model.{k}": v for k, v in state.items()}
        state.update({f"model.{k}.weight": v for k, v in codebooks.items()})
    elif layout in ("main_file", "aliases"):
        state.update(codebooks)
    elif codebooks:
        suffix = ".weight" if layout == "selector_weight" else ""
        save_file({k + suffix: v for k, v in codebooks.items()}, str(directory / "selector.safetensors"))
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return model, config


def _rename(key: str, renames) -> str:
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key
