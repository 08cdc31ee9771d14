"""Qwen3.5: the registry hooks the pipeline calls (the core, the functions' specs, the commit-next-call host
contract, the manifest's and the plan's lines, the rollback's cost)."""

from __future__ import annotations

from math import ceil, log2

import torch
from torch import nn

from convert.export.ane import host_work
from convert.export.functions import NamedFunction
from convert.export.names import (
    ACCEPT,
    COMMIT_MASK,
    COMMIT_SELECT,
    CONV_STATE,
    HIDDEN_STATES,
    HISTORY_MASK,
    KEY_CACHE,
    KEY_HISTORY,
    PENDING_BA,
    PENDING_QKV,
    POSITION_IDS,
    RECURRENT_STATE,
    ROPE_COS,
    ROPE_SIN,
    VALID,
    VALID_MASK,
    VALID_SELECT,
    VALUE_HISTORY,
)
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models.part import Part, function_widths, part_tensors, with_ladder
from convert.models.qwen3 import export as qwen3
from convert.models.qwen3.config import HISTORY
from convert.models.qwen3_5.ane import GDN_NEXT, GDN_PENDING, Qwen35AneCore
from convert.models.qwen3_5.config import (
    ANE_HOST_CONTRACT_NAME,
    ANE_HOST_CONTRACT_VERSION,
    FAMILY,
    HOST_CONTRACT_NAME,
    HOST_CONTRACT_VERSION,
    LAZY_FUNCTIONS,
    LINEAR,
    VALUE_SCALE,
    Qwen35Args,
)
from convert.models.qwen3_5.core import Qwen35Core, state_specs

FunctionModule = NamedFunction


def pending_rows(target) -> int:
    """Rows of the pending buffers: the widest function that leaves its rows pending (decode 1, verify)."""
    return max(1, target.graphs.verify)


def build_core(args: Qwen35Args, target, part: Part | None = None) -> Qwen35Core:
    widths = tuple(width for _, width in function_widths(target))
    core = Qwen35AneCore if target.layout == "ane" else Qwen35Core
    return core(args, target.context, tuple(target.taps or ()), pending_rows(target), widths, part)


def function_specs(args: Qwen35Args, target, dtype: torch.dtype = torch.float16,
                   part: Part | None = None) -> list[FunctionSpec]:
    """prefill / decode / verify over the same states; every function with layers takes ``accept``, prefill also
    ``valid``; a part's take and return what it needs (``convert/pipeline/partition.py``). The ane layout's take
    the host's buffers and computed inputs instead (``ane_tensors``), and are repeated at each context of its ladder
    (``with_ladder``)."""
    return with_ladder(target, lambda at: _specs_at(args, at, dtype, part or Part.whole(args)))


def _specs_at(args: Qwen35Args, target, dtype: torch.dtype, part: Part) -> list[FunctionSpec]:
    fdtype = DTYPE_NAMES[dtype]
    ane = target.layout == "ane"
    states = () if ane else state_specs(args, target.context, pending_rows(target), fdtype, part.layer_indices)
    specs = []
    for name, width in function_widths(target):
        inputs, outputs = part_tensors(args, target, part, width, fdtype)
        if part.layer_indices and ane:
            extra_in, extra_out = ane_tensors(args, target, part, name, width, fdtype)
            inputs = tuple(t for t in inputs if t.name != POSITION_IDS) + extra_in
            outputs += extra_out
        elif part.layer_indices:
            inputs += (TensorSpec(ACCEPT, (1,), "int32"),)
            if name not in LAZY_FUNCTIONS:
                inputs += (TensorSpec(VALID, (1,), "int32"),)
        specs.append(FunctionSpec(name, inputs, outputs, states))
    return specs


def ane_tensors(args: Qwen35Args, target, part: Part, function: str, width: int,
                dtype: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """A part's ane inputs and outputs beside ``part_tensors``' (``convert/models/qwen3_5/ane.py``): with attention
    layers, RoPE's rows, the history mask and the KV history in, the call's KV rows out; with Gated DeltaNet layers,
    the four GDN buffers and the commit inputs from ``accept`` (a prefill's also from ``valid``) in, the committed
    state out and, for decode / verify, the rows left pending."""
    a, p = args, pending_rows(target)
    kernel = a.linear_conv_kernel_dim - 1
    states = {s.name: s for s in state_specs(a, target.context, p, dtype, part.layer_indices)}
    inputs, outputs = [], []
    if KEY_CACHE in states:
        kv = states[KEY_CACHE].shape
        rope = (width, a.rotary_dim // 2)
        inputs += [TensorSpec(ROPE_COS, rope, dtype), TensorSpec(ROPE_SIN, rope, dtype),
                   TensorSpec(HISTORY_MASK, (1, target.context), dtype),
                   *(TensorSpec(buffer, kv, dtype) for buffer in HISTORY)]
        outputs += [TensorSpec(rows, (kv[0], kv[1], width, kv[3]), dtype) for rows in HISTORY.values()]
    if CONV_STATE in states:
        inputs += [TensorSpec(name, states[name].shape, dtype) for name in (*GDN_NEXT, *GDN_PENDING)]
        inputs += [TensorSpec(COMMIT_MASK, (1, p), dtype), TensorSpec(COMMIT_SELECT, (kernel, kernel + p), dtype)]
        if function not in LAZY_FUNCTIONS:
            inputs += [TensorSpec(VALID_MASK, (1, width), dtype),
                       TensorSpec(VALID_SELECT, (kernel, kernel + width), dtype)]
        outputs += [TensorSpec(out, states[name].shape, dtype) for name, out in GDN_NEXT.items()]
        if function in LAZY_FUNCTIONS:
            outputs += [TensorSpec(out, (states[name].shape[0], width, states[name].shape[2]), dtype)
                        for name, out in GDN_PENDING.items()]
    return tuple(inputs), tuple(outputs)


def host_contract(args: Qwen35Args, target) -> dict:
    """What a runtime does between calls (docs/hybrid.md): the rows a call leaves pending
    are committed, or dropped, by the next call's ``accept``; in the ane layout the host also owns the buffers
    (``ane_contract``)."""
    contract = commit_contract(target)
    return ane_contract(args, target, contract) if target.layout == "ane" else contract


def ane_contract(args: Qwen35Args, target, contract: dict) -> dict:
    """The commit-next-call contract with the ane layout's host work: every buffer, the positions, the commit inputs,
    the embedding lookup and the argmax (docs/layouts.md)."""
    return {
        **contract,
        "name": ANE_HOST_CONTRACT_NAME,
        "version": ANE_HOST_CONTRACT_VERSION,
        "inputs": {
            HIDDEN_STATES: "the embedding rows of the call's ids [1, S, hidden], looked up by the host from "
                             "embeddings.safetensors (the first part's, or the whole target's)",
            COMMIT_MASK: "[1, pending]: 1 for the previous call's pending rows below accept, 0 for the rest",
            COMMIT_SELECT: "[K-1, K-1+pending]: one-hot, row i picks row accept+i of [conv_state | pending_qkv]",
            VALID_MASK: "prefill: [1, S], 1 for its rows below valid",
            VALID_SELECT: "prefill: [K-1, K-1+S], one-hot, row i picks row valid+i of [committed history | rows]",
            ROPE_COS: "cos of the call's positions times RoPE's inverse frequencies [S, rotary_dim / 2]",
            ROPE_SIN: "their sin, as rope_cos",
            HISTORY_MASK: "[1, context]: 0 for the rows below the call's first position, -1e4 for the rest",
            KEY_HISTORY: "the host's key rows [attention layers, kv heads, context, head_dim], row c at position c",
            VALUE_HISTORY: "the host's value rows, as key_history",
            CONV_STATE: "the host's committed conv history [GDN layers, K-1, conv_dim]",
            RECURRENT_STATE: "the host's committed recurrent state [GDN layers, value heads, key dim, value dim]",
            PENDING_QKV: "the rows the previous decode / verify left pending [GDN layers, pending, conv_dim]",
            PENDING_BA: "their [b | a] rows [GDN layers, pending, 2 x value heads]",
        },
        "buffers": {**{buffer: {"rows": rows, "axis": 2} for buffer, rows in HISTORY.items()},
                    **{buffer: {"rows": rows, "axis": 0, "write": "whole"} for buffer, rows in GDN_NEXT.items()},
                    **{buffer: {"rows": rows, "axis": 1, "write": "leading"} for buffer, rows in GDN_PENDING.items()}},
        "commits": {ACCEPT: {"mask": COMMIT_MASK, "select": COMMIT_SELECT},
                    VALID: {"mask": VALID_MASK, "select": VALID_SELECT}},
        **host_work(args.rope_theta, args.rotary_dim, target.ladder),
        "rules": [
            *contract["rules"],
            "the package keeps no state: the host owns key_history / value_history (written at the call's positions "
            "from key_rows / value_rows), conv_state and recurrent_state (replaced by conv_state_next / "
            "recurrent_state_next after every call) and pending_qkv / pending_ba (a decode or verify's "
            "pending_qkv_rows / pending_ba_rows written at their leading rows); a fresh session zeroes them",
            "the functions take no input_ids, position_ids, accept or valid: the host passes the embedding rows as "
            "hidden_states, RoPE's rows and the history mask, and the commit masks and one-hot selections",
            "the head returns logits and no argmax: the host takes each row's argmax",
        ],
    }


def commit_contract(target) -> dict:
    return {
        "name": HOST_CONTRACT_NAME,
        "version": HOST_CONTRACT_VERSION,
        "rollback": "commit-next-call",
        "inputs": {
            ACCEPT: "int32 [1], every function: how many rows of the previous call to keep, counted from its "
                      "first row (0..that call's real rows); 0 after a prefill, at a session's start and after a reset",
            VALID: "int32 [1], prefill only: its real rows (the rest is right padding); a prefill commits them "
                     "itself and leaves nothing pending",
        },
        "pending_rows": {name: width for name, width in function_widths(target) if name in LAZY_FUNCTIONS},
        "rules": [
            "decode and verify leave their rows pending; the next call (any function) commits its first `accept` "
            "of them before its own rows: after a verify, the anchor and the accepted drafts (1..verify rows; 0 "
            "rejects the whole block); after a kept decode, 1",
            "the next call starts at position_ids[0] = the previous call's first position + accept; the rows of "
            "calls before the previous one are committed and cannot be rolled back",
            "never pass accept above the rows the previous call left pending; pass it on every call, also a decode "
            "after a decode (accept 1), or the previous call's rows are dropped",
            "attention KV rows are positional as in a dense target: cache row c holds position c, a query at p reads "
            "rows 0..p, rejected rows are overwritten later; positions stay below the context",
            "a fresh session zeroes every state",
        ],
    }


def architecture_record(args: Qwen35Args, target) -> dict:
    return {
        **qwen3.architecture_record(args, target),
        "family": FAMILY,
        "hybrid": {
            "layer_types": list(args.layer_types), "rotary_dim": args.rotary_dim, "attention_output_gate": True,
            "linear_num_key_heads": args.linear_num_key_heads, "linear_num_value_heads": args.linear_num_value_heads,
            "linear_key_head_dim": args.linear_key_head_dim, "linear_value_head_dim": args.linear_value_head_dim,
            "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
            "recurrent_state_scale": VALUE_SCALE,
        },
    }


def rollback_cost(args: Qwen35Args, target, dtype_bytes: int = 2) -> dict:
    """What the commit-next-call rollback costs at this shape (computed from the shapes; docs/hybrid.md):
    ``pending_bytes`` (the extra state), ``snapshot_bytes`` (per-row recurrent-state snapshots, vLLM's design, for
    comparison), ``commit_flops`` per call (the pending rows through the conv and the delta rule), ``verify_flops``
    (about 2 x linear weights x verify rows), and the GDN state bytes every call writes."""
    a, v = args, pending_rows(target)
    n = len(a.linear_layers)
    hv, dk, dv = a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    recurrent = n * hv * dk * dv * dtype_bytes
    pending = n * v * (a.conv_dim + 2 * hv) * dtype_bytes
    per_head = 4 * v * dk * dv + 2 * v * v * (dk + dv) + 2 * (2 * ceil(log2(max(v, 2))) - 2) * v**3
    commit = n * (hv * per_head + 2 * a.conv_dim * a.linear_conv_kernel_dim * v)
    linear = a.parameter_count - (0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size)  # lookups are free
    return {
        "pending_rows": v,
        "pending_bytes": pending,
        "recurrent_state_bytes": recurrent,
        "snapshot_bytes": v * recurrent,
        "commit_flops": commit,
        "verify_flops": 2 * linear * v,
        "state_bytes_written": recurrent + n * (a.linear_conv_kernel_dim - 1) * a.conv_dim * dtype_bytes + pending,
    }


def plan_lines(args: Qwen35Args, target) -> list[str]:
    a = args
    pattern = "".join("L" if t == LINEAR else "F" for t in a.layer_types)
    cost, contract = rollback_cost(a, target), host_contract(a, target)
    mib = 2**20
    return [
        f"  qwen3_5 (hybrid): {a.num_hidden_layers} layers {pattern} ({len(a.linear_layers)} Gated DeltaNet L, "
        f"{len(a.full_layers)} gated attention F), hidden {a.hidden_size}, vocab {a.vocab_size}, "
        f"{'tied' if a.tie_word_embeddings else 'untied'} lm_head, context {target.context}",
        f"    attention: heads {a.num_attention_heads}/{a.num_key_value_heads} (head_dim {a.head_dim}, RoPE on "
        f"{a.rotary_dim} dims); Gated DeltaNet: {a.linear_num_key_heads} key / {a.linear_num_value_heads} value heads "
        f"(dims {a.linear_key_head_dim}/{a.linear_value_head_dim}), conv kernel {a.linear_conv_kernel_dim}",
        f"    rollback: {contract['name']} v{contract['version']} (decode / verify rows pending, committed by the "
        f"next call's `accept`; prefill takes `valid`): pending {cost['pending_bytes'] / mib:.2f} MiB (per-row "
        f"snapshots would be {cost['snapshot_bytes'] / mib:.1f} MiB), commit {cost['commit_flops'] / 1e9:.3g} GFLOP "
        f"per call ({100 * cost['commit_flops'] / cost['verify_flops']:.2g}% of a verify)",
    ]


def reference_layers(model) -> nn.ModuleList:
    """The decoder layers of transformers' Qwen3_5ForCausalLM or Qwen3_5ForConditionalGeneration."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
