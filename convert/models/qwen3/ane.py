"""Qwen3 dense in the ane layout (``convert/export/ane.py``): the same modules and weights as ``core.py``, computed
channels first with 1x1 convolutions, over the host's KV history: a call takes ``key_history`` / ``value_history``
[layers, Hkv, context, head_dim], reads the rows below its first position and its own rows, and returns its new rows
``key_rows`` / ``value_rows`` [layers, Hkv, S, head_dim] for the host to write at its positions (no state, no
scatter). The host passes what the stateful cores compute from ``input_ids`` and ``position_ids``: the embedding
rows as ``hidden_states`` (the core keeps its ``embed_tokens`` for the host's lookup and the bundle's
embeddings.safetensors; the graph never reads it), RoPE's ``rope_cos`` / ``rope_sin`` [S, head_dim / 2] and the
``history_mask`` [1, context]; the head returns logits, whose argmax the host takes. So the graph holds no lookup,
no argmax and no integer arithmetic."""

from __future__ import annotations

import torch

from convert.export.ane import attend, channels_first, history_bias, pointwise, rms_norm, silu
from convert.export.names import KEY_ROWS, VALUE_ROWS
from convert.fp16 import noted_output, within
from convert.models.part import ane_outputs, host_rows
from convert.models.qwen3.core import MLP, Attention, DecoderLayer, Qwen3Core


class Qwen3AneCore(Qwen3Core):
    """``Qwen3Core`` in the ane layout: ``forward`` takes the host's history and position inputs instead of states
    and ``position_ids``, and returns the call's KV rows beside the outputs ``part_outputs`` names."""

    host_lookup = True  # its embedding table is the host's (``part.host_tables``)

    def forward(self, hidden_states=None, rope_cos=None, rope_sin=None, history_mask=None, key_history=None,
                value_history=None, *, width: int = 0):
        x = channels_first(host_rows(self, hidden_states))
        tapped, out = [], {}
        if self.layers:
            cos, sin = rope_cos.transpose(0, 1), rope_sin.transpose(0, 1)  # [head_dim / 2, S]
            bias = history_bias(history_mask, width)
            keys, values = [], []
            for j, (i, layer) in enumerate(zip(self.part.layer_indices, self.layers, strict=True)):
                with within(layer):
                    x, k, v = decoder_layer(layer, x, cos, sin, bias, key_history[j], value_history[j], width)
                noted_output(layer, x)
                keys.append(k)
                values.append(v)
                if i in self.taps:
                    tapped.append((self.taps.index(i), x))
            out = {KEY_ROWS: torch.cat([k[None] for k in keys]), VALUE_ROWS: torch.cat([v[None] for v in values])}
        return {**ane_outputs(self, x, tapped), **out}


def decoder_layer(layer: DecoderLayer, x, cos, sin, bias, key_history, value_history, width: int):
    """One decoder layer on channels-first rows ``x`` [1, H, 1, S]: the new rows, and the call's k and v rows
    [Hkv, S, head_dim]."""
    mixed, k, v = attention(layer.self_attn, rms_norm(layer.input_layernorm, x), cos, sin, bias, key_history,
                            value_history, width)
    x = x + mixed
    return x + mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x)), k, v


def attention(attn: Attention, x, cos, sin, bias, key_history, value_history, width: int):
    q = rotate(rms_norm(attn.q_norm, pointwise(attn.q_proj, x).reshape(attn.heads, attn.head_dim, width)), cos, sin)
    out, k, v = attend_heads(attn, x, q, cos, sin, bias, key_history, value_history, width)
    return pointwise(attn.o_proj, out), k, v


def attend_heads(attn: Attention, x, q, cos, sin, bias, key_history, value_history, width: int, rotary=None):
    """The attention of the rotated queries ``q`` [heads, head_dim, S] over the history and the call's keys and values
    (projected from ``x``, the keys normed and rotated by ``rotary``, default ``rotate``): the heads' outputs [1, heads
    x head_dim, 1, S] before o_proj, and the call's k and v rows [Hkv, S, head_dim]."""
    heads, kv_heads, d = attn.heads, attn.kv_heads, attn.head_dim
    k, v = keys_values(attn, x, cos, sin, width, rotary)
    shape = (kv_heads, heads // kv_heads, d, width)
    queries = (q * d**-0.5).reshape(shape)  # scaled before the product (fp16)
    out = attend(queries, k, v, key_history, value_history, bias, shape)
    return out, k.transpose(1, 2), v.transpose(1, 2)


def keys_values(attn: Attention, x, cos, sin, width: int, rotary=None):
    """The call's keys (k_proj, k_norm, then ``rotary``, default ``rotate``) and values [Hkv, head_dim, S] from
    channels-first rows ``x`` (``width``: S, or -1)."""
    k = pointwise(attn.k_proj, x).reshape(attn.kv_heads, attn.head_dim, width)
    return (rotary or rotate)(rms_norm(attn.k_norm, k), cos, sin), pointwise(attn.v_proj, x).reshape(
        attn.kv_heads, attn.head_dim, width)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' rotate-half layout on channels-first heads [N, head_dim, S]; cos / sin [head_dim/2, S]."""
    x1, x2 = x.chunk(2, dim=1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=1)


def mlp(block: MLP, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU with the device-safe SiLU (``export.ane.silu``) whatever the stateful modules' activation."""
    return pointwise(block.down_proj, silu(pointwise(block.gate_proj, x)) * pointwise(block.up_proj, x))
