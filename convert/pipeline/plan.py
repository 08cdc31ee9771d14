"""The build plan: a recipe and its checkpoint's config and headers read into what the build will do (functions,
parts, memory, the drafter's plan), refused before any weight is read when it cannot be done here; and the
``--dry-run`` description of it, also from the recipe's contracts alone when a source is not on this machine."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from convert import fields
from convert.errors import InputError, SourceUnavailable
from convert.export.functions import parameters_on_meta
from convert.export.spec import (
    SHIP_DTYPE,
    FunctionSpec,
    buffer_bytes,
    buffer_specs,
    function_lines,
    size_lines,
    size_text,
)
from convert.inputs import contract, prism
from convert.inputs.checkpoint import checkpoint_shapes
from convert.inputs.contract import _MISSING, as_config, lookup
from convert.inputs.prism import BLOCK_FIELD, pack_block, source_config, unfolded_snapshot
from convert.inputs.recipe import Recipe, check_against_model, load_recipe
from convert.inputs.sources import (
    Snapshot,
    headers_only,
    headers_record,
    read_json,
    resolve,
    tensor_shapes,
    weight_bytes,
)
from convert.models import dflash2, family_for, family_of, mtp
from convert.models.layout import Layout
from convert.models.part import Part
from convert.pipeline.drafter import (
    MAX_SESSIONS,
    DrafterPlan,
    drafter_contract,
    head_ranges,
    own_linear_shapes,
    own_phase_bytes,
    own_shapes,
    plan_drafter,
    stage_target,
)
from convert.pipeline.partition import (
    BASE_BYTES,
    build_memory_bytes,
    held_target_bytes,
    matrix_bytes,
    memory_line,
    piece_sizes,
    plan_lines,
    plan_parts,
    shipped_line,
)
from convert.verify import placement
from convert.weights.quantize import (
    check_group_size,
    check_group_widths,
    estimate_lines,
    kept_modules,
    quantize_seconds,
)
from convert.weights.target import function_specs


@dataclass
class Plan:
    recipe: Recipe
    recipe_path: Path
    output: Path
    snapshot: Snapshot
    args: object  # the architecture family's args (convert/models)
    layout: Layout
    specs: list[FunctionSpec]
    checkpoint_bytes: int
    parts: list[Part]
    drafter: DrafterPlan | None = None

    @property
    def target_dir(self) -> Path:
        """Where the target bundle goes: the output itself, or its ``target/`` when a drafter comes along."""
        return self.output / "target" if self.drafter else self.output

    @property
    def parameter_count(self) -> int:
        return self.args.parameter_count

    @property
    def host_buffers(self) -> tuple[str, ...]:
        return host_buffer_names(self.args, self.recipe.target)

    @property
    def state_bytes(self) -> int:
        """Every state of the target (KV caches, and a hybrid's conv, recurrent and pending states) as shipped."""
        return sum(s.nbytes for s in self.specs[0].states)

    @cached_property
    def sizes(self):
        """The shipped bytes of the target's pieces (``partition.piece_sizes``; builds its parameterless core once)."""
        return piece_sizes(self.args, self.recipe.target)

    @cached_property
    def peak_memory_bytes(self) -> int:
        """Estimate of the build's peak host memory (``convert/pipeline/partition.py``: measured costs), the drafter
        stage's included; computed once (it builds the target's parameterless core)."""
        return max(build_memory_bytes(self.args, self.recipe.target, self.parts, self.specs), self.drafter_stage_bytes)

    @property
    def drafter_stage_target_bytes(self) -> int:
        """The target as the drafter stage holds it with its fp32 compute copy (calibration, acceptance, the A/B): a
        whole target's modules, a parted target's quantized weights as packed codes (``held_target_bytes``)."""
        return held_target_bytes(self.args, self.recipe.target, lean=not self.parts[0].is_whole)

    @property
    def drafter_stage_bytes(self) -> int:
        """Host memory of the drafter stage (0 without a drafter): its largest phase (``drafter_phases``) above the
        process's base."""
        if not self.drafter:
            return 0
        return BASE_BYTES + max(sum(shares.values()) for shares in self.drafter_phases.values())

    @cached_property
    def drafter_phases(self) -> dict[str, dict[str, int]]:
        """Each phase of the drafter stage's host memory by share: the drafter's own (``drafter.own_phase_bytes``),
        the target as that phase holds it (all of it while it is called: load, calibration, acceptance; a parted
        target's tables alone while GPTQ runs, its layers loaded again after; its tables at packaging) and, where
        prompts run, the sessions' states (``drafter_sessions``)."""
        whole = self.drafter_stage_target_bytes
        sizes = self.sizes
        tables = int((sizes.embedding_row + sizes.head_row) * self.args.vocab_size) + sizes.norm
        let_go = {"package"} | ({"quantize"} if not self.parts[0].is_whole and
                                 self.drafter.config.quantization.uses_gptq else set())
        sessions = self.drafter_sessions * self.drafter_session_bytes
        return {phase: {"target": tables if phase in let_go else whole, "drafter": own,
                        "sessions": sessions if phase in ("calibrate", "accept") else 0}
                for phase, own in self.drafter_own_phases.items()}

    @cached_property
    def drafter_own_phases(self) -> dict[str, int]:
        """The drafter's own share of each phase of its stage (``drafter.own_phase_bytes``)."""
        return own_phase_bytes(self.drafter)

    @property
    def drafter_session_bytes(self) -> int:
        """One session of the drafter stage's prompts: the states (the ane layout: the host's buffers) of the target's
        and the drafter's fp32 compute copies (every element counted at 4 bytes), the target's at the rows the stage
        reaches (``drafter.stage_target``)."""
        specs = family_of(self.args).function_specs(self.args, stage_target(self.recipe))
        states = [*specs[0].states, *self.drafter.specs[0].states, *buffer_specs(specs, self.host_buffers),
                  *buffer_specs(self.drafter.specs, tuple(self.drafter.contract.get("buffers", {})))]
        return sum(4 * math.prod(s.shape) for s in states)

    @cached_property
    def drafter_sessions(self) -> int:
        """Prompts the drafter stage runs at once (``convert.pipeline.drafter.over_prompts``): as many sessions as
        ``target.max_host_memory_gb`` holds beside the rest of the phases that run prompts (calibration, acceptance),
        at least one, at most ``drafter.MAX_SESSIONS`` (each block of a weight is made once for all of them:
        ``bench/sessions_in_step.py``)."""
        own = self.drafter_own_phases
        held = self.drafter_stage_target_bytes + max(own.get("calibrate", 0), own["accept"])
        room = self.recipe.target.max_host_memory_gb * 1e9 - BASE_BYTES - held
        return int(min(MAX_SESSIONS, max(1, room // self.drafter_session_bytes)))


def make_plan(recipe_path: Path, output: str | Path | None = None, cache_root: Path | None = None,
              refuse: bool = True) -> Plan:
    """Validate the recipe and the checkpoint's config and headers; reads no weights (but a Prism pack's, which is
    unfolded once into ``cache_root``, default the build cache's directory:
    ``convert.inputs.prism.unfolded_snapshot``; within ``sources.headers_only()`` a pack on the hub is planned from its
    headers, ``_pack_headers_view``). ``refuse``: raise when the build would not fit ``target.max_host_memory_gb``
    (``refusal``); the dry run says so in its summary instead."""
    recipe = load_recipe(recipe_path)
    snapshot = resolve(recipe.target.source, recipe_path.resolve().parent)
    contract.check(source_config(snapshot.directory), recipe.target.contract, str(snapshot.directory / "config.json"),
                   "target.contract")
    quant = recipe.target.quantization
    if headers_record(snapshot.directory) is not None and quant.method == "exact" and \
            snapshot.config().get("model_type") == prism.MODEL_TYPE:
        snapshot, shapes = _pack_headers_view(snapshot)
    else:
        snapshot = unfolded_snapshot(snapshot, quant, str(recipe_path), recipe.target.max_host_memory_gb * 1e9,
                                     cache_root)
        shapes = checkpoint_shapes(snapshot.directory)
    config_path = snapshot.directory / "config.json"
    family = family_for(snapshot.config(), str(config_path))
    args = family.Args.from_config(snapshot.config(), where=str(config_path))
    check_against_model(recipe, args.num_hidden_layers, args.max_position_embeddings, recipe_path)
    layout = family.sanitize(shapes, args, f"checkpoint {snapshot.directory}")
    check_group_size(args, recipe.target)  # before the quantizer meets a width its groups do not divide
    if not (snapshot.directory / "tokenizer.json").is_file():
        raise InputError(f"{snapshot.directory}: no tokenizer.json; a bundle ships its tokenizer and hashes it")
    checkpoint_bytes = weight_bytes(snapshot.directory)
    out = Path(output or recipe.output or Path("bundles") / recipe.name)
    drafter = plan_drafter(recipe, recipe_path, snapshot, args, SHIP_DTYPE) if recipe.drafter else None
    if drafter is not None:  # the drafter quantizes every linear of its own
        check_group_widths(drafter.config.quantization, own_linear_shapes(drafter), "drafter.quantization",
                           "quantize the drafter with the other 4-bit method, or not (method: none)")
    plan = Plan(recipe, recipe_path, out, snapshot, args, layout, function_specs(args, recipe.target, SHIP_DTYPE),
                checkpoint_bytes, plan_parts(args, recipe.target), drafter)
    if refuse:
        _check_host_memory(plan)
    return plan


def _pack_headers_view(snapshot: Snapshot) -> tuple[Snapshot, dict[str, tuple[int, ...]]]:
    """A headers-only Prism pack's unfolded view (``prism.write_view``'s config.json and tokenizer files, beside the
    stubs) and its tensors' shapes in the unfolded checkpoint (``prism.UnfoldedPack.shapes``), from its config's modules
    list and the safetensors headers alone: the scales and signs ``read_pack`` checks are tensor data, read by the
    build."""
    directory = snapshot.directory
    config = read_json(directory / "config.json")
    prism._check_config(config, directory / "config.json")
    records = prism._module_records(config, directory / "config.json")
    pack = prism.Pack(directory, config, 0, {})
    stored = tensor_shapes(directory)
    packed = {prism.PREFIX + r["path"] + part for r in records for part in (".weight", ".scales", ".biases", ".signs")}
    shapes = {}
    for record in records:
        name = prism.PREFIX + record["path"] + ".weight"
        if name not in stored or len(stored[name]) != 2:
            raise InputError(f"{directory / 'config.json'}: modules names {record['path']!r}, but the pack has no 2-D "
                             f"tensor {name!r}")
        rows, words = stored[name]
        shapes[prism.hf_key(name)] = (rows, words * prism.CODES_PER_WORD)
    for name, shape in stored.items():
        if name not in packed:
            shapes[prism.hf_key(name)] = tuple(prism.hf_layout(name, torch.empty(shape, device="meta")).shape)
    view = directory.parent / f"{directory.name}.unfolded"
    view.mkdir(exist_ok=True)
    (view / "config.json").write_text(json.dumps(prism.unfolded_config(pack), indent=2))
    prism._copy_files(pack, view)
    return dataclasses.replace(snapshot, directory=view, packed=directory), shapes


def refusal(plan: Plan) -> tuple[str, str] | None:
    """Why the build would be refused for host memory (``_check_host_memory``), as (the stage over the budget, what
    else lowers it), or None. A whole target is built in memory only when it fits (``plan_parts``); a parted one's
    packaging fits by construction, so what can be over is the drafter stage or the streamed gate, which more or
    smaller parts do not lower."""
    budget = plan.recipe.target.max_host_memory_gb * 1e9
    if plan.parts[0].is_whole or plan.peak_memory_bytes <= budget:
        return None
    if plan.drafter_stage_bytes > budget:
        return ("the drafter stage", "build the target alone (a recipe without its drafter); more or smaller parts "
                "do not lower it (the stage holds the whole target's quantized weights beside the drafter)")
    return ("the streamed gate", "lower target.gate.data.samples or length (the gate holds every window's states); "
            "more or smaller parts do not lower it")


def _check_host_memory(plan: Plan) -> None:
    """A parted target's packaging fits ``target.max_host_memory_gb`` by construction (``plan_parts``); its streamed
    gate holds every window's states, which the gate data sets: refuse a gate that would not fit, before any work."""
    target, refused = plan.recipe.target, refusal(plan)
    if refused is None:
        return
    if refused[0] == "the drafter stage":
        raise InputError(f"{plan.recipe_path}: drafter: the drafter stage needs about "
                         f"{plan.drafter_stage_bytes / 1e9:.0f} GB ({_drafter_stage_parts(plan)}), over "
                         f"target.max_host_memory_gb {target.max_host_memory_gb:g}; build the target alone here (a "
                         "recipe without the drafter), or the pair on a machine with that memory and a "
                         "max_host_memory_gb to match")
    data = target.gate.data
    raise InputError(f"{plan.recipe_path}: target.gate.data: the streamed gate over {data.samples} x {data.length} "
                     f"tokens needs about {plan.peak_memory_bytes / 1e9:.1f} GB of host memory (every window's "
                     f"states and taps, the largest piece of the target in fp16 and fp32), over "
                     f"target.max_host_memory_gb {target.max_host_memory_gb:g}; lower samples or length, or raise "
                     "max_host_memory_gb")


def _drafter_stage_parts(plan: Plan) -> str:
    """The drafter stage's largest phase and its shares."""
    phase, shares = max(plan.drafter_phases.items(), key=lambda item: sum(item[1].values()))
    held = "with its fp32 compute copy" if plan.parts[0].is_whole else "its quantized weights as packed codes"
    sessions = plan.drafter_sessions
    text = (f"its largest phase, {phase}: the target ({held}) {size_text(shares['target'])}, the drafter "
            f"{size_text(shares['drafter'])}")
    if shares["sessions"]:
        text += (f", {sessions} session{'s' if sessions > 1 else ''} of prompts run at once, "
                 f"{'their' if sessions > 1 else 'its'} states {size_text(shares['sessions'])} (at "
                 f"{stage_target(plan.recipe).context:,} positions)")
    return text


def host_buffer_names(args, target) -> tuple[str, ...]:
    """The inputs the host owns (the ane layout's history; none in the stateful layout)."""
    return tuple(family_of(args).host_contract(args, target).get("buffers", {}))


def host_buffer_lines(specs: list[FunctionSpec], owned: tuple[str, ...], args, target) -> list[str]:
    """The host's buffers in all (the ane layout: the memory a runtime holds beside the package for a session), the
    embedding table it looks rows up in (once for every session) and the ladder's entries."""
    if not owned:
        return []
    table = 2 * args.vocab_size * args.hidden_size
    lines = [buffers_line(specs, owned, "  "),
             f"  host embedding table: [{args.vocab_size}, {args.hidden_size}] fp16, {table / 2**20:.1f} MiB "
             "(embeddings.safetensors: the host looks up each call's rows in it)"]
    if target.ladder:
        lines.append(f"  ladder: entries at {', '.join(f'{c:,}' for c in target.ladder)} beside {target.context:,} "
                     "positions; the host calls the smallest that holds a call's rows, with that much history")
    return lines


def placement_lines(args, target, parts: list[Part]) -> list[str]:
    """What the placement lint (``convert/verify/placement.py``) finds in the planned functions' shapes, dtypes and
    states, part by part; their ops are linted once packaged (``build`` prints those findings)."""
    family = family_of(args)
    positional = placement.positional_buffers(family.host_contract(args, target))
    findings = []
    for part in parts:
        specs = family.function_specs(args, target, torch.float16, None if part.is_whole else part)
        where = "" if part.is_whole else f"{part.name} "
        findings += [where + f for f in placement.lint("coreai", {s.name: s for s in specs}, {}, positional)]
    return lint_lines(findings, "  ")


def lint_lines(findings: list[str], indent: str) -> list[str]:
    shown = [f"{indent}  {finding}" for finding in findings[:PLAN_FINDINGS]]
    more = [f"{indent}  ... and {len(findings) - PLAN_FINDINGS} more"] if len(findings) > PLAN_FINDINGS else []
    count = f"{len(findings)} findings" if findings else "no finding"
    return [f"{indent}placement lint of the planned shapes: {count} (the ops are linted when packaged)", *shown, *more]


def buffers_line(specs: list[FunctionSpec], owned: tuple[str, ...], indent: str) -> str:
    return (f"{indent}host buffers: {buffer_bytes(specs, owned) / 2**20:.1f} MiB in all, owned and written by the host "
            "(layout ane)")


def drafter_function_lines(specs: list[FunctionSpec], contract: dict) -> list[str]:
    """The drafter's functions, its host buffers (layout ane: its ring or KV history, owned and written by the host)
    and what the placement lint finds in its planned shapes."""
    owned = tuple(contract.get("buffers", {}))
    findings = placement.lint("coreai", {s.name: s for s in specs}, {}, placement.positional_buffers(contract))
    return [*function_lines(specs, owned), *([buffers_line(specs, owned, "    ")] if owned else []),
            *lint_lines(findings, "    ")]


PLAN_FINDINGS = 6  # the plan shows this many of the lint's findings


def describe_plan(plan: Plan) -> list[str]:
    """The plan as lines: functions and shapes, parameters, package size and peak memory estimates."""
    recipe, args = plan.recipe, plan.args
    mib = 2**20
    lines = [
        f"{recipe.name}: {plan.snapshot.reference} -> {plan.target_dir}",
        *family_of(args).plan_lines(args, recipe.target),
        *(f"  {note}" for note in plan.layout.notes()),
        "  functions:",
        *function_lines(plan.specs, plan.host_buffers),
        *size_lines(plan.parameter_count, recipe.backends),
        shipped_line(args, recipe.target),
        *plan_lines(args, recipe.target, plan.parts),
        *(rotation_lines(args, recipe.target, pack_block(plan.snapshot.packed)) if plan.snapshot.packed else []),
        f"  states: {plan.state_bytes / mib:.1f} MiB in all",
        *host_buffer_lines(plan.specs, plan.host_buffers, args, recipe.target),
        *placement_lines(args, recipe.target, plan.parts),
        *estimate_lines(args, recipe.target),
        memory_line(recipe.target, plan.peak_memory_bytes),
        *([f"  estimated drafter stage: {plan.drafter_stage_bytes / 1e9:.1f} GB ({_drafter_stage_parts(plan)})"]
          if plan.drafter else []),
    ]
    if plan.drafter:
        lines += describe_drafter(plan)
    return lines


def dry_run(recipe_path: Path, output: str | Path | None = None, cache_root: Path | None = None) -> list[str]:
    """``build --dry-run``: the plan's summary, then its signatures. Loads no weights: an ``hf://`` source that is not
    in the Hugging Face cache is planned from its config, tokenizer files and safetensors headers
    (``sources.headers_only``); one that cannot be reached either, from the recipe's contracts (``describe_contract``).
    A build the plan would refuse is said so in the summary (exit 0: the plan is what was asked for)."""
    with headers_only():
        try:
            plan = make_plan(recipe_path, output, cache_root, refuse=False)
        except SourceUnavailable as unavailable:
            return describe_contract(load_recipe(recipe_path), recipe_path, unavailable)
        return [*summary_lines(plan), *describe_plan(plan)]


# Measured rates the summary's time estimates scale (an estimate, never a promise; a stage not measured says so).
# The quantize stage: ``convert.weights.quantize.COST_MODEL`` (bench/scale.py at the 27B geometry, one H200 and 2 CPU
# cores). The gate: the 27B gate on this repo's 2-core CPU machine (docs/benchmarks.md, "The gate's candidate at full
# size", 2026-12-05): the candidate about 2.25 h and the streamed reference 50 min, about 3.1 h, for 26,895,998,464
# parameters over 16 windows of 256 tokens and 16 greedy tokens; scaled by parameters x windows x (length + greedy).
GATE_CPU_SECONDS = 3.1 * 3600
GATE_MEASURED_PARAMETERS = 26_895_998_464
GATE_MEASURED_TOKENS = 16 * (256 + 16)
# Packaging: the parted 27B target in both formats on the same machine (docs/benchmarks.md, "Parts of the Bonsai 27B
# packaged as its build packages them", 2026-12-05): about 10,000 s (2.8 h) for its 14 parts, packaged, checked and
# compiled; scaled by parameters and formats. Core AI's and Core ML's converters run on the CPU: a GPU does not help.
PACKAGING_CPU_SECONDS = 10_000
PACKAGING_MEASURED_PARAMETERS = 26_895_998_464
PACKAGING_MEASURED_FORMATS = 2
CPU_MACHINE = "2 CPU cores"  # COST_MODEL's name of the CPU machine the rates were measured on
GPU_MACHINE = "one H200"
GB = 1e9


def summary_lines(plan: Plan, contract_note: str = "") -> list[str]:
    """The plan's first lines: what is built (parts, formats, sizes), what a build downloads, the estimated peak host
    memory against the budget (and, when the build would be refused, a plain line saying so and what to change), the
    estimated time per stage on the CPU and on one GPU (from ``GATE_CPU_SECONDS`` ... and ``COST_MODEL``) and the disk
    it takes."""
    recipe, args, target = plan.recipe, plan.args, plan.recipe.target
    formats = len(recipe.backends)
    sizes = plan.sizes
    shipped = sizes.total(args.vocab_size, args.tie_word_embeddings)
    table = 2 * args.vocab_size * args.hidden_size if sizes.host_lookup else 0
    count = len(plan.parts)
    parts = "whole (one package)" if plan.parts[0].is_whole else f"in {count} parts"
    lines = [f"summary{contract_note} (estimates; no weights read):",
             f"  builds: target {parts} x {formats} format{'s' if formats > 1 else ''} ({', '.join(recipe.backends)}), "
             f"quantization {target.quantization.method}, layout {target.layout}: {_size(shipped)} of weights a "
             "format" + (f", the host's embedding table {_size(table)}" if table else "")]
    drafter = 0
    if plan.drafter is not None:
        drafter = drafter_shipped_bytes(plan.drafter)
        lines.append(f"  builds: drafter {plan.drafter.kind} (quantization {plan.drafter.config.quantization.method}, "
                     f"layout {plan.drafter.config.layout}): {_size(drafter)} of its own weights a format")
    elif recipe.drafter is not None:
        lines.append(f"  builds: drafter {recipe.drafter.kind}: planned from its config.json at build time")
    download = download_line(plan)
    if download:
        lines.append(download)
    budget = target.max_host_memory_gb
    peak = plan.peak_memory_bytes / GB
    stage = "the drafter stage" if plan.drafter_stage_bytes >= plan.peak_memory_bytes else "the target's build"
    lines.append(f"  peak host memory: {peak:.1f} GB ({stage}), target.max_host_memory_gb {budget:g}: "
                 f"{'over' if peak > budget else 'within'} budget")
    refused = refusal(plan)
    if refused:
        raise_to = math.ceil(peak * 10) / 10
        lines.append(f"  this build would be refused: peak {peak:.1f} GB > target.max_host_memory_gb {budget:g} "
                     f"({refused[0]}); raise target.max_host_memory_gb to {raise_to:g} or {refused[1]}")
    lines += time_lines(plan)
    lines += data_lines(plan)
    bundle = formats * (shipped + drafter) + table
    cache = bundle - table + (shipped if target.quantization.format not in (None, "exact2") else 0)
    if plan.snapshot is not None and plan.snapshot.packed is not None and \
            4 * plan.parameter_count <= target.max_host_memory_gb * GB:
        cache += 4 * plan.parameter_count  # the pack unfolded in fp32 (prism.unfolded_snapshot); larger: a view
    lines.append(f"  disk: bundle {_size(bundle)}; build cache about {_size(cache)} (the packaged parts"
                 + (", the quantized weights" if target.quantization.format not in (None, "exact2") else "")
                 + ", the gate's per-window records); temporaries: the bundle is written beside --output and renamed "
                 "into place (no second copy)" + ("" if target.quantization.format in (None, "exact2") else
                                                  f", under --no-cache the quantized weights {_size(shipped)}"))
    return lines


def data_lines(plan: Plan) -> list[str]:
    """The text the gate (and GPTQ) measure on, and when it is the fixture corpus (the default) a word that it is a
    Python split, not the model's own domain."""
    target = plan.recipe.target
    texts = [("gate", target.gate.data.corpus, "target.gate.data.corpus")]
    if target.quantization.method.endswith("gptq"):
        texts.append(("GPTQ calibration", target.quantization.calibration.corpus,
                      "target.quantization.calibration.corpus"))
    lines = []
    for what, corpus, field in texts:
        default = corpus.startswith("fixture:")
        lines.append(f"  {what} text: {corpus}" + (
            f" (the fixture corpus: Python source, the default; for another domain set {field} to path:FILE of "
            "your model's text)" if default else ""))
    return lines


def drafter_shipped_bytes(drafter: DrafterPlan) -> int:
    """The drafter's own weights as a package stores them (its linears quantized as its recipe says, the rest fp16;
    the tables it borrows from the target not counted)."""
    quant = drafter.config.quantization
    linears = own_linear_shapes(drafter)
    parameters = sum(math.prod(shape) for shape in own_shapes(drafter).values())
    others = parameters - sum(rows * columns for rows, columns in linears.values())
    return 2 * others + sum(matrix_bytes(quant.format, quant.resolved_group_size, shape) for shape in linears.values())


def download_line(plan: Plan) -> str | None:
    """What a build would download: the weight files of each source planned from its headers (``headers_only``)."""
    if plan.snapshot is None:  # planned from the contracts: the hub was not reached
        if plan.recipe.target.quantization.format == "exact2":
            least, what = plan.sizes.total(plan.args.vocab_size, plan.args.tie_word_embeddings), "its packed codes"
        else:
            least, what = 2 * plan.parameter_count, f"{plan.parameter_count:,} parameters in bf16"
        return f"  download: not read (the hub was not reached); the target alone at least {_size(least)} ({what})"
    sources = [plan.snapshot] + ([plan.drafter.snapshot] if plan.drafter and plan.drafter.snapshot is not None
                                 and plan.drafter.snapshot.source != plan.snapshot.source else [])
    fetched = []
    for snapshot in sources:
        record = headers_record(snapshot.source)
        if record is not None:
            sizes = record.get("sizes", {})
            fetched.append((snapshot.reference, len(sizes), sum(sizes.values())))
    if not fetched:
        cached = [s.reference for s in sources if s.repo is not None]
        return f"  download: none ({', '.join(cached)} in the Hugging Face cache)" if cached else None
    total = sum(size for _, _, size in fetched)
    each = "; ".join(f"{ref}: {n} safetensors file{'s' if n != 1 else ''}, {_size(size)}"
                     for ref, n, size in fetched)
    return (f"  download: a build fetches {_size(total)} of weights into the Hugging Face cache ({each}); this "
            "plan read only their headers")


def cpu_seconds(plan: Plan) -> dict[str, float]:
    """The estimated seconds of the stages measured on the CPU machine (``quantize``, ``gate``, ``packaging``), scaled
    from the rates above; a stage with nothing to do or no measured rate left out."""
    target, parameters = plan.recipe.target, plan.args.parameter_count
    seconds = {}
    if target.quantization.format not in (None, "exact2"):
        quantize = quantize_seconds(plan.args, target).get(CPU_MACHINE)
        if quantize is not None:
            seconds["quantize"] = quantize
    data = target.gate.data
    seconds["gate"] = GATE_CPU_SECONDS * parameters / GATE_MEASURED_PARAMETERS * data.samples * (
        data.length + target.gate.greedy_tokens) / GATE_MEASURED_TOKENS
    seconds["packaging"] = PACKAGING_CPU_SECONDS * parameters / PACKAGING_MEASURED_PARAMETERS * \
        len(plan.recipe.backends) / PACKAGING_MEASURED_FORMATS
    return seconds


def time_lines(plan: Plan) -> list[str]:
    """Estimated time of each stage on the CPU machine and on one GPU, scaled from the measured rates above."""
    target, args = plan.recipe.target, plan.args
    quant = target.quantization
    cpu = cpu_seconds(plan)
    lines = [f"  time (estimates scaled from rates measured at 27B, docs/benchmarks.md; {CPU_MACHINE} | "
             f"{GPU_MACHINE}):"]
    if quant.format in (None, "exact2"):
        lines.append(f"    quantize ({quant.method}): nothing to quantize")
    else:
        seconds = quantize_seconds(args, target)
        lines.append(f"    quantize ({quant.method}): {_hours(seconds.get(CPU_MACHINE))} | "
                     f"{_hours(seconds.get(GPU_MACHINE))}")
    data = target.gate.data
    gate, packaging = cpu["gate"], cpu["packaging"]
    lines.append(f"    gate ({data.samples} x {data.length} tokens): {_hours(gate)} | not measured")
    lines.append(f"    packaging ({len(plan.parts)} part{'s' if len(plan.parts) > 1 else ''} x "
                 f"{len(plan.recipe.backends)} formats): {_hours(packaging)} | the same (the converters run on the "
                 "CPU)")
    if plan.recipe.drafter is not None:
        lines.append("    drafter stages (calibration, quantize, acceptance A/B): not measured at this size")
    return lines


def _size(nbytes: float) -> str:
    """Bytes as the budgets count them (10^9 a GB)."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= GB / 10 else f"{nbytes / 1e6:.1f} MB"


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "not measured"
    if seconds < 60:
        return "under a minute"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def describe_drafter(plan: Plan) -> list[str]:
    d, a = plan.drafter, plan.drafter.args
    quant = d.config.quantization
    lines = [f"  drafter {d.kind}: {d.snapshot.reference} ({d.checkpoint_layout}) -> {plan.output / 'drafter'}",
             f"    hidden {a.hidden_size}, heads {a.num_attention_heads}/{a.num_key_value_heads} (head_dim "
             f"{a.head_dim}), vocab {a.vocab_size}, quantization {quant.method}",
             *size_lines(a.parameter_count, plan.recipe.backends, "    ")]
    if d.kind == "dflash2":
        lines.append(f"    taps {list(a.target_layer_ids)} (output of layer i, 0-based), block {a.block_size}, mask id "
                     f"{a.mask_token_id} x {d.config.mask_scale}, ring {d.config.ring} rows, selector rank "
                     f"{a.selector_rank} top-k {a.selector_top_k}")
    return lines + drafter_function_lines(d.specs, d.contract)


def describe_contract(recipe: Recipe, recipe_path: Path, unavailable: SourceUnavailable) -> list[str]:
    """The plan of a recipe whose sources are not here, from its contracts (``build --dry-run``)."""
    target = recipe.target
    pinned = as_config(target.contract)
    where = f"{recipe_path}: target.contract"
    text = fields.section(pinned, where)  # Qwen3.5-style configs nest the text model's fields
    if not pinned:
        raise InputError(f"{unavailable} (and target.contract is empty: nothing to plan from)")
    need = [k for k in ("hidden_size", "vocab_size") if k not in text]
    if need:
        raise InputError(f"{where}: pin {', '.join(need)} to plan without the checkpoint")
    hidden, vocab = fields.integer(text, "hidden_size", where), fields.integer(text, "vocab_size", where)
    layers = text.get("num_hidden_layers")
    if layers is not None:
        layers = fields.check_integer(layers, "num_hidden_layers", where, maximum=fields.MAX_LAYERS)
    taps = list(target.taps or [])
    if layers is not None and any(t >= layers for t in taps):
        raise InputError(f"{recipe_path}: target.taps {taps}: a layer is out of range (the contract pins "
                         f"{layers} layers)")
    lines = [f"{recipe.name}: planned from the recipe's contracts, not from checkpoints: {unavailable}",
             "  (a build needs the pinned checkpoints; it checks every contract field against their config.json)",
             f"  target {target.source}: hidden {hidden}, vocab {vocab}, layers {layers or 'not pinned'}, "
             f"context {target.context}"]
    target_lines, planned = _target_lines(pinned, target, recipe.backends, f"{recipe_path}: target.contract")
    drafter_lines, drafter = [], None
    if recipe.drafter is not None:
        drafter_lines, drafter = _dflash2_lines(recipe, recipe_path, hidden, vocab, taps) \
            if recipe.drafter.kind == "dflash2" else _mtp_lines(recipe, recipe_path, pinned)
    if planned is None:
        return ["summary: sizes, host memory and time are planned from config.json at build time (the recipe's "
                "contracts do not pin every shape)", *lines, *target_lines, *drafter_lines]
    args, specs, parts = planned
    plan = Plan(recipe, recipe_path, Path(recipe.output or Path("bundles") / recipe.name), None, args, None, specs,
                0, parts, drafter)
    memory = [memory_line(target, plan.peak_memory_bytes)]
    if drafter is not None:
        memory.append(f"  estimated drafter stage: {plan.drafter_stage_bytes / 1e9:.1f} GB "
                      f"({_drafter_stage_parts(plan)})")
    elif recipe.drafter is not None:
        memory.append("  estimated drafter stage: from the drafter's config.json at build time (its contract does "
                      "not pin every shape)")
    summary = summary_lines(plan, " from the recipe's contracts")
    return summary + lines + target_lines + memory + drafter_lines


def _mtp_lines(recipe: Recipe, recipe_path: Path, pinned: dict) -> tuple[list[str], DrafterPlan | None]:
    """The MTP head's functions from the target's contract (the head has the target's attention geometry and
    is declared in its config) with the drafter's contract over it."""
    drafter, target = recipe.drafter, recipe.target
    steps = target.graphs.verify - 1
    config = {**pinned, **as_config(drafter.contract)}
    if "text_config" in pinned:
        config["text_config"] = {**pinned["text_config"], **as_config(drafter.contract).get("text_config", {})}
    source = drafter.source or f"{target.source} (its own mtp.* tensors)"
    try:
        args = mtp.MTPArgs.from_config(config, f"{recipe_path}: target.contract + drafter.contract")
    except InputError as missing:
        return [f"  drafter mtp {source}: {steps} draft steps, the head's shapes from config.json at build time "
                f"(the contracts do not plan it: {missing})"], None
    ranges = head_ranges(recipe, args.vocab_size)
    specs = mtp.function_specs(args, steps, target.context, torch.float16, layout=drafter.layout, head_ranges=ranges)
    planned = DrafterPlan(drafter, None, args, "mtp", specs, ranges)
    return [f"  drafter mtp {source}: {steps} draft steps, hidden {args.hidden_size}, heads "
            f"{args.num_attention_heads}/{args.num_key_value_heads} (head_dim {args.head_dim}), quantization "
            f"{drafter.quantization.method}, layout {drafter.layout}",
            *size_lines(args.parameter_count, recipe.backends, "    "),
            *drafter_function_lines(specs, planned.contract)], planned


def _target_lines(pinned: dict, target, backends: list[str], where: str) -> tuple[list[str], tuple | None]:
    """The target's architecture, functions and states from a contract that pins the architecture (architectures or
    model_type) and every field its shapes depend on (the family's ``PLAN_FIELDS``), with (args, function specs,
    parts); otherwise what is missing, and None."""
    text = pinned.get("text_config", pinned)
    if not any(k in c for c in (pinned, text) for k in ("architectures", "model_type")):
        return ["  functions: pin architectures or model_type (and the architecture's shape fields) in "
                "target.contract to plan them"], None
    family = family_for(pinned, where)
    missing = [f for f in family.PLAN_FIELDS if lookup(text, f) is _MISSING and not
               any(lookup(text, alt) is not _MISSING for alt in family.PLAN_ALTERNATIVES.get(f, ()))]
    if missing:
        prefix = "text_config." if "text_config" in pinned else ""
        return [f"  functions: the contract does not pin {', '.join(prefix + f for f in missing)}; the "
                f"{family.FAMILY} functions are planned from config.json at build time"], None
    args = family.Args.from_config(pinned, where)
    specs = family.function_specs(args, target, torch.float16)
    total = sum(s.nbytes for s in specs[0].states) / 2**20
    owned = host_buffer_names(args, target)

    parts = plan_parts(args, target)
    block = lookup(pinned, BLOCK_FIELD)
    if block is not _MISSING:
        fields.check_integer(block, BLOCK_FIELD, where)
    rotations = rotation_lines(args, target, None if block is _MISSING else block) \
        if target.quantization.method == "exact" else []
    return [*family.plan_lines(args, target), "  functions:", *function_lines(specs, owned),
            *size_lines(args.parameter_count, backends), shipped_line(args, target), *plan_lines(args, target, parts),
            *rotations, f"  states: {total:.1f} MiB in all", *host_buffer_lines(specs, owned, args, target),
            *placement_lines(args, target, parts),
            *estimate_lines(args, target)], (args, specs, parts)


def _dflash2_lines(recipe: Recipe, recipe_path: Path, hidden: int, vocab: int,
                   taps: list[int]) -> tuple[list[str], DrafterPlan | None]:
    """The drafter's functions from its contract, and its plan when the contract pins every shape. Fields that no
    function's shape depends on (intermediate_size, dflash_config.mask_token_id) may be left unpinned: they are read
    from config.json at build time (the drafter stage's memory is then planned there)."""
    drafter, target = recipe.drafter, recipe.target
    config = as_config(drafter.contract)
    unpinned = [k for k in ("intermediate_size", "dflash_config.mask_token_id") if lookup(config, k) is _MISSING]
    placeholders = {"intermediate_size": 1, "dflash_config.mask_token_id": 0}  # for shapes only, never shipped
    planning = as_config({**{k: placeholders[k] for k in unpinned}, **drafter.contract})
    where = f"{recipe_path}: drafter.contract"
    args = dflash2.DFlash2Args.from_config(planning, where)
    if list(args.target_layer_ids) != taps:
        raise InputError(f"{where}: dflash_config.target_layer_ids {list(args.target_layer_ids)} differ from "
                         f"target.taps {taps}")
    for field, mine, theirs in (("hidden_size", args.hidden_size, hidden), ("vocab_size", args.vocab_size, vocab)):
        if mine != theirs:
            raise InputError(f"{where}: {field} {mine} differs from the target contract's {theirs}")
    ranges = head_ranges(recipe, args.vocab_size)
    specs = dflash2.function_specs(args, drafter.context_update, drafter.context_append, drafter.ring, torch.float16,
                                   draft_width=target.graphs.verify, layout=drafter.layout, head_ranges=ranges)

    lines = [f"  drafter dflash2 {drafter.source}: {args.num_hidden_layers} layers, hidden {args.hidden_size}, heads "
             f"{args.num_attention_heads}/{args.num_key_value_heads} (head_dim {args.head_dim}), taps {taps}, "
             f"selector rank {args.selector_rank} top-k {args.selector_top_k}, block {args.block_size}, ring "
             f"{drafter.ring}, mask scale {drafter.mask_scale}, quantization {drafter.quantization.method}, layout "
             f"{drafter.layout}"]
    if unpinned:
        lines.append(f"    not pinned (read from config.json at build time): {', '.join(unpinned)}")
    else:
        lines.append(f"    mask id {args.mask_token_id}, {len([w for w in args.layer_windows if w])} sliding layers "
                     f"(windows {sorted({w for w in args.layer_windows if w})})")
        lines += size_lines(args.parameter_count, recipe.backends, "    ")
    planned = None if unpinned else DrafterPlan(drafter, None, args, args.architecture, specs, ranges)
    return lines + drafter_function_lines(specs, drafter_contract("dflash2", args, drafter, ranges)), planned


def rotation_lines(args, target, block: int | None) -> list[str]:
    """The plan's line on the rotations an ``exact`` target computes a token: one transform before each rotated
    linear (every quantized one) and one after the embedding lookup, each log2(block) butterfly additions and two
    multiplications (the signs, the scale) a feature; against the linears' multiply-adds."""
    if block is None:
        return ["  rotations: pin prism.hadamard.block_size (the pack's hadamard.json) in target.contract to plan "
                "their work"]
    with parameters_on_meta():
        core = family_of(args).build_core(args, target)
    keep = kept_modules(core, target.quantization)
    linears = [m for n, m in core.named_modules() if isinstance(m, nn.Linear) and n not in keep]
    features = sum(m.in_features for m in linears) + args.hidden_size  # the embedding's rows
    work = (block.bit_length() - 1 + 2) * features
    linear_work = sum(m.in_features * m.out_features for m in linears)
    return [f"  rotations (block {block}, butterflies): {len(linears) + 1} signed Hadamard transforms a token over "
            f"{features:,} features: {work:,} additions and multiplications a token, {100 * work / linear_work:.2f}% "
            f"of the linears' {linear_work:,} multiply-adds"]
