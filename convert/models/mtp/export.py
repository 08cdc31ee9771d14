"""MTP head: the functions' specs (accept, draft_step), the export modules over one core and the reference filled
with the same weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from convert.errors import InputError
from convert.export.ane import logits_specs, split_head
from convert.export.functions import ExportModules, NamedFunction, parameters_on_meta
from convert.export.names import (
    DRAFT_IDS,
    HIDDEN,
    HIDDEN_OUT,
    HISTORY_MASK,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    ROPE_COS,
    ROPE_SIN,
)
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models.mtp.ane import EMBEDDED, MTPAneCore, host_contract
from convert.models.mtp.checkpoint import HeadWeights, borrowed_tables
from convert.models.mtp.config import DRAFT_STEPS, STATE_NAMES, MTPArgs
from convert.models.mtp.core import MTPCore
from convert.models.mtp.reference import MTPReference
from convert.models.part import drafter_head_ranges, stream_norms
from convert.models.qwen3.config import HISTORY
from convert.models.qwen3.core import RESIDUAL_WRITERS


def function_specs(
    args: MTPArgs,
    draft_steps: int = DRAFT_STEPS,
    context: int = 2048,
    dtype: torch.dtype = torch.float16,
    logits: bool = False,
    layout: str = "stateful",
    head_ranges: list[tuple[int, int]] | None = None,
) -> list[FunctionSpec]:
    """``accept`` (S = draft_steps + 1) and ``draft_step`` (S = 1): same inputs, outputs and states. In the ane layout
    (``convert/models/mtp/ane.py``) they take the host's rows, position inputs and history and return logits (in
    ``head_ranges``: ``drafter_head_ranges``) and the call's KV rows instead."""
    if draft_steps < 1:
        raise InputError(f"draft steps must be at least 1, got {draft_steps}")
    fdtype = DTYPE_NAMES[dtype]
    cache = (args.mtp_layers, args.num_key_value_heads, context, args.head_dim)
    ane = layout == "ane"
    head_ranges = drafter_head_ranges(args.vocab_size, head_ranges)
    states = () if ane else tuple(TensorSpec(name, cache, fdtype) for name in STATE_NAMES)
    specs = []
    for name, width in (("accept", draft_steps + 1), ("draft_step", 1)):
        rows = (1, width, args.hidden_size)
        if ane:
            rope = (width, args.rotary_dim // 2)
            inputs = (TensorSpec(EMBEDDED, rows, fdtype), TensorSpec(HIDDEN, rows, fdtype),
                      TensorSpec(ROPE_COS, rope, fdtype), TensorSpec(ROPE_SIN, rope, fdtype),
                      TensorSpec(HISTORY_MASK, (1, context), fdtype),
                      *(TensorSpec(buffer, cache, fdtype) for buffer in HISTORY))
            new_rows = (args.mtp_layers, args.num_key_value_heads, width, args.head_dim)
            outputs = (*logits_specs(head_ranges, width, fdtype), TensorSpec(HIDDEN_OUT, rows, fdtype),
                       *(TensorSpec(out, new_rows, fdtype) for out in HISTORY.values()))
            specs.append(FunctionSpec(name=name, inputs=inputs, outputs=outputs, states=states))
            continue
        inputs = (
            TensorSpec(INPUT_IDS, (1, width), "int32"),
            TensorSpec(HIDDEN, rows, fdtype),
            TensorSpec(POSITION_IDS, (1, width), "int32"),
        )
        outputs = [
            TensorSpec(DRAFT_IDS, (1, width), "int32"),
            TensorSpec(HIDDEN_OUT, rows, fdtype),
        ]
        if logits:
            outputs.append(TensorSpec(LOGITS, (1, width, args.vocab_size), fdtype))
        specs.append(FunctionSpec(name=name, inputs=inputs, outputs=tuple(outputs), states=states))
    return specs


@dataclass
class MTPModules(ExportModules):
    core: MTPCore

    def call(self, name: str, input_ids=None, hidden=None, position_ids=None, **extra) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states (``call_with``): the stateful functions' ids, hidden
        rows and positions, or the ane functions' inputs by name (``extra``)."""
        given = {k: v for k, v in ((INPUT_IDS, input_ids), (HIDDEN, hidden), (POSITION_IDS, position_ids))
                 if v is not None}
        return self.call_with(name, {**given, **extra})


def build_modules(
    args: MTPArgs,
    head: HeadWeights,
    target_tensors: dict[str, torch.Tensor],
    context: int,
    draft_steps: int = DRAFT_STEPS,
    dtype: torch.dtype = torch.float16,
    logits: bool = False,
    layout: str = "stateful",
    head_ranges: list[tuple[int, int]] | None = None,
    residual_scale: float = 1.0,
) -> MTPModules:
    """Export modules in ``dtype`` over one core (the head's weights and the borrowed target tables, once) and one
    pair of KV states (none in the ane ``layout``: the host's history, ``convert/models/mtp/ane.py``, and the lm_head
    computed in ``head_ranges``: ``drafter_head_ranges``); ``target_tensors`` needs the target's
    ``model.embed_tokens.weight`` and ``lm_head.weight``. ``residual_scale``: the head's range scale
    (``convert/weights/rescale.py``): its stream starts from ``fc`` over normed rows, so ``fc`` and every layer's
    ``o_proj`` and ``down_proj`` are multiplied by it (in fp32, before the cast) and the eps of the norms that read the
    stream (each layer's two, the final one) by its square."""
    embed_tokens, lm_head = borrowed_tables(args, head, target_tensors)
    with parameters_on_meta():  # filled by load_weights in dtype: no core made in fp32 first
        core = (MTPAneCore if layout == "ane" else MTPCore)(args, context)
    core = core.to(dtype).eval()  # the buffers (fp32 RoPE tables cast with the core)
    if residual_scale != 1:
        writers = ["fc.weight", *(f"layers.{i}.{w}.weight" for i in range(len(core.layers))
                                  for w in RESIDUAL_WRITERS)]
        head = dataclasses.replace(head, tensors={k: v.float() * residual_scale if k in writers else v
                                                  for k, v in head.tensors.items()})
        for norm in stream_norms(core):
            norm.eps *= residual_scale**2
    core.load_weights(head, embed_tokens, lm_head)
    for p in core.parameters():
        p.requires_grad_(False)
    head_ranges = drafter_head_ranges(args.vocab_size, head_ranges)
    if layout == "ane":
        split_head(core, head_ranges)
    specs = function_specs(args, draft_steps, context, dtype, logits, layout, head_ranges)
    states = {s.name: torch.zeros(s.shape, dtype=dtype) for s in specs[0].states}
    functions = {s.name: (NamedFunction(core, s, states), s) for s in specs}
    contract = host_contract(args, head_ranges) if layout == "ane" else {}
    return MTPModules(core=core, functions=functions, contract=contract)


def build_reference(
    args: MTPArgs, head: HeadWeights, target_tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> MTPReference:
    """The eager reference filled with the same weights as ``build_modules``."""
    embed_tokens, lm_head = borrowed_tables(args, head, target_tensors)
    reference = MTPReference(args)
    reference.load_weights(head, embed_tokens, lm_head)
    return reference.to(dtype).eval()
