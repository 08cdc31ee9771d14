"""Seeded tiny Qwen3 checkpoints in Hugging Face layout, written with transformers' save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * 2)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
]
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]


def write_tokenizer(directory: Path, vocab_size: int = 300) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TOKENIZER_TEXT, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
              "pad_token": "<|pad|>", "mask_token": "<|mask|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def tiny_config(**overrides) -> Qwen3Config:
    base = dict(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    base.update(overrides)
    return Qwen3Config(**base)


def write_checkpoint(directory: Path, seed: int = 0, v4_config: bool = False, dtype=torch.float32,
                     license_text: str | None = "Apache-2.0 test license\n", **overrides) -> Qwen3ForCausalLM:
    """Save a seeded random Qwen3 with a tokenizer; ``v4_config`` rewrites config.json in the v4 style."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_config(**overrides)).to(dtype).eval()
    with torch.no_grad():  # the default init gives near-uniform logits; widen them so argmax is meaningful
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    if v4_config:
        config = json.loads((directory / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope["rope_theta"]
        config["rope_scaling"] = None
        config["transformers_version"] = "4.51.0"
        config.pop("layer_types", None)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory)
    if license_text:
        (directory / "LICENSE").write_text(license_text)
    return model
