"""The drafter part of a build: plan, modules with the target's shipped tables, quantize, accept, manifest.

A drafter is only useful with the exact target build it was made for, so every stage takes the target's
shipped modules: the drafter's borrowed ``lm_head`` (and an MTP head's embedding table) are the target's
tensors exactly as the target package computes with them, quantized the same way when the target's are
(the same codes and tables, so both packages store the same bytes), and the mask row of a DFlash2 drafter is
the target's shipped embedding row. The drafter's manifest binds it to that target by hash
(``manifests.schema.TargetBinding``); ``manifests.identity.pair_mismatches`` checks the binding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from convert import cache as build_cache
from convert import progress
from convert.errors import GateError, InputError
from convert.export.ane import logits_ranges
from convert.export.functions import compute_copy
from convert.export.lockstep import over_sessions
from convert.export.quantized import (
    CodesLinear,
    HalfLinear,
    QuantizedLinear,
    RowParts,
    apply_quantized,
    embedding_rows,
    table_shape,
)
from convert.export.spec import FunctionSpec
from convert.fp16 import Peaks, device_arithmetic
from convert.inputs import contract
from convert.inputs.recipe import Drafter, DrafterQuantization, Recipe
from convert.inputs.sources import Snapshot, check_safetensors, resolve, tensor_shapes
from convert.inputs.thresholds import NEAR_TIE_LOGITS
from convert.models import dflash2, mtp
from convert.models.dflash2.config import expected_shapes as dflash2_shapes
from convert.models.mtp.config import canonical_shapes as mtp_shapes
from convert.pipeline.partition import (
    GPTQ_HESSIAN_COPIES,
    GPTQ_WEIGHT_COPIES,
    PACKAGING_BYTES_PER_LAYER_WEIGHT,
    matrix_bytes,
    row_align,
)
from convert.progress import console
from convert.runtime import speculative
from convert.runtime.economics import MeteredFunctions, cost_model
from convert.runtime.host import DeviceFunctions, ModuleFunctions, TargetDriver, module_driver
from convert.verify.checks import like_the_runtime
from convert.verify.gates import DEVICE_OF_LAYOUT, RangeReport
from convert.weights import rescale
from convert.weights.quantize import read_entry, round_to_nearest, summary, write_entry
from convert.weights.target import TargetModules
from manifests.schema import Rescale
from quant.gptq import HessianAccumulator, gptq_quantize
from quant.types import QuantizedWeight

T = TypeVar("T")
JOURNAL_STAGE = "prompt-runs"  # the build cache's stage of ``PromptJournal`` entries
MAX_SESSIONS = 8
"""Prompts the drafter stage runs at once at most (``over_prompts``; the plan takes fewer when memory is short): each
block of a weight is made once for all of them, and past a few sessions their products are most of the work."""
MTP_HIDDEN_CONVENTION = "target final-norm output at position t (what its lm_head reads), vLLM's convention"
BORROWED = ("lm_head", "embed_tokens")  # the target's tables inside a drafter core: never quantized on their own


@dataclass
class DrafterPlan:
    config: Drafter
    snapshot: Snapshot
    args: dflash2.DFlash2Args | mtp.MTPArgs
    checkpoint_layout: str  # its tensors' layout (a DFlash2 architecture, an MTP head's keys), not the graphs'
    specs: list[FunctionSpec]
    head_ranges: list[tuple[int, int]] | None = None  # the ane layout's logits outputs' vocabulary rows

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def widths(self) -> dict[str, int]:
        return {s.name: s.width for s in self.specs}

    @property
    def contract(self) -> dict:
        """The drafter's host contract (``manifests.schema.HostContract``; empty in the stateful layout)."""
        return drafter_contract(self.kind, self.args, self.config, self.head_ranges)


def drafter_contract(kind: str, args, config: Drafter, head_ranges: list[tuple[int, int]] | None) -> dict:
    """The host contract of a ``kind`` drafter with ``args`` in the recipe's layout (empty in the stateful one: the
    package keeps its states and the caller passes ids and positions), its logits in ``head_ranges``."""
    if config.layout != "ane":
        return {}
    return dflash2.host_contract(args, config.ring, head_ranges) if kind == "dflash2" else \
        mtp.host_contract(args, head_ranges)


def head_ranges(recipe: Recipe, vocab: int) -> list[tuple[int, int]] | None:
    """The vocabulary rows of an ane drafter's logits outputs (``export.ane.logits_ranges``: within the ANE's largest
    dim), on whole lut4 tables of the target's head (the drafter computes with it); None in the stateful layout."""
    return logits_ranges(vocab, row_align(recipe.target.quantization)) if recipe.drafter.layout == "ane" else None


def stage_positions(recipe: Recipe) -> int:
    """The most positions a drafter-stage run reaches (at most the target's context): the longest prompt and its
    generated tokens (acceptance, and GPTQ's calibration; the package check's run is shorter) and the last round's
    verify, which can end a verify past the tokens asked for."""
    config = recipe.drafter
    runs = [config.accept, *([config.quantization.calibration] if config.quantization.uses_gptq else [])]
    return min(recipe.target.context, max(run.length + run.tokens for run in runs) + 2 * recipe.target.graphs.verify)


def stage_target(recipe: Recipe):
    """The target the drafter stage runs its prompts on (``drafter_build.stage_copy``): the recipe's at context
    ``stage_positions`` with no ladder, so that each session's states (the ane layout: the host's buffers) hold the
    rows the stage reaches, not the package's whole context (65,472 rows at 27B where the prompts reach 144)."""
    return recipe.target.model_copy(update={"context": stage_positions(recipe), "ladder": []})


def plan_drafter(recipe: Recipe, recipe_path: Path, target_snapshot: Snapshot, target,
                 dtype: torch.dtype) -> DrafterPlan:
    """Validate the drafter's config and tensor headers against the target (its architecture family's args);
    reads no weights."""
    config = recipe.drafter
    where = recipe_path
    if config.source is None and config.kind != "mtp":
        raise InputError(f"{where}: drafter.source: required for a {config.kind} drafter")
    snapshot = resolve(config.source, recipe_path.resolve().parent, "drafter.source") if config.source \
        else target_snapshot
    config_path = snapshot.directory / "config.json"
    contract.check(snapshot.config(), config.contract, str(config_path), "drafter.contract")
    verify = recipe.target.graphs.verify
    ranges = head_ranges(recipe, target.vocab_size)  # the drafter's vocabulary is the target's (checked below)
    if config.kind == "dflash2":
        args = dflash2.DFlash2Args.from_config(snapshot.config(), str(config_path))
        files = dflash2.checkpoint_files(snapshot.directory)
        dflash2.sanitize({f.name: check_safetensors(f) for f in files}, args)
        checkpoint_layout = args.architecture
        taps = list(recipe.target.taps or [])
        if taps != list(args.target_layer_ids):
            raise InputError(
                f"{where}: target.taps {taps or None} must equal the drafter's dflash_config.target_layer_ids "
                f"{list(args.target_layer_ids)} ({config_path}), in that order"
            )
        if verify > args.block_size:
            raise InputError(f"{where}: target.graphs.verify {verify} exceeds the drafter's block_size "
                             f"{args.block_size} ({config_path})")
        specs = dflash2.function_specs(args, config.context_update, config.context_append, config.ring, dtype,
                                       draft_width=verify, layout=config.layout, head_ranges=ranges)
    else:
        args = mtp.MTPArgs.from_config(snapshot.config(), str(config_path))
        checkpoint_layout = mtp.sanitize(tensor_shapes(snapshot.directory), args, f"checkpoint {snapshot.directory}")
        if not recipe.target.hidden:
            raise InputError(f"{where}: target.hidden: an MTP drafter reads the target's final-norm hidden states; "
                             "set target.hidden: true")
        specs = mtp.function_specs(args, verify - 1, recipe.target.context, dtype, layout=config.layout,
                                   head_ranges=ranges)
    for field, mine, theirs in (("hidden_size", args.hidden_size, target.hidden_size),
                                ("vocab_size", args.vocab_size, target.vocab_size)):
        if mine != theirs:
            raise InputError(f"{config_path}: {field} {mine} differs from the target's {theirs}: not its drafter")
    return DrafterPlan(config=config, snapshot=snapshot, args=args, checkpoint_layout=checkpoint_layout, specs=specs,
                       head_ranges=ranges)


def build_modules(plan: DrafterPlan, recipe: Recipe, target: TargetModules, dtype: torch.dtype,
                  own_scale: float = 1.0):
    """Drafter export modules in ``dtype`` holding the target's shipped tables (quantized as the target's), the range
    scales folded (``convert/weights/rescale.py``): a DFlash2 drafter's residual stream takes its target's (it starts
    from the target's embedding rows and reads its taps) times ``own_scale``; an MTP head's (which starts from its fc
    over normed rows) takes ``own_scale`` alone (``range_scale``)."""
    core = target.core
    lm_head, table = _head_weight(core.lm_head), anchor_table(target)
    config, verify = plan.config, recipe.target.graphs.verify
    if plan.kind == "dflash2":
        _, tensors = dflash2.load_checkpoint(plan.snapshot.directory)
        modules = dflash2.build_modules(
            plan.args, tensors, lm_head, torch.from_numpy(table[plan.args.mask_token_id]), dtype,
            max_positions=recipe.target.context,
            ring_rows=config.ring, update_width=config.context_update, append_width=config.context_append,
            mask_scale=config.mask_scale, draft_width=verify, layout=config.layout, head_ranges=plan.head_ranges,
            residual_scale=core.residual_scale * own_scale, taps_scale=core.residual_scale)
    else:
        head = mtp.load_head(plan.snapshot.directory, plan.args)
        tables = {"model.embed_tokens.weight": torch.from_numpy(np.asarray(table)), "lm_head.weight": lm_head}
        modules = mtp.build_modules(plan.args, head, tables, recipe.target.context, verify - 1, dtype,
                                    layout=config.layout, head_ranges=plan.head_ranges, residual_scale=own_scale)
    borrowed = {name: getattr(core, name).quantized_weight() for name in BORROWED
                if isinstance(getattr(core, name), QuantizedLinear) and hasattr(modules.core, name)}
    if borrowed:
        apply_quantized(modules.core, borrowed)
    for name in BORROWED:  # a lean target's tables: the same modules (``packaged_from_codes`` before packaging)
        if isinstance(getattr(core, name), CodesLinear) and hasattr(modules.core, name):
            mine = getattr(modules.core, name)  # an ane head in row parts takes views of the target's rows
            theirs = getattr(core, name)
            setattr(modules.core, name, RowParts.split(theirs, mine.ranges) if isinstance(mine, RowParts) else theirs)
    return modules


def range_scale(plan, target: TargetModules, target32: TargetModules, modules, prompt: list[int],
                tokens: int) -> tuple[float, Rescale]:
    """The drafter's own range scale (a power of two; ``convert/weights/rescale.py``, ``drafter_classes``) and its
    record: ``modules`` (fp16, as ``build_modules`` made them) computed in fp32 over speculative decoding of ``prompt``
    with the fp32 ``target32``, every product and layer watched, against the limits of the device the drafter's layout
    targets. Raises ``RangeError`` where no scale reaches a tensor past its limit (its lm_head's logits, say)."""
    kind, device = plan.drafter.kind, DEVICE_OF_LAYOUT[plan.drafter.config.layout]
    drafter32 = compute_copy(modules, torch.float32, share_weights=True)
    peaks = Peaks(drafter=drafter32.core)
    with torch.no_grad(), device_arithmetic(None, peaks):
        speculative.speculate(kind, *drivers(kind, target32, drafter32, anchor_table(target)), prompt, tokens)
    scales, entries = rescale.choose(peaks, device, rescale.drafter_classes(drafter32.core, "drafter"), "drafter")
    for line in rescale.lines(scales, entries, device, f"{kind} drafter's residual stream"):
        console.print(line)
    own = scales.residual_scale
    stream = own * (target.core.residual_scale if kind == "dflash2" else 1.0)  # a DFlash2 stream starts scaled
    return own, Rescale.model_validate({**rescale.record(scales, entries, device, 1), "residual_scale": stream})


def _head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The target head's weight to build a drafter with: a placeholder of its shape (one zero, expanded) when the head
    is a ``CodesLinear``, which the drafter then shares (``build_modules``)."""
    if isinstance(head, CodesLinear):
        return torch.zeros((), dtype=torch.float16).expand(head.shape)
    return head.weight.detach()


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
    return dflash2_shapes(plan.args) if plan.kind == "dflash2" else mtp_shapes(plan.args)


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
    if plan.kind == "dflash2":
        prompt = -(-length // plan.widths["context_update"]) * inputs["context_update"]
        round_ = inputs["context_append"] + inputs["draft"]
    else:
        prompt = -(-length // plan.widths["accept"]) * inputs["accept"]
        round_ = inputs["accept"] + (plan.widths["accept"] - 2) * inputs["draft_step"]
    return prompts * (prompt + tokens * round_)


def calibration_hessians(kind: str, target_modules, drafter_modules, prompts: list[list[int]], tokens: int,
                         embeddings: np.ndarray, sessions: int = 1,
                         journal: PromptJournal | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Input Hessians of the drafter's own linears over speculative decoding of ``prompts``, a group of linears at a
    time (``hessian_groups``): the drafter sees exactly what it sees deployed (context rows from the target's taps or
    hidden states, draft blocks, accepted rows). A chunk's padding rows repeat its last row and count again.

    The speculative run (the target's calls) happens once, in this call, over ``sessions`` prompts at a time
    (``over_prompts``). With one group, run one prompt at a time, it takes the Hessians as the calls happen;
    otherwise the drafter's calls are recorded, prompt by prompt, and every group's Hessians are taken by replaying
    them in prompt order, from reset states, through the drafter alone: the same calls on the same inputs in the same
    order, so the same Hessians bit for bit, however many sessions ran them. (No group's Hessians are held beside the
    target while it runs: at 27B a group is up to 2 GiB, and the target's 7.5 GB and the sessions' states are held
    then.) Yields {linear name: Hessian} per group; a linear that saw no input is left out. ``journal``: the
    recordings are kept there prompt by prompt (``over_prompts``; not where the Hessians are taken live)."""
    groups = hessian_groups(drafter_modules.core)
    # hooks see the calls as they happen only when one session makes them
    live = min(sessions, len(prompts)) <= 1 and len(groups) == 1

    def run(target, drafter, index: int) -> list | None:
        recording = None if live else Recording(ModuleFunctions(drafter), outputs=False)
        drives = drivers(kind, target, drafter, embeddings,
                         None if recording is None else (ModuleFunctions(target), recording))
        speculative.speculate(kind, *drives, prompts[index], tokens)
        return None if recording is None else recording.calls

    if not live:
        recordings = over_prompts(run, len(prompts), sessions, target_modules, drafter_modules, journal)
        return _replayed(groups, drafter_modules, recordings)
    with _accumulating(drafter_modules.core, groups[0]) as accumulators:
        over_prompts(run, len(prompts), 1, target_modules, drafter_modules)
    return iter([_hessians(accumulators)])  # nothing to replay: the drafter's modules are not held on


def _replayed(groups: list[list[str]], drafter_modules, recordings: list[list]) -> Iterator[dict]:
    """Each group's Hessians by replaying ``recordings`` through ``drafter_modules``. Before the last group's are
    handed on, the compute copy and the recordings are let go: the last group's GPTQ (the widest linear's:
    ``grouped_by_hessian``) runs without the fp16 weights of the linears quantized before it."""
    for index, group in enumerate(groups):
        with _accumulating(drafter_modules.core, group) as accumulators:
            _replay(drafter_modules, recordings)
        hessians = _hessians(accumulators)
        if index == len(groups) - 1:
            del drafter_modules, recordings
        yield hessians


def _replay(drafter_modules, recordings: list[list]) -> None:
    """The recorded drafter calls (each prompt's ``Recording.calls``), in order, through ``drafter_modules`` as the
    driver called them (a recording's resets included; through the host's buffers where the modules' contract has
    them)."""
    functions = ModuleFunctions(drafter_modules)
    for calls in recordings:
        for function, inputs, _ in calls:
            if function == "reset":
                functions.reset()
            else:
                functions.call(function, inputs)


class PromptJournal:
    """Each prompt's result of one phase of the drafter stage, kept in the build cache as soon as it is computed
    (``over_prompts``), so that a build killed, or stopped at the end of a working session, runs again only the
    prompts it had not finished: at 27B on two cores a phase runs for hours. ``key``: the sha256 of everything the
    phase's results are computed from (``drafter_build.PhaseKeys``); entries are stage ``JOURNAL_STAGE``, one per
    prompt. A result is what the phase's run returns (ids, rounds, numpy arrays: ``BuildCache.put_object``)."""

    def __init__(self, cache, key: str):
        self.cache, self.key = cache, key

    def _key(self, index: int) -> str:
        return build_cache.key({"phase": self.key, "prompt": index})

    def get(self, index: int):
        return self.cache.get_object(JOURNAL_STAGE, self._key(index))

    def put(self, index: int, result) -> None:
        self.cache.put_object(JOURNAL_STAGE, self._key(index), result, {"prompt": index})


def over_prompts(run: Callable[[object, object, int], T], prompts: int, sessions: int, target_modules,
                 drafter_modules=None, journal: PromptJournal | None = None) -> list[T]:
    """``run(target, drafter, index)`` for every prompt index, in prompt order of results, over ``sessions`` prompts at
    a time: each session its own states over the shared modules (``ExportModules.session``; the first session the
    modules themselves), taking the next prompt when it is done with one, all run in step (``export.lockstep.in_step``:
    a weight's block made once for every session, each session's outputs those it computes alone). Each prompt's run
    starts from reset states, so which session runs it changes nothing. With a ``journal``, the prompts it holds are
    not run again and each prompt run is put there as soon as it is done."""
    results: list = [None] * prompts if journal is None else [journal.get(i) for i in range(prompts)]
    todo = [i for i in range(prompts) if results[i] is None]
    if len(todo) < prompts:
        console.print(f"  {prompts - len(todo)} of {prompts} prompts restored from the build cache"
                      + (f"; running {len(todo)}" if todo else ""))

    advance = progress.units(len(todo), "prompts")

    def finished(index: int, result) -> None:
        results[index] = result
        if journal is not None:
            journal.put(index, result)
        advance()

    count = max(1, min(sessions, len(todo)))
    pairs = [(target_modules, drafter_modules)] + [
        (target_modules.session(), None if drafter_modules is None else drafter_modules.session())
        for _ in range(count - 1)]
    over_sessions(len(todo), pairs, lambda pair, k: finished(todo[k], run(*pair, todo[k])))
    return results


def _hessians(accumulators: dict[str, HessianAccumulator]) -> dict[str, torch.Tensor]:
    """The Hessians of ``accumulators`` (emptied as it goes: one sum and one Hessian of a linear held at a time)."""
    return {name: accumulators.pop(name).hessian() for name in list(accumulators) if accumulators[name].count}


@contextmanager
def _accumulating(core: torch.nn.Module, names: list[str]) -> Iterator[dict[str, HessianAccumulator]]:
    """Forward hooks feeding each named linear's inputs into its ``HessianAccumulator`` while the block runs."""
    modules = dict(core.named_modules())
    accumulators, hooks = {}, []
    for name in names:
        accumulators[name] = HessianAccumulator(modules[name].in_features)
        hooks.append(modules[name].register_forward_hook(
            lambda _m, inputs, _out, acc=accumulators[name]: acc.add(inputs[0])))
    try:
        yield accumulators
    finally:
        for hook in hooks:
            hook.remove()


def quantize(modules, quant: DrafterQuantization, hessians: Iterable[dict[str, torch.Tensor]] | None = None,
             keep: Callable[[str, QuantizedWeight], None] | None = None) -> dict:
    """4-bit of the drafter's own linears (round to nearest, or GPTQ under ``hessians``: groups of {name: Hessian},
    as ``calibration_hessians`` yields them, each dropped once its linears are quantized); the borrowed tables stay
    as the target ships them. Each linear becomes a ``CodesLinear`` as soon as it is quantized (its codes packed, the
    weight computed at each call: at the 27B drafters' size 0.5 bytes a weight, where the unpacked codes of every
    linear held until the end were 1 and a dense copy beside them 2 more), until
    ``export.quantized.packaged_from_codes`` makes them the layers a package is made from. Returns the manifest's
    quantization record. ``keep(name, weights)``: called with each linear's result as it is quantized
    (``store_quantized``)."""
    method, group = quant.format, quant.resolved_group_size
    linears = dict(own_linears(modules.core))
    own = [p for n, p in modules.core.named_parameters() if not n.startswith(BORROWED)]

    def quantized() -> Iterator[tuple[str, QuantizedWeight]]:
        for taken in ({name: None for name in linears},) if hessians is None else hessians:
            for name in list(taken):
                weight, hessian = linears.pop(name).weight.detach().float(), taken.pop(name)
                result = (round_to_nearest(method, weight, group) if hessian is None
                          else gptq_quantize(weight, hessian, method, group, name=name))
                apply_quantized(modules.core, {name: result}, codes_only=True)
                if keep is not None:
                    keep(name, result)
                yield name, result

    bits_per_weight, layers = summary(quantized(), own)  # one linear's unpacked codes held at a time
    if linears:
        raise InputError(f"drafter.quantization.calibration: linear {next(iter(linears))} saw no calibration input")
    return {"method": quant.method, "group_size": group, "bits_per_weight": bits_per_weight, "layers": layers}


def store_quantized(modules, quant: DrafterQuantization, hessians, directory: Path) -> dict:
    """``quantize``, each linear's codes written into ``directory`` (a build cache entry's) as soon as it is
    quantized: a build killed in GPTQ leaves no entry. Returns the entry's metadata, which ``restore_quantized``
    reads back."""
    linears = {}

    def keep(name: str, weights: QuantizedWeight) -> None:
        (directory / name).mkdir()
        linears[name] = write_entry(directory / name, {name: weights})

    return {"record": quantize(modules, quant, hessians, keep), "linears": linears}


def restore_quantized(modules, entry) -> dict:
    """The drafter's linears as ``store_quantized`` left them, from its build cache ``entry``; returns its
    quantization record."""
    for name, meta in entry.meta["linears"].items():
        weights = read_entry(build_cache.Entry(entry.path(name), meta))
        apply_quantized(modules.core, weights, codes_only=True)
        del weights
    return entry.meta["record"]


def anchor_table(target_modules) -> np.ndarray | AnchorRows:
    """The target's embedding rows as its lookups return them (fp16, ``export.quantized.embedding_rows``), which the
    host reads anchor rows from: a view of the module's tensor (no copy: at 27B it is 2.5 GB), or for a table whose
    stored rows are not those (an exact pack's, in the rotated basis) or that is held as codes (a lean target), an
    ``AnchorRows`` computing each row when read."""
    embedding = target_modules.core.embed_tokens
    if isinstance(embedding, CodesLinear) or getattr(embedding, "rotation", None) is not None:
        return AnchorRows(embedding)
    return embedding.weight.detach().numpy()


class AnchorRows:
    """An embedding's rows as its lookups return them, each computed when read (``table[token]``: one row,
    ``export.quantized.embedding_rows``), the whole table only through ``np.asarray`` (an MTP head's own copy)."""

    def __init__(self, embedding: torch.nn.Module):
        self.embedding = embedding
        self.shape = table_shape(embedding)

    def __getitem__(self, token) -> np.ndarray:
        token = int(token)
        if not 0 <= token < self.shape[0]:
            raise IndexError(f"token id {token} is outside the embedding's {self.shape[0]} rows")
        return embedding_rows(self.embedding, token, token + 1)[0].numpy()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = embedding_rows(self.embedding).numpy()
        return rows if dtype is None else rows.astype(dtype)


def drivers(kind: str, target_modules, drafter_modules, embeddings: np.ndarray, functions=None):
    """The target's driver and the drafter's (``kind`` dflash2, mtp or ngram: prompt lookup, no modules), on
    ``functions`` (target's, drafter's) when given, else on the modules themselves."""
    target_functions, drafter_functions = functions or (
        ModuleFunctions(target_modules), None if drafter_modules is None else ModuleFunctions(drafter_modules))
    target = TargetDriver(target_functions, target_modules.widths, target_modules.contract)
    if kind == "dflash2":
        return target, speculative.DFlash2Driver(drafter_functions, drafter_modules.widths, embeddings)
    if kind == "mtp":
        return target, speculative.MTPDriver(drafter_functions, drafter_modules.widths)
    return target, speculative.NGramDrafter()


def greedy_references(target_modules, prompts: list[list[int]], tokens: int, sessions: int = 1,
                      journal: PromptJournal | None = None) -> list[tuple[list[int], list]]:
    """Plain greedy decoding of each prompt (ids and the logits each was chosen from): the lossless reference;
    ``sessions`` prompts at a time (``over_prompts``, with its ``journal``)."""
    return over_prompts(lambda target, _, i: module_driver(target).greedy(prompts[i], tokens), len(prompts), sessions,
                        target_modules, journal=journal)


def accept(kind: str, target_modules, drafter_modules, prompts: list[list[int]], tokens: int,
           embeddings: np.ndarray, references: list, functions: tuple | None = None,
           sessions: int = 1, journal: PromptJournal | None = None) -> tuple[dict, list[speculative.PromptRun]]:
    """Speculative decoding over ``prompts`` and the lossless check against ``references`` (plain greedy of
    the same target: ``greedy_references`` of these prompts); on ``functions`` (see ``drivers``) when given, else on
    the modules, ``sessions`` prompts at a time (``over_prompts``, with its ``journal``)."""
    def run(target, drafter, index: int):
        return speculative.speculate(kind, *drivers(kind, target, drafter, embeddings, functions), prompts[index],
                                     tokens)

    results = over_prompts(run, len(prompts), 1 if functions else sessions, target_modules, drafter_modules, journal)
    runs = []
    for (run_, spec_logits), (greedy_ids, greedy_logits) in zip(results, references, strict=True):
        speculative.check_lossless(run_, greedy_ids, spec_logits, greedy_logits, NEAR_TIE_LOGITS)
        runs.append(run_)
    width = target_modules.widths["verify"]
    stats = speculative.ngram_stats(runs, width) if kind == "ngram" else speculative.acceptance_stats(runs, width)
    return stats, runs


def economics(kind: str, target_modules, target32, drafter_modules, drafter32, prompt: list[int], tokens: int,
              embeddings: np.ndarray, tokens_per_round: float) -> dict:
    """Bytes read per call and the cost model (``convert.runtime.economics``) over one metered speculative run of
    ``prompt`` (the fp32 compute copies run, elements priced as the shipped modules store them) and a decode
    call of the target."""
    log: list = []
    functions = (MeteredFunctions(target32, target_modules, "target", log),
                 MeteredFunctions(drafter32, drafter_modules, "drafter", log))
    target, drafter = drivers(kind, target32, drafter32, embeddings, functions)
    speculative.speculate(kind, target, drafter, prompt, tokens)
    target.greedy(prompt, 2)  # prefill, then one decode call: the unit of cost
    return cost_model(log, tokens_per_round)


def device_acceptance(plan, target: TargetModules, modules, prompts: list[list[int]],
                      tokens: int) -> tuple[dict, list[speculative.PromptRun], RangeReport]:
    """The pair as the devices compute it: the shipped fp16 target in the arithmetic of its layout's device and the
    fp16 drafter in its layout's (``convert.fp16``, call by call: ``DeviceFunctions``), over speculative decoding of
    ``prompts`` for ``tokens`` ids each, checked against the target's own plain greedy decoding in that arithmetic
    (``accept``'s stats and runs), every product's input and port and every module's output of the drafter watched
    (its ``RangeReport``)."""
    target16 = compute_copy(target, torch.float16, share_weights=True)
    drafter16 = compute_copy(modules, torch.float16, share_weights=True)
    device = DEVICE_OF_LAYOUT[plan.drafter.config.layout]
    peaks = Peaks(only=torch.float16, drafter=drafter16.core)
    functions = (DeviceFunctions(ModuleFunctions(target16), DEVICE_OF_LAYOUT[plan.recipe.target.layout]),
                 DeviceFunctions(ModuleFunctions(drafter16), device, peaks))
    driver = TargetDriver(functions[0], target16.widths, target16.contract)
    references = []
    for prompt in prompts:
        functions[0].reset()
        references.append(driver.greedy(prompt, tokens))
    stats, runs = accept(plan.drafter.kind, target16, drafter16, prompts, tokens, anchor_table(target), references,
                         functions)
    return stats, runs, RangeReport.of(device, peaks)


def device_pass(plan, target: TargetModules, target32: TargetModules, modules, prompt: list[int],
                tokens: int) -> dict:
    """The build's device pass of the pair (``device_acceptance``) on one held-out ``prompt``, beside the fp32 pair's
    tokens per round on it (no time recorded: a rebuild's manifest is the same); raises ``GateError`` where a drafter
    tensor leaves its device's range or the run is not lossless."""
    stats, runs, verdict = device_acceptance(plan, target, modules, [prompt], tokens)
    drafter32 = compute_copy(modules, torch.float32, share_weights=True)
    fp32, _ = accept(plan.drafter.kind, target32, drafter32, [prompt], tokens, anchor_table(target),
                     greedy_references(target32, [prompt], tokens))
    result = {"target_device": DEVICE_OF_LAYOUT[plan.recipe.target.layout], "device": verdict.device,
              "prompt_tokens": len(prompt), "tokens": tokens, "tokens_per_round": stats["tokens_per_round"],
              "fp32_tokens_per_round": fp32["tokens_per_round"],
              "acceptance_by_position": stats["acceptance_by_position"], "lossless": stats["lossless"],
              "near_ties": stats["near_ties"], "range": verdict.model_dump(exclude={"tightest"}),
              "tightest": [f"{e.tensor} ({e.kind}): {e.headroom:.3g}x" for e in verdict.tightest[:3]]}
    raise_if_out_of_range(verdict, "device pass of the pair")
    raise_if_lossy(stats, runs)
    return result


def raise_if_out_of_range(verdict: RangeReport, what: str) -> None:
    if verdict.over:
        raise GateError(f"{what} (the drafter on the {verdict.device}): range: {verdict.over_phrase()}; nothing was "
                        "published")


def raise_if_lossy(stats: dict, runs: list[speculative.PromptRun]) -> None:
    if not stats["lossless"]:
        flip = next(r.divergence for r in runs if r.divergence and r.divergence["kind"] == "real_flip")
        raise GateError(
            f"speculative decoding is not lossless: at output offset {flip['offset']} it produced "
            f"{flip['speculative']} where plain greedy decoding produced {flip['greedy']} (logit gap "
            f"{flip['logit_gap']:.3f} >= near-tie margin {NEAR_TIE_LOGITS})"
        )


def ab_verdict(ab: dict, max_p: float) -> dict:
    """A quantized drafter that accepts significantly fewer drafts than the fp16 one is refused."""
    worse = ab["accepted_other"] < ab["accepted_base"] and ab["sign_test_p"] < max_p
    return {**ab, "max_p_value": max_p, "significant_loss": worse}


class Recording:
    """A ``speculative.Functions`` that records every call with its outputs (the package check replays them), or
    without them (``outputs=False``: a calibration's replays need the inputs alone, and a draft call's outputs hold its
    fp32 logits, 7 MB at the 27B vocabulary)."""

    def __init__(self, functions: ModuleFunctions, outputs: bool = True):
        self.functions, self.calls, self.outputs = functions, [], outputs

    def reset(self) -> None:
        self.functions.reset()
        self.calls.append(("reset", {}, {}))

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.functions.call(function, inputs)
        self.calls.append((function, {k: np.array(v) for k, v in inputs.items()}, out if self.outputs else {}))
        return out


def recorded_calls(kind: str, target_modules, drafter_modules, prompt: list[int], tokens: int,
                   embeddings: np.ndarray) -> list:
    """The drafter calls of a short speculative run of the shipped fp16 modules, with their outputs, computed as this
    CPU's Core AI runtime computes (``checks.like_the_runtime``): what the drafter's package check replays."""
    target, drafter = drivers(kind, target_modules, drafter_modules, embeddings)
    drafter.functions = Recording(drafter.functions)
    with like_the_runtime():
        speculative.speculate(kind, target, drafter, prompt, tokens)
    return drafter.functions.calls
