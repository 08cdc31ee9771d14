"""The target part: its function specs (the shape contract) and the export modules that implement them, for any
architecture family of ``convert/models``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from convert.export.functions import ExportModules
from convert.export.names import INPUT_IDS, POSITION_IDS
from convert.export.spec import TORCH_DTYPES, FunctionSpec
from convert.inputs.recipe import Target
from convert.models import family_of
from convert.models.layout import Layout
from convert.weights import precision, rescale
from convert.weights.stream import checkpoint_key


def function_specs(args, target: Target, dtype: torch.dtype = torch.float16) -> list[FunctionSpec]:
    """prefill / decode / verify of ``args``' family, each at its own static width S (``convert/models``)."""
    return family_of(args).function_specs(args, target, dtype)


@dataclass
class TargetModules(ExportModules):
    core: nn.Module
    contract: dict  # the family's host contract (manifests.schema.HostContract): how a runtime drives the functions

    def call(self, name: str, input_ids=None, position_ids=None, **extra) -> dict[str, torch.Tensor]:
        """Run function ``name`` in torch on the shared states (``call_with``). ``extra``: the function's other
        inputs by name (a hybrid target's ``accept`` and ``valid``, a part's ``hidden_states``)."""
        given = {k: v for k, v in ((INPUT_IDS, input_ids), (POSITION_IDS, position_ids)) if v is not None}
        return self.call_with(name, {**given, **extra})


def build_modules(args, target: Target, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                  layout: Layout | None = None, scales: rescale.Scales | None = None) -> TargetModules:
    """Export modules filled with ``tensors`` in ``dtype``, sharing one core and one set of states. ``layout``: how
    the checkpoint stores the model (``sanitize``'s result; checked here when not given). ``scales``: the range
    scales folded in (``convert/weights/rescale.py``: each weight multiplied in fp32 before the cast). The parameters
    ``precision.kept_fp32_names`` names stay fp32 (an exact pack's norms and decay gate)."""
    family = family_of(args)
    if layout is None:
        layout = family.sanitize({k: tuple(v.shape) for k, v in tensors.items()}, args)
    core = family.build_core(args, target).to(dtype).eval()
    precision.keep_fp32(core, target)
    if scales is not None and not scales.identity:
        factors = rescale.weight_factors(core, scales)
        keys = {layout.stored(checkpoint_key(core, name)): factor for name, factor in factors.items()}
        tensors = {k: v.float() * keys[k] if k in keys else v for k, v in tensors.items()}
        rescale.fold_constants(core, scales)
    core.load_weights(tensors, layout)
    for p in core.parameters():
        p.requires_grad_(False)
    return modules_over(core, args, target, dtype)


def modules_over(core: nn.Module, args, target: Target, dtype: torch.dtype, part=None) -> TargetModules:
    """The function modules of the whole target (or of ``part``, ``convert/pipeline/partition.py``) over ``core``,
    sharing one set of fresh states."""
    family = family_of(args)
    precision.record(core, target)  # a part's core (``shipped.part_modules``) shares the whole core's kept tensors
    specs = family.function_specs(args, target, dtype, part)
    states = {s.name: torch.zeros(s.shape, dtype=TORCH_DTYPES[s.dtype]) for s in specs[0].states}
    functions = {s.name: (family.FunctionModule(core, s, states), s) for s in specs}
    return TargetModules(core=core, functions=functions, contract=family.host_contract(args, target))
