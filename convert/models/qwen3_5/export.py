"""Qwen3.5: the registry hooks the pipeline calls (the core, the functions' specs, the commit-next-call host
contract, the manifest's and the plan's lines, the rollback's cost)."""

from __future__ import annotations

from math import ceil, log2

import torch
from torch import nn

from convert.errors import InputError
from convert.export.functions import NamedFunction
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models.part import Part, function_widths, part_tensors
from convert.models.qwen3 import export as qwen3
from convert.models.qwen3_5.config import (
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
    return Qwen35Core(args, target.context, tuple(target.taps or ()), pending_rows(target), widths, part)


def function_specs(args: Qwen35Args, target, dtype: torch.dtype = torch.float16,
                   part: Part | None = None) -> list[FunctionSpec]:
    """prefill / decode / verify over the same states; every function with layers takes ``accept``, prefill also
    ``valid``; a part's take and return what it needs (``convert/pipeline/partition.py``)."""
    if target.layout != "stateful":
        raise InputError(f"target.layout {target.layout}: the hybrid (Gated DeltaNet) target's ane functions, its "
                         "conv, recurrent and pending buffers owned by the host, are not exported yet; use layout "
                         "stateful")
    part = part or Part.whole(args)
    fdtype = DTYPE_NAMES[dtype]
    states = state_specs(args, target.context, pending_rows(target), fdtype, part.layer_indices)
    specs = []
    for name, width in function_widths(target):
        inputs, outputs = part_tensors(args, target, part, width, fdtype)
        if part.layer_indices:
            inputs += (TensorSpec("accept", (1,), "int32"),)
            if name not in LAZY_FUNCTIONS:
                inputs += (TensorSpec("valid", (1,), "int32"),)
        specs.append(FunctionSpec(name, inputs, outputs, states))
    return specs


def host_contract(args: Qwen35Args, target) -> dict:
    """What a runtime does between calls (README "Hybrid targets", docs/hybrid.md): the rows a call leaves pending
    are committed, or dropped, by the next call's ``accept``."""
    return {
        "name": HOST_CONTRACT_NAME,
        "version": HOST_CONTRACT_VERSION,
        "rollback": "commit-next-call",
        "inputs": {
            "accept": "int32 [1], every function: how many rows of the previous call to keep, counted from its "
                      "first row (0..that call's real rows); 0 after a prefill, at a session's start and after a reset",
            "valid": "int32 [1], prefill only: its real rows (the rest is right padding); a prefill commits them "
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
    cost = rollback_cost(a, target)
    mib = 2**20
    return [
        f"  qwen3_5 (hybrid): {a.num_hidden_layers} layers {pattern} ({len(a.linear_layers)} Gated DeltaNet L, "
        f"{len(a.full_layers)} gated attention F), hidden {a.hidden_size}, vocab {a.vocab_size}, "
        f"{'tied' if a.tie_word_embeddings else 'untied'} lm_head, context {target.context}",
        f"    attention: heads {a.num_attention_heads}/{a.num_key_value_heads} (head_dim {a.head_dim}, RoPE on "
        f"{a.rotary_dim} dims); Gated DeltaNet: {a.linear_num_key_heads} key / {a.linear_num_value_heads} value heads "
        f"(dims {a.linear_key_head_dim}/{a.linear_value_head_dim}), conv kernel {a.linear_conv_kernel_dim}",
        f"    rollback: {HOST_CONTRACT_NAME} v{HOST_CONTRACT_VERSION} (decode / verify rows pending, committed by the "
        f"next call's `accept`; prefill takes `valid`): pending {cost['pending_bytes'] / mib:.2f} MiB (per-row "
        f"snapshots would be {cost['snapshot_bytes'] / mib:.1f} MiB), commit {cost['commit_flops'] / 1e9:.3g} GFLOP "
        f"per call ({100 * cost['commit_flops'] / cost['verify_flops']:.2g}% of a verify)",
    ]


def reference_layers(model) -> nn.ModuleList:
    """The decoder layers of transformers' Qwen3_5ForCausalLM or Qwen3_5ForConditionalGeneration."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
