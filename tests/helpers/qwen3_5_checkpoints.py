"""Seeded tiny Qwen3.5-family checkpoints (hybrid Gated DeltaNet + gated attention), written with transformers'
own ``save_pretrained``: ``Qwen3_5ForCausalLM`` (flat text config, keys ``model.*``) or
``Qwen3_5ForConditionalGeneration`` (``text_config`` nested beside a vision tower, keys ``model.language_model.*``,
``model.visual.*``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from tests.helpers.checkpoints import write_checkpoint as write_dense
from tests.helpers.checkpoints import write_tokenizer

L, F = "linear_attention", "full_attention"


def text_config(**overrides) -> dict:
    base = dict(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=4, layer_types=[L, L, L, F],
        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    base.update(overrides)
    return base


def _widen(model: torch.nn.Module) -> None:
    """The default init gives near-uniform logits and near-constant gates; widen them so argmax is meaningful and
    the delta rule's decay and beta vary."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if ".linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif p.dim() >= 2 and "visual" not in name:
                p.normal_(0.0, 0.3 if "conv1d" in name else 0.08)


def write_checkpoint(directory: Path, seed: int = 0, conditional: bool = False, dtype=torch.float32,
                     **overrides) -> torch.nn.Module:
    """Save a seeded random Qwen3.5 text model (or, ``conditional``, a vision-language one) with a tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    text = text_config(**overrides)
    if conditional:
        tie = text.pop("tie_word_embeddings")
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                      spatial_merge_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=16)
        config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    model = model.to(dtype).eval()
    _widen(model)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return model


def write_small_target(directory: Path, kind: str) -> None:
    """The two small targets the loop tests share: ``dense`` (Qwen3, 2 layers, hidden 64) or ``hybrid`` (this
    file's Qwen3.5 default, seed 1)."""
    if kind == "dense":
        write_dense(directory, hidden_size=64, num_hidden_layers=2)
    else:
        write_checkpoint(directory, seed=1)


def rewrite_config(directory: Path, edit) -> None:
    """Apply ``edit(config_dict)`` to a saved config.json (for the bad-input tests)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))
