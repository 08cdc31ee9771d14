"""DFlash2 in the ane layout (``convert/export/ane.py``, docs/layouts.md), as anemll-forge's DFlash2 drafter: the
drafter's modules and weights as ``core.py``, channels first with 1x1 convolutions, over a context ring the host owns.

``context_update`` / ``context_append`` take the call's ``taps`` and RoPE's ``rope_cos`` / ``rope_sin`` and return
the ring's new rows ``ring_key_rows`` / ``ring_value_rows`` [layers, kv heads, S, head_dim], which the host writes at
slot position mod ring. ``draft`` takes the anchor's embedding row, the block's RoPE rows, the ring ``ring_keys`` /
``ring_values`` [layers, kv heads, ring, head_dim] and one ring mask [ring, S] per distinct sliding window (the host
computes them from the positions its slots hold: ``HostOwned.ring_mask_inputs``), and returns the block's ``logits``
and, with a candidate selector, its projection of the block's rows (``selector_projected``): the host takes the top-k,
reads the codebooks (the bundle's selector.safetensors) and walks (``convert.export.selector.selector_walk``), or takes
the argmax. So the graph holds no lookup, no top-k, no argmax, no integer arithmetic and no state.
"""

from __future__ import annotations

import torch
from torch import nn

from convert.export.ane import channels_first, head_outputs, host_work, logits_parts, pointwise, rms_norm, rows_of
from convert.export.names import (
    ANCHOR_EMBEDDING,
    ARGMAX_IDS,
    DRAFT_IDS,
    RING_KEYS,
    RING_VALUES,
    ROPE_COS,
    ROPE_SIN,
    SELECTOR_PROJECTED,
    SELECTOR_SCORES,
    TAPS,
)
from convert.fp16 import noted_output, within
from convert.models.dflash2.config import DFlash2Args
from convert.models.dflash2.core import DFlash2Core, GroupedConv
from convert.models.qwen3.ane import attention, keys_values, mlp

RING = {RING_KEYS: "ring_key_rows", RING_VALUES: "ring_value_rows"}  # the host's ring and each call's rows
PROJECTED = SELECTOR_PROJECTED


def ring_mask_name(window: int | None) -> str:
    """The draft's input holding the ring mask of layers with sliding ``window`` (None: the whole ring)."""
    return "ring_mask" if window is None else f"ring_mask_{window}"


class DFlash2AneCore(DFlash2Core):
    """``DFlash2Core`` in the ane layout: ``context`` returns the ring's new rows, ``draft`` reads the host's ring
    through its masks and returns logits (and the selector's projection) instead of ids."""

    host_parameters = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")

    def context(self, taps, rope_cos, rope_sin):
        dtype = self.compute_dtype
        fused = rms_norm(self.hidden_norm, pointwise(self.fc, channels_first(taps[0].to(dtype))))
        cos, sin = rope_cos.transpose(0, 1), rope_sin.transpose(0, 1)  # [head_dim / 2, S]
        keys, values = [], []
        for layer in self.layers:
            k, v = keys_values(layer.self_attn, fused, cos, sin, -1)  # the call's rows: no shape read in the graph
            keys.append(k.transpose(1, 2)[None])
            values.append(v.transpose(1, 2)[None])
        return {"ring_key_rows": torch.cat(keys), "ring_value_rows": torch.cat(values)}

    def draft(self, anchor_embedding, rope_cos, rope_sin, ring_keys, ring_values, **ring_masks):
        args, dtype, width, device = self.args, self.compute_dtype, self.draft_width, anchor_embedding.device
        # no tile; the constants on the inputs' device (a GPU's compute copy: torch.zeros alone makes a CPU tensor)
        masks = self.mask_embedding.to(dtype).reshape(1, -1, 1, 1) + torch.zeros(width - 1, dtype=dtype, device=device)
        anchor = anchor_embedding[0].to(dtype)
        if self.residual_scale != 1:
            anchor = anchor * self.residual_scale
        h = torch.cat([channels_first(anchor), masks], dim=3)  # [1, H, 1, S]
        cos, sin = rope_cos.transpose(0, 1), rope_sin.transpose(0, 1)
        block = torch.zeros((width, width), dtype=dtype, device=device)  # the block's rows all see each other
        biases = {window: torch.cat([ring_masks[ring_mask_name(window)], block], dim=0)
                  for window in dict.fromkeys(args.layer_windows)}
        for i, layer in enumerate(self.layers):
            def attend(x, layer=layer, i=i):
                bias = biases[args.layer_windows[i]]
                return attention(layer.self_attn, x, cos, sin, bias, ring_keys[i], ring_values[i], width)[0]

            with within(layer):
                h = h + around(rms_norm(layer.input_layernorm, h), getattr(layer, "attention_conv", None), attend,
                               width)
                h = h + around(rms_norm(layer.post_attention_layernorm, h), getattr(layer, "mlp_conv", None),
                               lambda x, layer=layer: mlp(layer.mlp, x), width)
            noted_output(layer, h)
        hidden = rms_norm(self.norm, h[:, :, :, 1:])
        out = head_outputs(self.lm_head, hidden)
        if args.has_selector:
            out[PROJECTED] = rows_of(pointwise(self.candidate_selector.hidden_projection, hidden))[None]
        return out


def around(x, conv: GroupedConv | None, sublayer, width: int):
    """``DraftLayer._around`` channels first: the sublayer between the grouped conv's two mixes, when it has one."""
    if conv is None:
        return sublayer(x)
    dynamic = pointwise(conv.kernel_projection, x)
    return mix(conv, sublayer(mix(conv, x, dynamic, 0, width)), dynamic, 1, width)


def mix(conv: GroupedConv, x, dynamic, side: int, width: int):
    """``GroupedConv.mix`` on channels-first rows [1, H, 1, T]: each group's coefficient spread over its channels by a
    1x1 convolution with the 0/1 spread (exact), the rows shifted along T with zeros before the block's start."""
    out = None
    spread = conv.group_spread.to(x.dtype).transpose(0, 1)[:, :, None, None]  # [H, groups, 1, 1]
    for j in range(conv.kernel):
        start = (side * conv.kernel + j) * conv.groups
        coefficient = conv.base_kernel[side, j].to(x.dtype).reshape(1, -1, 1, 1) + nn.functional.conv2d(
            dynamic[:, start:start + conv.groups], spread)
        shifted = x if j == 0 else torch.cat([torch.zeros_like(x[..., :j]), x[..., : width - j]], dim=3)
        term = coefficient * shifted
        out = term if out is None else out + term
    return out


def host_contract(args: DFlash2Args, ring_rows: int, head_ranges: list[tuple[int, int]]) -> dict:
    """The ane layout's host contract (``manifests.schema.HostContract``) of a DFlash2 drafter with a ring of
    ``ring_rows`` and its logits in ``head_ranges``."""
    windows = dict.fromkeys(args.layer_windows)
    contract = {
        "name": "spec-convert/dflash2-host-ring", "version": 1, "rollback": "positional", "pending_rows": {},
        "inputs": {TAPS: "the target's tapped rows of the context positions [1, S, taps x hidden] (context_update, "
                           "context_append)",
                   ANCHOR_EMBEDDING: "the anchor token's embedding row [1, 1, hidden] (draft)",
                   ROPE_COS: "cos of the call's positions times RoPE's inverse frequencies [S, head_dim / 2]",
                   ROPE_SIN: "their sin, as rope_cos",
                   **{ring_mask_name(w): f"[ring, S]: 0 where the slot holds a position below the draft's first"
                                         f"{'' if w is None else f' and within {w} of the query'}, -1e4 elsewhere"
                      for w in windows},
                   RING_KEYS: "the host's ring of context keys [layers, kv heads, ring, head_dim], slot = position "
                                "mod ring",
                   RING_VALUES: "the host's ring of context values, as ring_keys"},
        "buffers": {buffer: {"rows": rows, "axis": 2, "ring": ring_rows} for buffer, rows in RING.items()},
        "ring_masks": {ring_mask_name(w): w for w in windows},
        **host_work(args.rope_theta, args.head_dim, embedded=None), ARGMAX_IDS: DRAFT_IDS,
        **logits_parts(head_ranges),
        "rules": [
            "the package keeps no state: the host owns ring_keys and ring_values, passes them to draft, and after a "
            "context_update / context_append writes its ring_key_rows / ring_value_rows (row j) at slot "
            "position_ids[j] mod ring, remembering the position each slot holds",
            "the functions take no position_ids: the host passes rope_cos / rope_sin of the call's positions (the "
            "context rows', or the block's p0 .. p0 + S - 1) and, to draft, one ring mask per sliding window",
            "draft returns logits of the block's rows 1 .. S-1; the host takes their argmax as draft_ids, or, with a "
            "candidate selector, walks it: the top-k of each row's logits, the codebooks' rows from "
            "selector.safetensors and the draft's selector_projected, from the caller's anchor_id",
        ],
    }
    if args.has_selector:
        contract["selector"] = {"projection": PROJECTED, "file": "selector.safetensors", "top_k": args.selector_top_k,
                                "ids": DRAFT_IDS, "scores": SELECTOR_SCORES}
    return contract
