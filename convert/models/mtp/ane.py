"""MTP head in the ane layout (``convert/export/ane.py``, docs/layouts.md): the head's modules and weights as
``core.py``, channels first with 1x1 convolutions, over the host's KV history instead of states.

``accept`` and ``draft_step`` take the embedding rows of the call's tokens as ``token_embeddings`` (the host looks them
up in the target bundle's embeddings.safetensors: the head borrows the target's table), the target's ``hidden`` rows,
RoPE's ``rope_cos`` / ``rope_sin`` over the rotary dims, the ``history_mask`` [1, context] (row 0 holds no position:
the host masks it, ``first_row`` 1) and ``key_history`` / ``value_history`` [1, kv heads, context, head_dim]; they
return ``logits`` (the host's argmax is ``draft_ids``), ``hidden_out`` and the call's ``key_rows`` / ``value_rows``,
which the host writes at the call's positions. The head's block is the Qwen3.5 attention layer of
``convert/models/qwen3_5/ane.py`` (output gate and partial RoPE where the head has them)."""

from __future__ import annotations

import torch

from convert.export.ane import (
    channels_first,
    head_outputs,
    history_bias,
    host_work,
    logits_parts,
    pointwise,
    rms_norm,
    rows_of,
)
from convert.export.names import (
    ARGMAX_IDS,
    DRAFT_IDS,
    HIDDEN,
    HIDDEN_OUT,
    HISTORY_MASK,
    KEY_HISTORY,
    KEY_ROWS,
    ROPE_COS,
    ROPE_SIN,
    VALUE_HISTORY,
    VALUE_ROWS,
)
from convert.fp16 import noted_output, within
from convert.models.mtp.config import MTPArgs
from convert.models.mtp.core import MTPCore
from convert.models.qwen3.ane import mlp
from convert.models.qwen3.config import HISTORY
from convert.models.qwen3_5.ane import gated_attention

EMBEDDED = "token_embeddings"  # the host's embedding rows of the call's tokens


class MTPAneCore(MTPCore):
    """``MTPCore`` in the ane layout: ``forward`` takes the host's rows, position inputs and history and returns the
    call's KV rows beside ``logits`` and ``hidden_out``."""

    host_lookup = True  # its embedding table is the host's (``part.host_tables``), unless the head is tied to it

    def forward(self, token_embeddings, hidden, rope_cos, rope_sin, history_mask, key_history, value_history, *,
                width: int):
        dtype = self.compute_dtype
        embedded = rms_norm(self.pre_fc_norm_embedding, channels_first(token_embeddings[0].to(dtype)))
        given = rms_norm(self.pre_fc_norm_hidden, channels_first(hidden[0].to(dtype)))
        x = pointwise(self.fc, torch.cat([embedded, given], dim=1))  # [embedding | hidden], as fused_input
        cos, sin = rope_cos.transpose(0, 1), rope_sin.transpose(0, 1)  # [rotary_dim / 2, S]
        bias = history_bias(history_mask, width)
        keys, values = [], []
        for j, layer in enumerate(self.layers):
            with within(layer):
                mixed, k, v = gated_attention(layer.self_attn, rms_norm(layer.input_layernorm, x), cos, sin, bias,
                                              key_history[j], value_history[j], width)
                x = x + mixed
                x = x + mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x))
            noted_output(layer, x)
            keys.append(k[None])
            values.append(v[None])
        hidden_out = rms_norm(self.norm, x)
        return {**head_outputs(self.lm_head, hidden_out), HIDDEN_OUT: rows_of(hidden_out)[None],
                KEY_ROWS: torch.cat(keys), VALUE_ROWS: torch.cat(values)}


def host_contract(args: MTPArgs, head_ranges: list[tuple[int, int]]) -> dict:
    """The ane layout's host contract (``manifests.schema.HostContract``) of an MTP head with its logits in
    ``head_ranges``."""
    return {
        "name": "spec-convert/mtp-host-history", "version": 1, "rollback": "positional", "pending_rows": {},
        "inputs": {EMBEDDED: "the embedding rows of the call's tokens [1, S, hidden], looked up by the host in the "
                             "target bundle's embeddings.safetensors (the head borrows the target's table)",
                   HIDDEN: "the target's final-norm hidden rows of the positions before the tokens' (or the head's "
                             "own hidden_out for a chained draft_step)",
                   ROPE_COS: "cos of the call's positions times RoPE's inverse frequencies [S, rotary_dim / 2]",
                   ROPE_SIN: "their sin, as rope_cos",
                   HISTORY_MASK: "[1, context]: 0 for rows 1 .. the call's first position - 1, -1e4 for the rest",
                   KEY_HISTORY: "the host's key rows [1, kv heads, context, head_dim], row p at position p",
                   VALUE_HISTORY: "the host's value rows, as key_history"},
        "buffers": {buffer: {"rows": rows, "axis": 2} for buffer, rows in HISTORY.items()},
        **host_work(args.rope_theta, args.rotary_dim, embedded=EMBEDDED, first_row=1), ARGMAX_IDS: DRAFT_IDS,
        **logits_parts(head_ranges),
        "rules": [
            "the functions take no input_ids and no position_ids: the host passes token_embeddings (the target "
            "bundle's embeddings.safetensors rows of the tokens), rope_cos / rope_sin and history_mask",
            "the package keeps no state: the host owns key_history and value_history, passes them to every call, and "
            "after each call writes its key_rows / value_rows (row j) at row position_ids[j]",
            "row 0 of the history holds no position (a head row's token is at position t + 1 >= 1): history_mask "
            "hides it always",
            "the functions return logits and no argmax: the host's argmax of each row is its draft_ids (the lowest id "
            "among equal maxima)",
            "rollback is positional: rows past a query's position are never read, the next accept overwrites the rows "
            "draft_step wrote",
        ],
    }
