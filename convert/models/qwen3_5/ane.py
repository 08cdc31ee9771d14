"""Qwen3.5 (hybrid) in the ane layout (``convert/export/ane.py``, docs/layouts.md): the same modules and weights as
``core.py``, channels first with 1x1 convolutions, over buffers the host owns instead of states.

The attention layers read the host's ``key_history`` / ``value_history`` and return their ``key_rows`` /
``value_rows``, as the dense target's (``convert/models/qwen3/ane.py``), with the family's output gate and partial
RoPE. The Gated DeltaNet layers take the host's ``conv_state``, ``recurrent_state``, ``pending_qkv`` and
``pending_ba`` and return what the stateful functions would write into them: the committed conv history and
recurrent state (``conv_state_next``, ``recurrent_state_next``, which replace the buffers) and, for decode and
verify, their rows left pending (``pending_qkv_rows``, ``pending_ba_rows``, written at the buffers' leading rows).
The commit counts arrive as the host computes them (``HostCommit``): ``commit_mask`` / ``commit_select`` from
``accept``, ``valid_mask`` / ``valid_select`` from a prefill's ``valid``, so the graph compares no integers and
gathers nothing. The recurrence itself is the stateful one (``GatedDeltaNet.recur``), in rows, but in the
activations' dtype (fp16 in a package: the Neural Engine computes nothing in fp32) with the forms finite there
(``scaled_l2norm``, the gated norm of the scaled outputs).
"""

from __future__ import annotations

import torch

from convert.export.ane import channels_first, history_bias, pointwise, rms_norm, rows_of
from convert.export.names import CONV_STATE, KEY_ROWS, PENDING_BA, PENDING_QKV, RECURRENT_STATE, VALUE_ROWS
from convert.fp16 import noted_output, within
from convert.models.part import ane_outputs, host_rows
from convert.models.qwen3.ane import attend_heads, mlp, rotate
from convert.models.qwen3.config import HISTORY
from convert.models.qwen3_5.config import LINEAR
from convert.models.qwen3_5.core import Commit, GatedAttention, GatedDeltaNet, Qwen35Core

GDN_NEXT = {CONV_STATE: "conv_state_next", RECURRENT_STATE: "recurrent_state_next"}  # replaced after each call
GDN_PENDING = {PENDING_QKV: "pending_qkv_rows", PENDING_BA: "pending_ba_rows"}  # decode / verify: leading rows


class Qwen35AneCore(Qwen35Core):
    """``Qwen35Core`` in the ane layout: ``forward`` takes the host's rows, position and commit inputs and buffers
    instead of ids, positions, counts and states, and returns the rows for the host's buffers beside the outputs
    ``ane_outputs`` names (logits; the host takes the argmax)."""

    host_lookup = True  # its embedding table is the host's (``part.host_tables``)
    recurrence_dtype = None  # the delta rule in the activations' dtype: fp16 on the device, which has no fp32

    def forward(self, hidden_states=None, rope_cos=None, rope_sin=None, history_mask=None, key_history=None,
                value_history=None, conv_state=None, recurrent_state=None, pending_qkv=None, pending_ba=None,
                commit_mask=None, commit_select=None, valid_mask=None, valid_select=None, *, width: int):
        x = channels_first(host_rows(self, hidden_states))
        tapped, rows = [], {name: [] for name in (*HISTORY.values(), *GDN_NEXT.values(), *GDN_PENDING.values())}
        if self.layers:  # a piece of attention layers alone (the streamed gate's units) takes no commit inputs
            commit = None if commit_mask is None else host_commit(width, commit_mask, commit_select, valid_mask,
                                                                  valid_select)
            cos = sin = bias = None
            if rope_cos is not None:
                cos, sin = rope_cos.transpose(0, 1), rope_sin.transpose(0, 1)  # [rotary_dim / 2, S]
                bias = history_bias(history_mask, width)
            for i, layer in zip(self.part.layer_indices, self.layers, strict=True):
                with within(layer):
                    h = rms_norm(layer.input_layernorm, x)
                    if layer.kind == LINEAR:
                        gdn = layer.linear_attn
                        h, state, history, mixed, ba = gated_delta_net(
                            gdn, h, commit, self, conv_state[gdn.slot], recurrent_state[gdn.slot],
                            pending_qkv[gdn.slot], pending_ba[gdn.slot])
                        rows["conv_state_next"].append(history)
                        rows["recurrent_state_next"].append(state)
                        if commit.valid is None:  # decode / verify leave their rows pending
                            rows["pending_qkv_rows"].append(mixed)
                            rows["pending_ba_rows"].append(ba)
                    else:
                        attn = layer.self_attn
                        h, k, v = gated_attention(attn, h, cos, sin, bias, key_history[attn.layer_index],
                                                  value_history[attn.layer_index], width)
                        rows[KEY_ROWS].append(k)
                        rows[VALUE_ROWS].append(v)
                    x = x + h
                    x = x + mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x))
                noted_output(layer, x)
                if i in self.taps:
                    tapped.append((self.taps.index(i), x))
        dtype = x.dtype
        out = {name: torch.cat([t[None] for t in got]).to(dtype) for name, got in rows.items() if got}  # no stack
        return {**ane_outputs(self, x, tapped), **out}


def host_commit(width: int, commit_mask, commit_select, valid_mask, valid_select) -> Commit:
    """The call's commits from the host's inputs: masks multiply (1.0 / 0.0), the one-hot selections pick the conv
    history rows by a matmul."""

    def picked(select):
        return lambda window: select.to(window.dtype) @ window

    valid = valid_mask is not None
    return Commit(width, commit_mask[0], picked(commit_select), valid_mask[0] if valid else None,
                  picked(valid_select) if valid else None)


def gated_delta_net(gdn: GatedDeltaNet, x, commit: Commit, core: Qwen35Core, conv_state, recurrent_state,
                    pending_qkv, pending_ba):
    """One Gated DeltaNet layer on channels-first rows ``x`` [1, H, 1, S]: its output (the same), the recurrent
    state and conv history to keep, and the call's in_proj_qkv rows [S, C] and [b | a] rows [S, 2 Hv]."""
    mixed = rows_of(pointwise(gdn.in_proj_qkv, x))
    ba = rows_of(torch.cat([pointwise(gdn.in_proj_b, x), pointwise(gdn.in_proj_a, x)], dim=1))
    z = rows_of(pointwise(gdn.in_proj_z, x))
    out, state, history = gdn.recur(mixed, ba, commit, core, conv_state, recurrent_state, pending_qkv, pending_ba)
    return pointwise(gdn.out_proj, channels_first(gdn.gated_output(out, z, core))), state, history, mixed, ba


def gated_attention(attn: GatedAttention, x, cos, sin, bias, key_history, value_history, width: int):
    """The family's attention on channels-first rows: q and its output gate from one projection (per head, q then
    the gate, as ``GatedAttention.project`` views them), RoPE on the leading ``rotary_dim`` dims, the output times
    ``sigmoid(gate)`` before o_proj; and the call's k and v rows."""
    heads, d = attn.heads, attn.head_dim
    projected = pointwise(attn.q_proj, x)
    gate = None
    if attn.gated:
        per_head = projected.reshape(heads, 2 * d, width)
        q, gate = per_head[:, :d], per_head[:, d:].reshape(1, heads * d, 1, width)
    else:
        q = projected.reshape(heads, d, width)

    def partial(t, c, s):  # RoPE on the leading rotary_dim dims of each head [N, head_dim, S], the rest unchanged
        if attn.rotary_dim == d:
            return rotate(t, c, s)
        return torch.cat([rotate(t[:, : attn.rotary_dim], c, s), t[:, attn.rotary_dim :]], dim=1)

    q = partial(rms_norm(attn.q_norm, q), cos, sin)
    out, k, v = attend_heads(attn, x, q, cos, sin, bias, key_history, value_history, width, partial)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return pointwise(attn.o_proj, out), k, v
