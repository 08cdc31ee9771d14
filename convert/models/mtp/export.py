"""MTP head: the functions' specs (accept, draft_step), the export modules over one core and the reference filled
with the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert.errors import InputError
from convert.export.functions import ExportModules, FunctionModule, parameters_on_meta
from convert.export.spec import DTYPE_NAMES, FunctionSpec, TensorSpec
from convert.models.mtp.checkpoint import HeadWeights, borrowed_tables
from convert.models.mtp.config import DRAFT_STEPS, STATE_NAMES, MTPArgs
from convert.models.mtp.core import MTPCore
from convert.models.mtp.reference import MTPReference


def function_specs(
    args: MTPArgs,
    draft_steps: int = DRAFT_STEPS,
    context: int = 2048,
    dtype: torch.dtype = torch.float16,
    logits: bool = False,
) -> list[FunctionSpec]:
    """``accept`` (S = draft_steps + 1) and ``draft_step`` (S = 1): same inputs, outputs and states."""
    if draft_steps < 1:
        raise InputError(f"draft steps must be at least 1, got {draft_steps}")
    fdtype = DTYPE_NAMES[dtype]
    cache = (args.mtp_layers, args.num_key_value_heads, context, args.head_dim)
    states = tuple(TensorSpec(name, cache, fdtype) for name in STATE_NAMES)
    specs = []
    for name, width in (("accept", draft_steps + 1), ("draft_step", 1)):
        inputs = (
            TensorSpec("input_ids", (1, width), "int32"),
            TensorSpec("hidden", (1, width, args.hidden_size), fdtype),
            TensorSpec("position_ids", (1, width), "int32"),
        )
        outputs = [
            TensorSpec("draft_ids", (1, width), "int32"),
            TensorSpec("hidden_out", (1, width, args.hidden_size), fdtype),
        ]
        if logits:
            outputs.append(TensorSpec("logits", (1, width, args.vocab_size), fdtype))
        specs.append(FunctionSpec(name=name, inputs=inputs, outputs=tuple(outputs), states=states))
    return specs


@dataclass
class MTPModules(ExportModules):
    core: MTPCore

    def call(self, name: str, input_ids, hidden, position_ids) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states; returns every core output, logits included."""
        module, spec = self.functions[name]
        dtype = self.core.compute_dtype
        ids = torch.as_tensor(input_ids, dtype=torch.int32).reshape(1, -1)
        hid = torch.as_tensor(hidden).to(dtype).reshape(1, -1, self.core.args.hidden_size)
        pos = torch.as_tensor(position_ids, dtype=torch.int32).reshape(1, -1)
        if ids.shape != spec.inputs[0].shape or hid.shape != spec.inputs[1].shape or pos.shape != ids.shape:
            raise ValueError(
                f"{name} takes input_ids/position_ids {list(spec.inputs[0].shape)} and hidden "
                f"{list(spec.inputs[1].shape)}, got {list(ids.shape)}, {list(pos.shape)}, {list(hid.shape)}"
            )
        with torch.no_grad():
            return module.core(ids, hid, pos, *(getattr(module, s.name) for s in spec.states))


def build_modules(
    args: MTPArgs,
    head: HeadWeights,
    target_tensors: dict[str, torch.Tensor],
    context: int,
    draft_steps: int = DRAFT_STEPS,
    dtype: torch.dtype = torch.float16,
    logits: bool = False,
) -> MTPModules:
    """Export modules in ``dtype`` over one core (the head's weights and the borrowed target tables, once) and one
    pair of KV states; ``target_tensors`` needs the target's ``model.embed_tokens.weight`` and ``lm_head.weight``."""
    embed_tokens, lm_head = borrowed_tables(args, head, target_tensors)
    with parameters_on_meta():  # filled by load_weights in dtype: no core made in fp32 first
        core = MTPCore(args, context)
    core = core.to(dtype).eval()  # the buffers (fp32 RoPE tables cast with the core)
    core.load_weights(head, embed_tokens, lm_head)
    for p in core.parameters():
        p.requires_grad_(False)
    specs = function_specs(args, draft_steps, context, dtype, logits)
    states = {s.name: torch.zeros(s.shape, dtype=dtype) for s in specs[0].states}
    functions = {s.name: (FunctionModule(core, s, states), s) for s in specs}
    return MTPModules(core=core, functions=functions)


def build_reference(
    args: MTPArgs, head: HeadWeights, target_tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> MTPReference:
    """The eager reference filled with the same weights as ``build_modules``."""
    embed_tokens, lm_head = borrowed_tables(args, head, target_tensors)
    reference = MTPReference(args)
    reference.load_weights(head, embed_tokens, lm_head)
    return reference.to(dtype).eval()
