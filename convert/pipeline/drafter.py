"""The drafter part of a build: plan, modules with the target's shipped tables, quantize, accept, manifest.

A drafter is only useful with the exact target build it was made for, so every stage takes the target's
shipped modules: the drafter's borrowed ``lm_head`` (and an MTP head's embedding table) are the target's
tensors exactly as the target package computes with them, quantized the same way when the target's are
(the same codes and tables, so both packages store the same bytes), and the mask row of a DFlash2 drafter is
the target's shipped embedding row. The drafter's manifest binds it to that target by hash
(``manifests.schema.TargetBinding``); ``manifests.identity.pair_mismatches`` checks the binding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from convert import cache as build_cache
from convert import progress
from convert.errors import InputError
from convert.export.ane import logits_ranges
from convert.export.functions import compute_copy
from convert.export.lockstep import over_sessions
from convert.export.quantized import (
    CodesLinear,
    QuantizedLinear,
    RowParts,
    apply_quantized,
    embedding_rows,
    table_shape,
)
from convert.export.spec import FunctionSpec
from convert.fp16 import Peaks
from convert.inputs import contract
from convert.inputs.recipe import Drafter, Recipe
from convert.inputs.sources import Snapshot, resolve
from convert.models import drafter_family
from convert.pipeline.partition import row_align
from convert.progress import console
from convert.runtime import speculative
from convert.runtime.host import DeviceFunctions, ModuleFunctions, TargetDriver
from convert.verify.gates import DEVICE_OF_LAYOUT
from convert.weights import rescale
from convert.weights.target import TargetModules
from manifests.schema import Rescale

T = TypeVar("T")


JOURNAL_STAGE = "prompt-runs"  # the build cache's stage of ``PromptJournal`` entries


MAX_SESSIONS = 8
"""Prompts the drafter stage runs at once at most (``over_prompts``; the plan takes fewer when memory is short): each
block of a weight is made once for all of them, and past a few sessions their products are most of the work."""


NGRAM = "ngram"  # the prompt-lookup baseline's kind (``speculative.NGramDrafter``: no model, no package)


BORROWED = ("lm_head", "embed_tokens")  # the target's tables inside a drafter core: never quantized on their own


@dataclass
class DrafterPlan:
    config: Drafter
    snapshot: Snapshot
    args: object  # the drafter family's args
    checkpoint_layout: str  # its tensors' layout (a DFlash2 architecture, an MTP head's keys), not the graphs'
    specs: list[FunctionSpec]
    head_ranges: list[tuple[int, int]] | None = None  # the ane layout's logits outputs' vocabulary rows

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def family(self):
        """The drafter family's hooks (``convert.models.drafter_family``)."""
        return drafter_family(self.kind)

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
    return drafter_family(kind).host_contract(args, config, head_ranges)


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


def check_drafter_recipe(recipe: Recipe, recipe_path: Path) -> None:
    """Refuse a recipe whose drafter kind is not registered, or whose family cannot be built with the recipe's target
    (its ``recipe_problems``), naming the file; before any source is read."""
    if recipe.drafter is None:
        return
    try:
        problems = drafter_family(recipe.drafter.kind).recipe_problems(recipe)
    except InputError as unknown:
        raise InputError(f"{recipe_path}: {unknown}") from None
    if problems:
        raise InputError(f"{recipe_path}: {problems[0]}")


def plan_drafter(recipe: Recipe, recipe_path: Path, target_snapshot: Snapshot, target,
                 dtype: torch.dtype) -> DrafterPlan:
    """Validate the drafter's config and tensor headers against the target (its architecture family's args);
    reads no weights."""
    config = recipe.drafter
    where = recipe_path
    family = drafter_family(config.kind)
    if config.source is None and family.SOURCE_REQUIRED:
        raise InputError(f"{where}: drafter.source: required for a {config.kind} drafter")
    snapshot = resolve(config.source, recipe_path.resolve().parent, "drafter.source") if config.source \
        else target_snapshot
    config_path = snapshot.directory / "config.json"
    contract.check(snapshot.config(), config.contract, str(config_path), "drafter.contract")
    ranges = head_ranges(recipe, target.vocab_size)  # the drafter's vocabulary is the target's (checked below)
    args = family.Args.from_config(snapshot.config(), str(config_path))
    checkpoint_layout = family.check_checkpoint(args, snapshot.directory, recipe, where, config_path)
    specs = family.specs(args, recipe, dtype, ranges)
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
    modules = plan.family.modules(plan.args, plan.snapshot.directory, recipe, _head_weight(core.lm_head),
                                  anchor_table(target), dtype, plan.head_ranges, core.residual_scale, own_scale)
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
    targets; on the build's torch device (``plan.torch_device``, where ``target32`` is). Raises ``RangeError`` where no
    scale reaches a tensor past its limit (its lm_head's logits, say)."""
    kind, device = plan.drafter.kind, DEVICE_OF_LAYOUT[plan.drafter.config.layout]
    drafter32 = compute_copy(modules, torch.float32, share_weights=True, device=plan.torch_device)
    peaks = Peaks(drafter=drafter32.core)
    target_driver, drafter_driver = drivers(kind, target32, drafter32, anchor_table(target))
    # the drafter's calls alone watched: the target's every op noted too kept an H100 busy 4.9 s a round on the
    # 27B (docs/lab/2026-12-07-27b-pair-on-an-h100.md), and ``rescale.choose`` judges the drafter's peaks only
    drafter_driver.functions = DeviceFunctions(drafter_driver.functions, None, peaks)
    with torch.no_grad():
        speculative.speculate(target_driver, drafter_driver, prompt, tokens)
    scales, entries = rescale.choose(peaks, device, rescale.drafter_classes(drafter32.core, "drafter"), "drafter")
    for line in rescale.lines(scales, entries, device, f"{kind} drafter's residual stream"):
        console.print(line)
    own = scales.residual_scale
    stream = own * plan.drafter.family.stream_scale(target.core.residual_scale)  # where its stream starts
    return own, Rescale.model_validate({**rescale.record(scales, entries, device, 1), "residual_scale": stream})


def _head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The target head's weight to build a drafter with: a placeholder of its shape (one zero, expanded) when the head
    is a ``CodesLinear``, which the drafter then shares (``build_modules``)."""
    if isinstance(head, CodesLinear):
        return torch.zeros((), dtype=torch.float16).expand(head.shape)
    return head.weight.detach()


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
    """The target's driver and the drafter's (a drafter family's ``driver``, by its ``kind``; or ``NGRAM``: prompt
    lookup, no modules), on ``functions`` (target's, drafter's) when given, else on the modules themselves."""
    target_functions, drafter_functions = functions or (
        ModuleFunctions(target_modules), None if drafter_modules is None else ModuleFunctions(drafter_modules))
    target = TargetDriver(target_functions, target_modules.widths, target_modules.contract)
    if kind == NGRAM:
        return target, speculative.NGramDrafter()
    return target, drafter_family(kind).driver(drafter_functions, drafter_modules.widths, embeddings)
