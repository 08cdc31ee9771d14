"""A toy stateful core with the same I/O and KV pattern as the Qwen3 export core.

Backend tests use it: shared weights across functions, KV states [L, Hkv, C, D] written at the
host's positions with ``index_copy_``, an in-graph causal mask from positions, argmax ids as int32.
"""

from __future__ import annotations

import torch
from torch import nn

from convert.export.functions import FunctionModule
from convert.export.spec import FunctionSpec, TensorSpec

VOCAB, HIDDEN, LAYERS, KV_HEADS, HEAD_DIM, CONTEXT = 64, 32, 2, 2, 16, 32


class ToyCore(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g) * 0.5)
        self.k_proj = nn.ParameterList(
            [nn.Parameter(torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.2) for _ in range(LAYERS)]
        )
        self.v_proj = nn.ParameterList(
            [nn.Parameter(torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.2) for _ in range(LAYERS)]
        )
        self.o_proj = nn.ParameterList(
            [nn.Parameter(torch.randn(HIDDEN, KV_HEADS * HEAD_DIM, generator=g) * 0.2) for _ in range(LAYERS)]
        )
        self.lm_head = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g) * 0.5)
        self.register_buffer("slots", torch.arange(CONTEXT, dtype=torch.int32), persistent=False)

    def forward(self, input_ids, position_ids, key_cache, value_cache):
        s = input_ids.shape[1]
        h = self.embed[input_ids[0].long()]  # [S, H]
        pos = position_ids[0].long()
        visible = self.slots[None, :] <= position_ids[0][:, None]  # [S, C]
        bias = torch.where(visible, 0.0, -1e4).to(h.dtype)
        for layer in range(LAYERS):
            k = (h @ self.k_proj[layer].T).view(s, KV_HEADS, HEAD_DIM).transpose(0, 1)
            v = (h @ self.v_proj[layer].T).view(s, KV_HEADS, HEAD_DIM).transpose(0, 1)
            key_cache[layer].index_copy_(1, pos, k.to(key_cache.dtype))
            value_cache[layer].index_copy_(1, pos, v.to(value_cache.dtype))
            keys = key_cache[layer].to(h.dtype)  # [Hkv, C, D]
            values = value_cache[layer].to(h.dtype)
            q = k  # the toy uses its keys as queries
            scores = q @ keys.transpose(1, 2) / HEAD_DIM**0.5 + bias  # [Hkv, S, C]
            attn = torch.softmax(scores, dim=-1) @ values  # [Hkv, S, D]
            h = h + attn.transpose(0, 1).reshape(s, KV_HEADS * HEAD_DIM) @ self.o_proj[layer].T
        logits = (h @ self.lm_head.T)[None]  # [1, S, V]
        return {"argmax_ids": logits.argmax(-1).to(torch.int32), "logits": logits}


def toy_functions(dtype: torch.dtype = torch.float32, widths=None, with_logits=True):
    """Return {name: (FunctionModule, FunctionSpec)} for prefill/decode/verify over one ToyCore."""
    widths = widths or {"prefill": 8, "decode": 1, "verify": 4}
    core = ToyCore().to(dtype).eval()
    cache_shape = (LAYERS, KV_HEADS, CONTEXT, HEAD_DIM)
    states = {"key_cache": torch.zeros(cache_shape, dtype=dtype), "value_cache": torch.zeros(cache_shape, dtype=dtype)}
    fdtype = "float16" if dtype == torch.float16 else "float32"
    out = {}
    for name, s in widths.items():
        outputs = [TensorSpec("argmax_ids", (1, s), "int32")]
        if with_logits:
            outputs.append(TensorSpec("logits", (1, s, VOCAB), fdtype))
        spec = FunctionSpec(
            name=name,
            inputs=(TensorSpec("input_ids", (1, s), "int32"), TensorSpec("position_ids", (1, s), "int32")),
            outputs=tuple(outputs),
            states=tuple(TensorSpec(n, cache_shape, fdtype) for n in states),
        )
        out[name] = (FunctionModule(core, spec, states), spec)
    return out


class ScatterToyCore(ToyCore):
    """ToyCore whose KV write is ``cache.index_put_((layer, heads, rows), x)``: scatter_nd in Core ML."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        # a buffer rather than torch.arange in forward: coremltools warns on every int64 arange it folds
        self.register_buffer("kv_heads", torch.arange(KV_HEADS, dtype=torch.int32)[:, None], persistent=False)

    def forward(self, input_ids, position_ids, key_cache, value_cache):
        s = input_ids.shape[1]
        h = self.embed[input_ids[0].long()]
        visible = self.slots[None, :] <= position_ids[0][:, None]
        bias = torch.where(visible, 0.0, -1e4).to(h.dtype)
        rows = position_ids[0][None, :].expand(KV_HEADS, -1)  # [Hkv, S]
        heads = self.kv_heads.expand_as(rows)
        for layer in range(LAYERS):
            k = (h @ self.k_proj[layer].T).view(s, KV_HEADS, HEAD_DIM).transpose(0, 1)
            v = (h @ self.v_proj[layer].T).view(s, KV_HEADS, HEAD_DIM).transpose(0, 1)
            layers = torch.full_like(rows, layer)
            key_cache.index_put_((layers, heads, rows), k.to(key_cache.dtype))
            value_cache.index_put_((layers, heads, rows), v.to(value_cache.dtype))
            keys = key_cache[layer].to(h.dtype)
            values = value_cache[layer].to(h.dtype)
            scores = k @ keys.transpose(1, 2) / HEAD_DIM**0.5 + bias
            attn = torch.softmax(scores, dim=-1) @ values
            h = h + attn.transpose(0, 1).reshape(s, KV_HEADS * HEAD_DIM) @ self.o_proj[layer].T
        logits = (h @ self.lm_head.T)[None]
        return {"argmax_ids": logits.argmax(-1).to(torch.int32), "logits": logits}


def scatter_toy_functions(dtype: torch.dtype = torch.float16):
    """toy_functions() (same specs, weights and shared states) over a ScatterToyCore."""
    plain = toy_functions(dtype)
    first_module, first_spec = next(iter(plain.values()))
    states = {s.name: getattr(first_module, s.name) for s in first_spec.states}
    core = ScatterToyCore().to(dtype).eval()
    return {name: (FunctionModule(core, spec, states), spec) for name, (_, spec) in plain.items()}
