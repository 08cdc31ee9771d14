"""The drafter stage's memory arithmetic: the drafter's own tensors and linears from its shapes, its Hessians' groups,
and its host memory in each phase of the stage (``plan.Plan.drafter_phases`` adds the target and the sessions)."""

from __future__ import annotations

import math

import torch

from convert.export.quantized import HalfLinear
from convert.pipeline.drafter import BORROWED, DrafterPlan
from convert.pipeline.partition import (
    GPTQ_HESSIAN_COPIES,
    GPTQ_WEIGHT_COPIES,
    PACKAGING_BYTES_PER_LAYER_WEIGHT,
    matrix_bytes,
)

HESSIAN_GROUP_BYTES = 2 << 30
"""The drafter's Hessians held at once. At the 27B drafters' width its 47 linears' are 12.8 GB in all (five down_proj
of 17408 features, 1.2 GB each, the fc of 25600, 2.6 GB), so they are taken a group of linears at a time: 6 groups,
the fc alone."""


def own_linears(core: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The drafter's own linears (the ones it quantizes; in a weight-sharing compute copy, ``HalfLinear``s), in module
    order."""
    return [(name, module) for name, module in core.named_modules()
            if name.partition(".")[0] not in BORROWED and type(module) in (torch.nn.Linear, HalfLinear)]


def hessian_groups(core: torch.nn.Module, budget: int | None = None) -> list[list[str]]:
    """The own linears in consecutive groups whose fp32 Hessians (features squared, 4 bytes each) stay within
    ``budget`` (default ``HESSIAN_GROUP_BYTES``); a linear over it is a group alone."""
    return grouped_by_hessian([(name, module.in_features) for name, module in own_linears(core)], budget)


def grouped_by_hessian(features: list[tuple[str, int]], budget: int | None = None) -> list[list[str]]:
    """``hessian_groups`` of linears given as (name, input features), in order but the widest last: their GPTQ, the
    largest, runs once the replays are done and the fp16 weights they computed with are let go (``_replayed``)."""
    budget = HESSIAN_GROUP_BYTES if budget is None else budget
    widest = max((columns for _, columns in features), default=0)
    groups, held = [[]], 0
    for name, columns in [f for f in features if f[1] < widest] + [f for f in features if f[1] == widest]:
        size = 4 * columns**2
        if groups[-1] and held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    return [g for g in groups if g]


def own_shapes(plan: DrafterPlan) -> dict[str, tuple[int, ...]]:
    """The drafter's own tensors by canonical name, with their shapes (the tables it borrows not among them)."""
    return plan.family.own_shapes(plan.args)


def own_linear_shapes(plan: DrafterPlan) -> dict[str, tuple[int, int]]:
    """Of ``own_shapes``, the linears' weights (what the drafter quantizes), [out, in]."""
    return {name.removesuffix(".weight"): shape for name, shape in own_shapes(plan).items()
            if len(shape) == 2 and name.endswith(".weight")}


def own_phase_bytes(plan: DrafterPlan) -> dict[str, int]:
    """The drafter's own host memory in each phase of its stage (``drafter_build``), from its shapes and the recipe
    (nothing is read; the target and the sessions' states come on top, ``Plan.drafter_phases``):

    - load: its fp16 modules (measured at 2.08 bytes a parameter at 27B, ``bench/drafter_load.py``);
    - calibrate (GPTQ): those, their fp32 compute copy's other parameters (its linears share the fp16 weights), and
      the Hessians taken as the calls happen (one group) or the recorded drafter calls (``calibration_hessians``);
    - quantize: each group's GPTQ beside the fp16 weights (the replays' compute copy shares them), the codes, the
      recording and the group's Hessians; the last group's (the widest linears') beside its own fp16 weights alone
      (``_replayed``); GPTQ's own memory by ``partition.GPTQ_HESSIAN_COPIES`` and ``GPTQ_WEIGHT_COPIES``;
    - accept (and the A/B): the quantized modules (codes and fp16 other parameters), the fp16 reference loaded again
      and the two fp32 copies' other parameters;
    - package: the codes and other parameters, and the packaging's cost a weight (``PACKAGING_BYTES_PER_LAYER_WEIGHT``,
      measured on the target's 27B parts)."""
    quant = plan.config.quantization
    shapes, linears = own_shapes(plan), own_linear_shapes(plan)
    parameters = sum(math.prod(shape) for shape in shapes.values())
    linear_weights = sum(rows * columns for rows, columns in linears.values())
    others, fp16 = parameters - linear_weights, 2 * parameters
    packaging = PACKAGING_BYTES_PER_LAYER_WEIGHT * linear_weights
    if not quant.format:
        return {"load": fp16, "accept": fp16 + 4 * others, "package": fp16 + packaging}
    codes = sum(matrix_bytes(quant.format, quant.resolved_group_size, shape) for shape in linears.values())
    phases = {"load": fp16, "accept": fp16 + codes + 2 * others + 2 * 4 * others,
              "package": codes + 2 * others + packaging}
    largest = max(4 * rows * columns for rows, columns in linears.values())
    if not quant.uses_gptq:
        phases["quantize"] = fp16 + codes + 2 * largest  # round to nearest: a weight in fp32 and its codes' work
        return {phase: phases[phase] for phase in ("load", "quantize", "accept", "package")}
    calibration = quant.calibration
    recorded = recorded_bytes(plan, calibration.samples, calibration.length, calibration.tokens)
    groups = grouped_by_hessian([(name, shape[1]) for name, shape in linears.items()])
    hessians = [sum(4 * linears[name][1] ** 2 for name in group) for group in groups]
    gptq = [max(GPTQ_HESSIAN_COPIES * 4 * linears[name][1] ** 2 + GPTQ_WEIGHT_COPIES * 4 * math.prod(linears[name])
                for name in group) for group in groups]
    phases["calibrate"] = fp16 + 4 * others + (hessians[0] if len(groups) == 1 else recorded)
    # each group's GPTQ beside the fp16 weights the replays compute with and the recording, and the last group's
    # replay too; the last group's GPTQ beside its own linears' fp16 weights and the other parameters alone
    # (``_replayed`` lets the rest go)
    held = [fp16 + codes + recorded + h + g for h, g in zip(hessians[:-1], gptq[:-1], strict=True)]
    if len(groups) > 1:
        held.append(fp16 + codes + recorded + hessians[-1])
    own_last = 2 * (others + sum(math.prod(linears[name]) for name in groups[-1]))
    phases["quantize"] = max([*held, own_last + codes + hessians[-1] + gptq[-1]])
    return {phase: phases[phase] for phase in ("load", "calibrate", "quantize", "accept", "package")}


def recorded_bytes(plan: DrafterPlan, prompts: int, length: int, tokens: int) -> int:
    """At most the inputs a calibration's recording keeps (``Recording(outputs=False)``) over ``prompts`` of ``length``
    tokens and ``tokens`` generated: the prompt's context calls, then a round a token (a drafter that accepts
    nothing), each round's calls' inputs as the driver passes them (in the ane layout, not the buffers and masks the
    host adds; its position inputs are counted for the positions they replace)."""
    owned = {*plan.contract.get("buffers", {}), *plan.contract.get("ring_masks", {})}
    inputs = {spec.name: sum(t.nbytes for t in spec.inputs if t.name not in owned) for spec in plan.specs}
    return prompts * plan.family.recorded_bytes(inputs, plan.widths, length, tokens)
