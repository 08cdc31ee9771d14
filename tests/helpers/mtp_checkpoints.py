"""Seeded tiny checkpoints with an MTP head, in the two real layouts, next to (or inside) a tiny Qwen3 target.

The key names are written out here as the real checkpoints spell them (not derived from convert/models/mtp/),
so the loader is checked against the formats rather than against itself:

* Qwen3.5 / Qwen3-Next: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``,
  ``mtp.layers.0.*`` (``mtp_num_hidden_layers`` in the config);
* DeepSeek: ``model.layers.{N}.{eh_proj,enorm,hnorm,shared_head.norm}`` + the block under ``model.layers.{N}.``
  with N = the target's layer count (``num_nextn_predict_layers`` in the config), optionally the copies
  ``embed_tokens`` and ``shared_head.head``.

A Qwen3.5-style head may be gated (``q_proj`` of 2 x heads x head_dim rows, [query | gate] per head, as
transformers' Qwen3_5Attention) and use partial RoPE (``partial_rotary_factor`` in the config).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import write_checkpoint

BLOCK = (  # the dense block's tensors, relative to its prefix, with their shapes as functions of the sizes
    ("input_layernorm.weight", lambda h, q, kv, d, i: (h,)),
    ("post_attention_layernorm.weight", lambda h, q, kv, d, i: (h,)),
    ("self_attn.q_proj.weight", lambda h, q, kv, d, i: (q * d, h)),
    ("self_attn.k_proj.weight", lambda h, q, kv, d, i: (kv * d, h)),
    ("self_attn.v_proj.weight", lambda h, q, kv, d, i: (kv * d, h)),
    ("self_attn.o_proj.weight", lambda h, q, kv, d, i: (h, q * d)),
    ("self_attn.q_norm.weight", lambda h, q, kv, d, i: (d,)),
    ("self_attn.k_norm.weight", lambda h, q, kv, d, i: (d,)),
    ("mlp.gate_proj.weight", lambda h, q, kv, d, i: (i, h)),
    ("mlp.up_proj.weight", lambda h, q, kv, d, i: (i, h)),
    ("mlp.down_proj.weight", lambda h, q, kv, d, i: (h, i)),
)
QWEN35_TOP = {
    "mtp.fc.weight": "fc",
    "mtp.pre_fc_norm_embedding.weight": "norm",
    "mtp.pre_fc_norm_hidden.weight": "norm",
    "mtp.norm.weight": "norm",
}
DEEPSEEK_TOP = {
    "eh_proj.weight": "fc",
    "enorm.weight": "norm",
    "hnorm.weight": "norm",
    "shared_head.norm.weight": "norm",
}


def head_tensors(
    config: dict,
    layout: str = "qwen3.5",
    zero_centred: bool = False,
    seed: int = 0,
    dtype=torch.float32,
    gated: bool = False,
) -> dict[str, torch.Tensor]:
    """A seeded random dense MTP head for a Qwen3-shaped ``config`` (a config.json dict), keys as in ``layout``.

    Norm gains are drawn around 1 (plain) or around 0 (zero-centred, where the model applies 1 + w);
    matrices N(0, 0.08) as in tests/helpers/checkpoints.py, so argmax ids are well separated. ``gated`` doubles
    q_proj's rows (the attention output gate).
    """
    h, q, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, inter = config["head_dim"], config["intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    prefix = "mtp.layers.0." if layout == "qwen3.5" else f"model.layers.{config['num_hidden_layers']}."
    top = QWEN35_TOP if layout == "qwen3.5" else {prefix + k: v for k, v in DEEPSEEK_TOP.items()}
    shapes = {k: ((h, 2 * h) if kind == "fc" else (h,)) for k, kind in top.items()}
    shapes.update({prefix + name: shape(h, q, kv, d, inter) for name, shape in BLOCK})
    if gated:
        shapes[prefix + "self_attn.q_proj.weight"] = (2 * q * d, h)
    tensors = {}
    for key, shape in shapes.items():
        if len(shape) == 1:
            tensors[key] = (0.0 if zero_centred else 1.0) + 0.2 * torch.randn(shape, generator=g)
        else:
            tensors[key] = 0.08 * torch.randn(shape, generator=g)
    return {k: v.to(dtype) for k, v in tensors.items()}


def write_index(directory: Path, files: dict[str, dict[str, torch.Tensor]]) -> None:
    """Write each shard and a model.safetensors.index.json listing every tensor."""
    weight_map = {}
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / name))
        weight_map.update({k: name for k in tensors})
    total = sum(v.numel() * v.element_size() for t in files.values() for v in t.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_target_with_head(
    directory: Path, layout: str = "qwen3.5", seed: int = 0, head_seed: int = 1, copies: bool = False, **overrides
):
    """A tiny Qwen3 written by transformers' save_pretrained, plus an MTP head in its own shard.

    The head shard joins the target's weights in a model.safetensors.index.json (the single file becomes
    the first shard), and config.json declares the head (``mtp_num_hidden_layers`` or
    ``num_nextn_predict_layers``). ``copies`` adds DeepSeek's copies of the embedding and lm_head.
    Returns (the transformers model, the head tensors as written).
    """
    model = write_checkpoint(directory, seed=seed, **overrides)
    config = json.loads((directory / "config.json").read_text())
    head = head_tensors(config, layout, seed=head_seed)
    if copies:
        n = config["num_hidden_layers"]
        state = model.state_dict()
        head[f"model.layers.{n}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        head[f"model.layers.{n}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    single = directory / "model.safetensors"
    target = load_file(str(single))
    single.unlink()
    write_index(directory, {"model-00001-of-00002.safetensors": target, "model-00002-of-00002.safetensors": head})
    config["mtp_num_hidden_layers" if layout == "qwen3.5" else "num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return model, head


def write_head_only(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint holding only the head: config.json, model.safetensors and its index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_index(directory, {"model.safetensors": tensors})


def qwen35_text_config(target_config: dict, gated: bool = False, partial_rotary_factor: float = 1.0) -> dict:
    """A Qwen3.5-style config (head count and sizes under text_config, model_type qwen3_5_text: zero-centred
    norms) with the sizes of a tiny Qwen3 target.

    ``gated``: the attention output gate as the real Qwen3.5 configs have it, by the model type's default (no
    ``attn_output_gate`` field); otherwise ``attn_output_gate: false`` is written. ``partial_rotary_factor``
    goes inside ``rope_parameters``, as transformers v5 writes it.
    """
    text = {
        k: target_config[k]
        for k in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "rms_norm_eps",
            "num_hidden_layers",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    }
    rope = {**target_config["rope_parameters"], "partial_rotary_factor": partial_rotary_factor}
    text.update(model_type="qwen3_5_text", mtp_num_hidden_layers=1, rope_parameters=rope)
    if not gated:
        text["attn_output_gate"] = False
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text}
