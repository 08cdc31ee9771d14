"""The target part: its function specs (the shape contract) and the export modules that implement them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convert.backends.base import FunctionSpec, TensorSpec
from convert.export import ExportModules, FunctionModule
from convert.models.qwen3 import Qwen3Args, Qwen3Core
from convert.recipe import Target

STATE_NAMES = ("key_cache", "value_cache")
DTYPE_NAMES = {torch.float16: "float16", torch.float32: "float32"}


def function_specs(args: Qwen3Args, target: Target, dtype: torch.dtype = torch.float16) -> list[FunctionSpec]:
    """prefill / decode / verify: same inputs, states and outputs, each at its own static width S.

    Every function returns ``argmax_ids`` [1,S] int32 (the host reads the row of its last real
    token, so a prompt's final chunk may be right-padded); ``taps``, ``hidden`` and ``logits`` are optional.
    """
    fdtype = DTYPE_NAMES[dtype]
    cache = (args.num_hidden_layers, args.num_key_value_heads, target.context, args.head_dim)
    states = tuple(TensorSpec(name, cache, fdtype) for name in STATE_NAMES)
    specs = []
    for name, width in (("prefill", target.graphs.prefill), ("decode", 1), ("verify", target.graphs.verify)):
        outputs = [TensorSpec("argmax_ids", (1, width), "int32")]
        if target.taps:
            outputs.append(TensorSpec("taps", (1, width, len(target.taps) * args.hidden_size), fdtype))
        if target.hidden:
            outputs.append(TensorSpec("hidden", (1, width, args.hidden_size), fdtype))
        if target.logits:
            outputs.append(TensorSpec("logits", (1, width, args.vocab_size), fdtype))
        inputs = (TensorSpec("input_ids", (1, width), "int32"), TensorSpec("position_ids", (1, width), "int32"))
        specs.append(FunctionSpec(name=name, inputs=inputs, outputs=tuple(outputs), states=states))
    return specs


@dataclass
class TargetModules(ExportModules):
    core: Qwen3Core

    def call(self, name: str, input_ids, position_ids) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states; returns every core output, logits included
        (the checks and gates read logits even when the shipped function does not return them)."""
        module, spec = self.functions[name]
        ids = torch.as_tensor(input_ids, dtype=torch.int32).reshape(1, -1)
        pos = torch.as_tensor(position_ids, dtype=torch.int32).reshape(1, -1)
        if ids.shape != spec.inputs[0].shape:
            raise ValueError(f"{name} takes input_ids of shape {list(spec.inputs[0].shape)}, got {list(ids.shape)}")
        with torch.no_grad():
            return module.core(ids, pos, *(getattr(module, s.name) for s in spec.states))


def build_modules(
    args: Qwen3Args, target: Target, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> TargetModules:
    """Export modules filled with ``tensors`` in ``dtype``, sharing one core and one pair of KV states."""
    core = Qwen3Core(args, target.context, tuple(target.taps or ())).to(dtype).eval()
    core.load_weights(tensors)
    for p in core.parameters():
        p.requires_grad_(False)
    specs = function_specs(args, target, dtype)
    states = {s.name: torch.zeros(s.shape, dtype=dtype) for s in specs[0].states}
    functions = {s.name: (FunctionModule(core, s, states), s) for s in specs}
    return TargetModules(core=core, functions=functions)
