"""Qwen3 dense: the registry hooks the pipeline calls (the core, the functions' specs, the host contract, the
manifest's and the plan's lines)."""

from __future__ import annotations

import torch
from torch import nn

from convert.export import functions as export
from convert.export.ane import host_work
from convert.export.names import HISTORY_MASK, POSITION_IDS, ROPE_COS, ROPE_SIN
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models.part import Part, function_widths, part_tensors, with_ladder
from convert.models.qwen3.ane import Qwen3AneCore
from convert.models.qwen3.config import ANE_HOST_CONTRACT, FAMILY, HISTORY, HOST_CONTRACT, STATE_NAMES, Qwen3Args
from convert.models.qwen3.core import Qwen3Core

FunctionModule = export.NamedFunction


def build_core(args: Qwen3Args, target, part: Part | None = None) -> Qwen3Core:
    core = Qwen3AneCore if target.layout == "ane" else Qwen3Core
    return core(args, target.context, tuple(target.taps or ()), part)


def function_specs(args: Qwen3Args, target, dtype: torch.dtype = torch.float16,
                   part: Part | None = None) -> list[FunctionSpec]:
    """prefill / decode / verify: same inputs (``input_ids``, ``position_ids``), states and outputs, each at its
    own static width S; a part's take and return what it needs (``convert/pipeline/partition.py``); and the same at
    each context of the ane layout's ladder (``with_ladder``)."""
    return with_ladder(target, lambda at: _specs_at(args, at, dtype, part or Part.whole(args)))


def _specs_at(args: Qwen3Args, target, dtype: torch.dtype, part: Part) -> list[FunctionSpec]:
    fdtype = DTYPE_NAMES[dtype]
    layers = len(part.layer_indices)
    cache = (layers, args.num_key_value_heads, target.context, args.head_dim)
    ane = target.layout == "ane" and layers
    states = tuple(TensorSpec(name, cache, fdtype) for name in STATE_NAMES) if layers and not ane else ()
    specs = []
    for name, width in function_widths(target):
        inputs, outputs = part_tensors(args, target, part, width, fdtype)
        if ane:  # positions as the host computes them, its history in, the call's rows out (its host contract)
            rows = (layers, args.num_key_value_heads, width, args.head_dim)
            rope = (width, args.head_dim // 2)
            inputs = tuple(t for t in inputs if t.name != POSITION_IDS) + (
                TensorSpec(ROPE_COS, rope, fdtype), TensorSpec(ROPE_SIN, rope, fdtype),
                TensorSpec(HISTORY_MASK, (1, target.context), fdtype),
                *(TensorSpec(buffer, cache, fdtype) for buffer in HISTORY))
            outputs += tuple(TensorSpec(out, rows, fdtype) for out in HISTORY.values())
        specs.append(FunctionSpec(name, inputs, outputs, states))
    return specs


def host_contract(args: Qwen3Args, target) -> dict:
    if target.layout != "ane":
        return HOST_CONTRACT
    return {**ANE_HOST_CONTRACT, **host_work(args.rope_theta, args.head_dim, target.ladder)}


def architecture_record(args: Qwen3Args, target) -> dict:
    return {
        "family": FAMILY, "hidden_size": args.hidden_size, "num_layers": args.num_hidden_layers,
        "num_heads": args.num_attention_heads, "num_kv_heads": args.num_key_value_heads, "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings, "rope_type": args.rope_type, "rope_theta": args.rope_theta,
        "rms_norm_eps": args.rms_norm_eps, "context": target.context,
    }


def plan_lines(args: Qwen3Args, target) -> list[str]:
    return [f"  qwen3: {args.num_hidden_layers} layers, hidden {args.hidden_size}, heads {args.num_attention_heads}/"
            f"{args.num_key_value_heads} (head_dim {args.head_dim}), vocab {args.vocab_size}, "
            f"{'tied' if args.tie_word_embeddings else 'untied'} lm_head, context {target.context}"]


def reference_layers(model) -> nn.ModuleList:
    return model.model.layers
