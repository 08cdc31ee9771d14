"""The build pipeline: recipe -> plan -> modules -> packages -> checks -> compile -> manifest -> publish.

Each stage is a plain function; ``spec-convert build`` calls ``make_plan`` then ``build``.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from convert import progress
from convert.cache import BuildCache
from convert.errors import GateError
from convert.export.functions import compute_copy
from convert.export.quantized import apply_quantized, release_dense_weights
from convert.export.spec import SHIP_DTYPE
from convert.inputs.sources import (
    file_records,
    load_tensors,
)
from convert.models.part import Part
from convert.pipeline.bundle import MANIFEST, file_entry, staging
from convert.pipeline.drafter_build import build_drafter
from convert.pipeline.gate_cache import GatePasses, gate, print_gate
from convert.pipeline.package_pool import package_jobs, pool_width
from convert.pipeline.packaging import package_formats
from convert.pipeline.partition import MB, held_target_bytes
from convert.pipeline.plan import Plan
from convert.pipeline.plan_costs import CHAINED_RUN_PARAMETERS, cpu_seconds
from convert.pipeline.record import (
    copy_extras,
    function_record,
    package_entry,
    quantization_record,
    target_manifest,
    write_drafter_interface,
)
from convert.processes import InBackground, in_fresh_process, in_this_process
from convert.progress import console, stage
from convert.runtime.host import TargetDriver
from convert.torch_device import describe, free_bytes
from convert.verify import checks, gates, placement
from convert.verify.checks import part_calls, recorded_calls, short_schedule
from convert.verify.placement import REFERENCE
from convert.verify.report import ArtifactResult, GateReport
from convert.weights import rescale
from convert.weights.quantize import QuantizeResult, pack_modules, quantize_checkpoint
from convert.weights.shipped import HeldTarget, PartLoader
from convert.weights.stream import skeleton
from convert.weights.target import TargetModules, build_modules
from manifests import identity
from manifests.identity import REPORT_FILE
from manifests.schema import Manifest, Rescale


@dataclass(frozen=True)
class BuiltTarget:
    """What building the target gives the drafter stage: its source files, its manifest (``finished``: made, or where
    a parted target's packaging pool runs beside the drafter stage, ``_overlaps``, made once the pool is done: the
    first call waits for it), and (when a drafter needs them) the whole modules as shipped, with, for a parted
    target, a loader of their decoder layers again (None: the modules' own)."""

    source_files: list
    finished: Callable[[], Manifest]
    modules: TargetModules | None
    reload_layers: Callable[[], nn.ModuleList] | None = None
    pool_beside: bool = False  # the target's packaging pool still runs (in a thread) until ``finished`` is called


def _made(value):
    return lambda: value


def shipped_modules(plan: Plan, cache: BuildCache | None = None,
                    file_hashes: dict[str, str] | None = None) -> tuple[TargetModules, dict | None]:
    """The export modules with the weights exactly as they ship (fp16, quantized where the recipe says, the range
    scales folded: ``modules.rescale``), and the manifest's quantization record. The scales are chosen first, on the
    checkpoint's own fp16 weights (``range_stage``); quantization then streams from the checkpoint with them folded
    in and is cached per unit (``convert/weights/quantize.py``) before the modules are loaded; ``file_hashes``: sha256
    by source file name, when known."""
    quant = plan.recipe.target.quantization
    scales, measured, record = rescale.Scales(), None, None
    if plan.recipe.target.rescale:
        measured = _load_modules(plan, rescale.Scales())
        scales, record = range_stage(plan, measured)
        if not scales.identity:
            measured = None
    result = quantize_stage(plan, cache or BuildCache(), file_hashes, in_memory=True, scales=scales)
    modules = measured if measured is not None else _load_modules(plan, scales)
    modules.rescale = record
    if result is None:
        return modules, None
    apply_quantized(modules.core, dict(result.items()))
    return modules, quantization_record(quant, result, modules)


def _load_modules(plan: Plan, scales: rescale.Scales) -> TargetModules:
    folded = "" if scales.identity else ", the range scales folded"
    with stage(f"load weights (safetensors, memory-mapped{folded})"):
        tensors = load_tensors(plan.snapshot.directory)
        modules = build_modules(plan.args, plan.recipe.target, tensors, SHIP_DTYPE, plan.layout, scales)
        del tensors
    return modules


def exact_result(plan: Plan, scales: rescale.Scales | None = None) -> QuantizeResult:
    """``target.quantization.method: exact``: the pack's own codes, scales and rotations, nothing re-quantized; with
    range ``scales``, each packed matrix's group scales times its power of two (``rescale.module_factors``: exact in
    fp16, or refused naming the tensor), as the dense tensors take theirs when they are read."""
    scales = scales or rescale.Scales()
    folded = "" if scales.identity else ", the range scales folded into its group scales"
    with stage(f"read the scales and rotations of {plan.snapshot.packed.name} (exact: nothing is re-quantized; the "
               f"codes are read a unit at a time{folded})"):
        packed = pack_modules(plan.snapshot.packed)
        factors = {} if scales.identity else {
            name: f for name, f in rescale.module_factors(
                skeleton(plan.args, plan.recipe.target, SHIP_DTYPE, SHIP_DTYPE, "cpu"), scales).items()
            if name in packed}
        result = QuantizeResult({}, None, None, pack=plan.snapshot.packed, factors=factors)
        for name in factors:  # refused here, before anything runs, where fp16 cannot hold a folded scale
            result.unit(name)
        return result


def parts_loader(plan: Plan, cache: BuildCache, stack: ExitStack, file_hashes: dict[str, str] | None = None):
    """A ``convert.weights.shipped.PartLoader`` of the plan's target as the build ships it: the range scales chosen
    (``streamed_range_stage``) and folded, quantized (when the recipe says so) into ``cache``, or into a scratch cache
    beside the output (removed when ``stack`` closes) when it is disabled (``--no-cache``)."""
    scales = streamed_range_stage(plan)[0] if plan.recipe.target.rescale else rescale.Scales()
    return PartLoader(plan, quantize_stage(plan, parts_cache(plan, cache, stack), file_hashes, scales=scales), scales)


def parts_cache(plan: Plan, cache: BuildCache, stack: ExitStack) -> BuildCache:
    """Where a parted target's quantized weights go: ``cache``, or when it is disabled (``--no-cache``) a scratch
    cache beside the output, removed when ``stack`` closes (the parts read their weights back from its entries)."""
    if cache.enabled or not plan.recipe.target.quantization.format:
        return cache
    plan.output.resolve().parent.mkdir(parents=True, exist_ok=True)
    return BuildCache(Path(stack.enter_context(tempfile.TemporaryDirectory(
        prefix=".quantize-", dir=plan.output.resolve().parent))))


def quantize_stage(plan: Plan, cache: BuildCache, file_hashes: dict[str, str] | None,
                   in_memory: bool = False, scales: rescale.Scales | None = None) -> QuantizeResult | None:
    """The quantize stage (None: the recipe does not quantize): a pre-quantized pack's own weights (``exact``), or
    ``quantize_checkpoint`` into ``cache``, its weights held or (``in_memory`` False: a parted target) in the cache's
    entries only."""
    quant = plan.recipe.target.quantization
    if not quant.format:
        return None
    if quant.format == "exact2":
        return exact_result(plan, scales)
    return quantize_checkpoint(plan.snapshot.directory, plan.args, plan.recipe.target, plan.layout, quant,
                               plan.recipe_path.resolve().parent, cache=cache, in_memory=in_memory,
                               file_hashes=file_hashes, scales=scales, device=plan.torch_device)


def build(plan: Plan, cache: BuildCache | None = None, strict: bool = False) -> Manifest:
    """Build, gate, check and publish the bundle; returns the target's manifest. Raises InputError / GateError.

    With a drafter the bundle holds ``target/`` and ``drafter/``, and the pair check runs before publishing.
    ``strict``: any finding of the placement lint fails the build (nothing is published).
    """
    failed_report = plan.output.resolve().parent / f"{plan.output.name}.{REPORT_FILE}"
    cache = cache or BuildCache()
    progress.start_clock()
    with progress.phases(build_phases(plan), phase_estimates(plan)), staging(plan.output) as tmp, \
            ExitStack() as stack:
        target_dir = tmp / plan.target_dir.relative_to(plan.output)
        target_dir.mkdir(exist_ok=True)
        built = _build_target(plan, target_dir, failed_report, cache, stack)
        if plan.drafter:
            progress.phase("drafter")
            drafter_manifest = build_drafter(plan, built.modules, built.source_files, built.finished, target_dir,
                                             tmp / "drafter", cache, built.reload_layers,
                                             side_by_side=not built.pool_beside)
        manifest = built.finished()  # made by now wherever the drafter stage asked for it
        manifests = [manifest]
        if plan.drafter:
            manifests.append(drafter_manifest)
            progress.phase("pair check")
            with stage("check-pair: the drafter's binding against the target bundle"):
                problems = identity.pair_mismatches(drafter_manifest, manifest, target_dir)
            if problems:
                raise GateError(f"check-pair: {problems[0]}")
        ane = plan.recipe.target.layout == "ane" or (plan.drafter is not None and plan.drafter.config.layout == "ane")
        findings = report_placement(manifests, listed=ane)
        if strict and findings:
            raise GateError(f"--strict: the placement lint found {len(findings)} findings, the first {findings[0]} "
                            "(docs/layouts.md); nothing was published")
    return manifest


def phase_estimates(plan: Plan) -> dict[str, float]:
    """The plan's estimated seconds of the phases it has rates for (``plan.cpu_seconds``, on the CPU machine): what a
    log's heartbeat counts the time left from where no counted units run."""
    seconds = cpu_seconds(plan)
    names = {"quantize": "weights", "gate": "numeric gate", "packaging": "packages"}
    return {names[stage]: value for stage, value in seconds.items()}


def build_phases(plan: Plan) -> list[str]:
    """The phases of ``build``, in order (``convert.progress.phases``: the live display says which runs)."""
    return ["sources", "weights", "numeric gate", "packages", "manifest"] + \
        (["drafter", "pair check"] if plan.drafter else [])


def report_placement(manifests: list[Manifest], listed: bool) -> list[str]:
    """Print the placement lint's findings of every package (``convert/verify/placement.py``): a count per package,
    each finding too when ``listed`` (the ane layout, which means to have none); returns them all, each naming its
    package."""
    findings = []
    for manifest in manifests:
        for package in manifest.packages:
            if package.placement is None:
                continue
            count = f"{len(package.placement)} findings" if package.placement else "no finding"
            note = f"; {placement.meaning(placement.layout_of(manifest.functions), len(package.placement))}" \
                if package.placement else ""
            console.print(f"placement lint ({package.format} {package.path}): {count} against {REFERENCE}{note}")
            findings += [f"{package.path}: {finding}" for finding in package.placement]
            if listed:
                for finding in package.placement:
                    console.print(f"  {finding}")
    return findings


def _build_target(plan: Plan, out: Path, failed_report: Path, cache: BuildCache, stack: ExitStack) -> BuiltTarget:
    """One package per format from the whole modules in memory; a parted target part by part (``_build_parts``)."""
    progress.phase("sources")
    with stage("hash source files"):
        source_files = file_records(plan.snapshot.source)
    progress.phase("weights")
    if len(plan.parts) > 1:
        return _build_parts(plan, out, failed_report, cache, source_files, stack)
    modules, quantization = shipped_modules(plan, cache, {r.path: r.sha256 for r in source_files})

    def gated(_passes, settings) -> GateReport:
        report = gates.gate_target(plan, modules, settings)
        report.rescale = modules.rescale
        return report

    report = gate(plan, cache, source_files, gated, failed_report)
    progress.phase("packages")
    packages = []
    for done in package_formats(plan.recipe.backends, modules, out, plan.recipe.name, cache=cache):
        if done.format == "coreai":
            report.artifact = _artifact_of_whole(plan, modules, done, report, failed_report)
        packages.append(package_entry(done.format, done.path, out, done.check, done.compiled))
    manifest = _finish_target(plan, out, source_files, modules, packages, None, quantization, report)
    return BuiltTarget(source_files, _made(manifest), modules)


def _artifact_of_whole(plan: Plan, modules: TargetModules, done, report: GateReport, failed_report: Path):
    """The artifact gate of a whole target: its Core AI package check's run (``_held_to_reference``)."""
    return _held_to_reference(plan, gates.artifact_from_check(done.path.name, done.check, done.check_seconds),
                              modules, report, failed_report)


def _held_to_reference(plan: Plan, result: ArtifactResult, modules: TargetModules, report: GateReport,
                       failed_report: Path) -> ArtifactResult:
    """An artifact gate's run, and its greedy ids (when it made a greedy run from the check's prompt) against the fp32
    reference's (``gates.artifact_against_reference``); a failure of either writes the report and fails the build."""
    if result.passed and result.greedy_ids:
        with stage("artifact gate: the package's greedy ids against the fp32 reference's"):
            prompt = checks.check_prompt(modules.widths, modules.core.args.vocab_size)
            result = gates.artifact_against_reference(result, gates.load_reference(plan.snapshot.directory), prompt,
                                                      result.greedy_ids, report.thresholds.near_tie_margin)
    if not result.passed:
        report.artifact = result
        print_gate(report, failed_report)
    return result


def range_stage(plan: Plan, modules: TargetModules) -> tuple[rescale.Scales, Rescale]:
    """The fp32 peaks of ``modules`` on the gate's first ``target.gate.device_samples`` windows, and the
    function-preserving scales that bring them within the layout's device limits (``gates.range_scales``); raises
    ``RangeError`` (a failed gate: nothing is published) where none reaches."""
    _, data = gates.recipe_gate(plan)
    device = gates.DEVICE_OF_LAYOUT[plan.recipe.target.layout]
    windows = plan.recipe.target.gate.device_samples
    with stage(f"range: fp32 peaks on {max(1, windows)} gate windows against the {device}'s limits"):
        return gates.range_scales(modules, data, device, windows, plan.torch_device)


def _finish_target(plan: Plan, out: Path, source_files, modules: TargetModules, packages, parts, quantization,
                   report: GateReport) -> Manifest:
    """The gate report, the extras, the drafter interface and the manifest (``modules``: at least the whole
    embedding and lm_head, as shipped). The report holds the gate's timings: the manifest hashes it in its
    ``records``, outside the export id, so it is written first and not changed after."""
    progress.phase("manifest")
    records = [file_entry(out, report.write_json(out / REPORT_FILE))]
    extra_files = copy_extras(plan.snapshot.directory, out)
    target = plan.recipe.target
    feeds_drafter = plan.drafter is not None or bool(target.taps) or target.hidden
    host_lookup = target.layout == "ane"  # the host looks the embedding rows up in the bundle's table
    interface = write_drafter_interface(plan, modules, out) if feeds_drafter or host_lookup else None
    manifest = target_manifest(plan, source_files, modules, packages, parts, extra_files, quantization, report,
                               interface, records)
    (out / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest


def _build_parts(plan: Plan, out: Path, failed_report: Path, cache: BuildCache, source_files,
                 stack: ExitStack) -> BuiltTarget:
    """A parted target, which may be larger than host memory, with at most a part (or one decoder layer) of it
    loaded at a time: quantized into the cache (a scratch one beside the output under ``--no-cache``), gated
    layer by layer (``gates.gate_streamed``), packaged part by part (``convert.weights.shipped.PartLoader``). Above
    ``CHAINED_RUN_PARAMETERS`` the quantize stage, the gate and each part run in a fresh process
    (``convert.processes``): this one holds none of their memory. When a drafter needs them, the whole modules come
    with the manifest, their quantized weights as packed codes, with a loader of their decoder layers again (the
    drafter stage lets them go while it quantizes the drafter; ``stack`` keeps a scratch cache until then). Where the
    drafter stage computes on an accelerator (``_overlaps``), a packaging pool runs beside it: the target's manifest
    is made when the drafter stage asks for it (``BuiltTarget.finished``), and ``stack`` stops the pool when the
    build fails first."""
    run = in_fresh_process if plan.parameter_count > CHAINED_RUN_PARAMETERS else in_this_process
    scales, ranged = run(streamed_range_stage, plan) if plan.recipe.target.rescale else (rescale.Scales(), None)
    result = run(quantize_stage, plan, parts_cache(plan, cache, stack), {r.path: r.sha256 for r in source_files},
                 False, scales)

    def gated(passes, settings) -> GateReport:
        report = run(_gate_parts, plan, result, scales, passes, settings)
        report.rescale = ranged
        return report

    report = gate(plan, cache, source_files, gated, failed_report)
    progress.phase("packages")
    loader = PartLoader(plan, result, scales)
    packaged, pool_beside = _package_parts(plan, loader, out, cache, report, failed_report,
                                           stack if _overlaps(plan) else None)

    def finish() -> Manifest:
        packages, parts = packaged()
        # the record reads every unit back (the tables' codes too) and needs only the core's names and shapes: from
        # the outline, before the tables load (measured at the 27B width: the finish peaked at 13.9 GiB the other way
        # round, 9.2 GiB this way)
        quantization = quantization_record(plan.recipe.target.quantization, result, loader.outline) \
            if result is not None else None
        with stage("load the embedding and the lm_head (identity hashes, drafter interface)"):
            tables = loader.load([tables_part(plan.args)])[0]
        return _finish_target(plan, out, source_files, tables, packages, parts, quantization, report)

    finished = functools.cache(finish)  # made once: the drafter stage's call and the build's
    if not pool_beside:
        finished()  # before the drafter stage loads the target: the tables are let go first
    if not plan.drafter:
        return BuiltTarget(source_files, finished, None)

    def lean_whole() -> TargetModules:
        return loader.load([Part.whole(plan.args)], lean=True)[0]

    with stage("load the whole target for the drafter stage, its quantized weights as packed codes"):
        whole = lean_whole()
    return BuiltTarget(source_files, finished, whole, lambda: lean_whole().core.layers, pool_beside)


def _overlaps(plan: Plan) -> bool:
    """Whether a parted target's packaging pool (``_pooled_parts``) runs beside the drafter stage: where that stage
    computes on an accelerator. The pool's jobs (the converters, the Core AI runtime's check) are the CPU's; on the
    CPU the two would share its cores."""
    return plan.drafter is not None and plan.torch_device.type != "cpu"


def _gate_parts(plan: Plan, result: QuantizeResult | None, scales: rescale.Scales, passes: GatePasses | None,
                settings) -> GateReport:
    return gates.gate_streamed(plan, gate_loader(plan, result, scales), passes, settings)


HELD_SHARE = 0.5
"""The share of an accelerator's free memory the held target may take (the rest: the windows' states, a piece's
compute copy and its weight blocks)."""


def gate_loader(plan: Plan, result: QuantizeResult | None, scales: rescale.Scales) -> PartLoader | HeldTarget:
    """The streamed gate's pieces: on an accelerator with room for it (``HELD_SHARE`` of its free memory), views of
    the whole target held there as its shipped codes (``HeldTarget``: read once, not once a greedy pass); otherwise
    (the CPU, or too little room) each piece read from the checkpoint when it computes."""
    loader, device = PartLoader(plan, result, scales), plan.torch_device
    if device.type == "cpu":
        return loader
    need, free = held_target_bytes(plan.args, plan.recipe.target, lean=True), free_bytes(device)
    if need > HELD_SHARE * free:
        progress.line(f"the target's codes (about {need / 1e9:.1f} GB) do not fit {HELD_SHARE:.0%} of "
                      f"{describe(device)}'s free {free / 1e9:.1f} GB: the gate reads each piece for each pass")
        return loader
    with stage(f"hold the target on {describe(device)} as its shipped codes (about {need / 1e9:.1f} GB)"):
        return HeldTarget(loader, device)


def streamed_range_stage(plan: Plan) -> tuple[rescale.Scales, Rescale]:
    """``range_stage`` of a parted target, one piece at a time (``gates.streamed_range_scales``) over the
    checkpoint's weights as they are."""
    _, data = gates.recipe_gate(plan)
    device = gates.DEVICE_OF_LAYOUT[plan.recipe.target.layout]
    windows = plan.recipe.target.gate.device_samples
    with stage(f"range: fp32 peaks on {max(1, windows)} gate windows against the {device}'s limits, one piece at a "
               "time"):
        return gates.streamed_range_scales(PartLoader(plan, None), data, device, windows, plan.torch_device)


def tables_part(args) -> Part:
    """The embedding and the head without the layers: what the identity hashes and the drafter interface read."""
    return Part("tables", args.vocab_size, embedding=(0, args.vocab_size), head=(0, args.vocab_size))


def _package_parts(plan: Plan, loader, out: Path, cache: BuildCache, report: GateReport, failed_report: Path,
                   beside: ExitStack | None = None) -> tuple[Callable[[], tuple[list[dict], list[dict]]], bool]:
    """Package, check and compile each part (``convert/pipeline/partition.py``), no package over
    ``target.max_part_mb``, each part's check replaying the calls it made in the chained torch parts. The Core AI
    checks are the artifact gate: the parts chained on the runtime in lockstep with the torch parts, or, above
    ``CHAINED_RUN_PARAMETERS``, each part replayed on its own (``checks.short_schedule``). With a pool wider than one
    (``package_pool.pool_width``: ``build --jobs``, the cores and the host memory; by default above
    ``CHAINED_RUN_PARAMETERS`` alone) every part's calls are recorded first and the (part, format) jobs run side by
    side (``_pooled_parts``); else one part after the other: above
    ``CHAINED_RUN_PARAMETERS`` each part loaded, recorded and packaged alone in a fresh process (``_package_part``).
    ``beside``: the pool runs in the background (``processes.InBackground``, stopped by this stack when the build
    fails first), at a width that leaves room for the drafter stage. Returns a function that gives the package
    entries and the manifest's parts (waiting for the pool), and whether the pool runs in the background."""
    target, parts = plan.recipe.target, plan.parts
    short = plan.parameter_count > CHAINED_RUN_PARAMETERS
    # by default a pool only above CHAINED_RUN_PARAMETERS: below, a part packages in seconds, about what a pool
    # process takes to start (its imports: 5 s measured), and the formats of a part already run side by side
    held = plan.drafter_stage_bytes if beside is not None else 0
    width, why = pool_width(plan, plan.package_jobs, beside=held) if short or plan.package_jobs else (1, "")
    if width > 1:
        waited = _pooled_parts(plan, loader, out, cache, short, width, why, beside)
    else:
        waited = _made((None, _fresh_parts(plan, loader, out, cache)) if short else
                       _chained_parts(plan, loader, out, cache))

    def packaged() -> tuple[list[dict], list[dict]]:
        pieces, results = waited()
        packages = [entry for entries, _, _ in results for entry in entries]
        checked = [done for _, _, coreai in results for done in coreai]
        if checked:
            what = f"{len(checked)} parts chained on the Core AI runtime" if not short else \
                f"{len(checked)} parts, each replayed on its own (the chained run is above " \
                f"{CHAINED_RUN_PARAMETERS:,} parameters)"
            with stage(f"artifact gate: {what}"):
                result = gates.artifact_of_parts(checked, parts, pieces, target.taps, loader.outline, not short)
            report.artifact = _held_to_reference(plan, result, loader.outline, report, failed_report)
        return packages, [record for _, record, _ in results]

    return packaged, width > 1 and beside is not None


def _recorded(plan: Plan, loader: PartLoader, short: bool) -> tuple[list | None, list[list]]:
    """Every part's check calls, recorded before any is packaged: the torch parts chained in this process (their
    pieces, which the chained artifact gate runs again), or above ``CHAINED_RUN_PARAMETERS`` each part alone in a fresh
    process from the previous part's rows (``record_part``; no piece is kept)."""
    parts = plan.parts
    if short:
        schedule = short_schedule_inputs(loader, plan.args.vocab_size)
        rows, calls = [None] * len(schedule), []
        for i in range(len(parts)):
            part_calls_, rows = in_fresh_process(record_part, plan, loader.result, i, schedule, rows, loader.scales)
            calls.append(part_calls_)
        return None, calls
    with stage(f"record the calls each part's check replays ({len(parts)} parts chained in torch)"):
        pieces = loader.load(parts)
        return pieces, recorded_calls(parts, pieces, plan.recipe.target.taps, loader.outline.contract,
                                      plan.args.vocab_size, short)


def _pooled_parts(plan: Plan, loader: PartLoader, out: Path, cache: BuildCache, short: bool, width: int,
                  why: str, beside: ExitStack | None = None) -> Callable[[], tuple[list | None, list[tuple]]]:
    """Every part's calls recorded (``_recorded``), then its (part, format) jobs in a pool ``width`` wide
    (``package_pool.package_jobs``), in the background with ``beside`` (which stops it if the build fails first);
    a function that gives the results in part order (waiting for the pool), each as ``_package_piece`` returns it."""
    pieces, calls = _recorded(plan, loader, short)
    jobs = functools.partial(package_jobs, plan, loader.result, loader.scales, out, cache, calls, width, why,
                             fresh_each=short)
    if beside is None:
        done = _made(jobs())
    else:
        running = InBackground(jobs)
        beside.callback(running.stop)
        done = running.result

    def results() -> tuple[list | None, list[tuple]]:
        found = done()
        return pieces, [_part_results(plan, part, [found[i, name].packaged for name in plan.recipe.backends],
                                      found[i, plan.recipe.backends[0]].functions, out)
                        for i, part in enumerate(plan.parts)]

    return results


def _fresh_parts(plan: Plan, loader: PartLoader, out: Path, cache: BuildCache) -> list[tuple]:
    """Above ``CHAINED_RUN_PARAMETERS``, one part after the other: each loaded, recorded and packaged alone in a fresh
    process (``_package_part``)."""
    schedule = short_schedule_inputs(loader, plan.args.vocab_size)
    rows, results = [None] * len(schedule), []
    for i in range(len(plan.parts)):
        *result, rows = in_fresh_process(_package_part, plan, loader.result, i, out, cache, schedule, rows,
                                         loader.scales)
        results.append(tuple(result))
    return results


def _chained_parts(plan: Plan, loader: PartLoader, out: Path, cache: BuildCache) -> tuple[list, list[tuple]]:
    """Every part loaded here, its calls recorded chained (``_recorded``), then packaged one part after the other, each
    part's formats side by side (``package_formats``)."""
    pieces, calls = _recorded(plan, loader, False)
    return pieces, [_package_piece(plan, part, piece, part_calls_, out, cache)
                    for part, piece, part_calls_ in zip(plan.parts, pieces, calls, strict=True)]


def short_schedule_inputs(loader: PartLoader, vocab: int) -> list[tuple[str, dict]]:
    """``checks.short_schedule`` as (function, whole-target inputs) through the loader's host contract: what each part
    of a target above ``CHAINED_RUN_PARAMETERS`` records and replays."""
    outline = loader.outline
    driver = TargetDriver(None, outline.widths, outline.contract)
    return [(f, driver.inputs(f, tokens, p0)) for f, tokens, p0 in short_schedule(outline.widths, vocab)]


def record_part(plan: Plan, result: QuantizeResult | None, index: int, schedule: list, rows: list,
                scales: rescale.Scales | None = None, rounds: bool | None = None) -> tuple[list, list]:
    """Part ``index`` of a target above ``CHAINED_RUN_PARAMETERS`` alone: its calls of the short ``schedule`` recorded
    from the previous part's ``rows``; the calls, and the rows for the next part. ``rounds``: ``checks.part_calls``'
    (where no runtime can be asked: ``bench/gpu_stages.py``)."""
    return _load_recorded(plan, result, index, schedule, rows, scales, rounds)[1:]


def _load_recorded(plan: Plan, result: QuantizeResult | None, index: int, schedule: list, rows: list,
                   scales: rescale.Scales | None, rounds: bool | None = None) -> tuple[TargetModules, list, list]:
    """Part ``index`` loaded, and its calls of the short ``schedule`` recorded on the plan's torch device (a copy of
    the piece there; the piece itself stays on the host, which packages it)."""
    part = plan.parts[index]
    with stage(f"load part {part.name} ({index + 1} of {len(plan.parts)})"):
        piece = PartLoader(plan, result, scales).load([part])[0]
        device = plan.torch_device
        calls, rows = part_calls(piece if device.type == "cpu" else compute_copy(piece, SHIP_DTYPE, device=device),
                                 schedule, rows, rounds)
    return piece, calls, rows


def _package_part(plan: Plan, result: QuantizeResult | None, index: int, out: Path, cache: BuildCache,
                  schedule: list, rows: list,
                  scales: rescale.Scales | None = None) -> tuple[list[dict], dict, list, list]:
    """Part ``index`` of a target above ``CHAINED_RUN_PARAMETERS`` alone: loaded, its calls of the short
    ``schedule`` recorded from the previous part's ``rows`` (``_load_recorded``), its quantized linears' dense weights
    released, packaged one format after the other (their packaging memory in turn). What ``_package_piece`` returns,
    and the rows for the next part."""
    piece, calls, rows = _load_recorded(plan, result, index, schedule, rows, scales)
    release_dense_weights(piece.core)  # packaged from codes and tables: 2 bytes a quantized weight less
    return *_package_piece(plan, plan.parts[index], piece, calls, out, cache, side_by_side=False), rows


def _package_piece(plan: Plan, part: Part, piece: TargetModules, calls: list, out: Path, cache: BuildCache,
                   side_by_side: bool = True) -> tuple[list[dict], dict, list]:
    """One part's packages in every format (each checked against its size limit), its manifest record, and its
    Core AI ``Packaged`` (the artifact gate's)."""
    recipe = plan.recipe
    done = package_formats(recipe.backends, piece, out, f"{recipe.name}.{part.name}", calls, cache,
                           every_function=True, side_by_side=side_by_side)
    return _part_results(plan, part, done, [function_record(spec) for _, spec in piece.functions.values()], out)


def _part_results(plan: Plan, part: Part, done: list, functions: list[dict], out: Path) -> tuple[list[dict], dict,
                                                                                               list]:
    """A part's packaged formats (``done``, in the recipe's order) as its package entries (each checked against its
    size limit), its manifest record (``functions``: its function records) and its Core AI ``Packaged``."""
    target = plan.recipe.target
    entries, coreai = [], []
    for packaged in done:
        entries.append(package_entry(packaged.format, packaged.path, out, packaged.check, packaged.compiled,
                                     part.name))
        _check_part_size(entries[-1], target.max_part_mb)
        if packaged.format == "coreai":
            coreai.append(packaged)
    record = {**part.record(target.taps), "functions": functions, "packages": [e["path"] for e in entries]}
    return entries, record, coreai


def _check_part_size(entry: dict, max_part_mb: float) -> None:
    """No package of a part over the limit (its files, as written)."""
    size = sum(f["size"] for f in entry["files"])
    if size > max_part_mb * MB:
        raise GateError(f"{entry['path']}: {size / MB:.1f} MB, over target.max_part_mb {max_part_mb:g}; the plan "
                        "under-estimated it (lower max_part_mb)")


