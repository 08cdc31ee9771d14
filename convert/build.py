"""The build pipeline: recipe -> plan -> modules -> packages -> checks -> compile -> manifest -> publish.

Each stage is a plain function; ``spec-convert build`` calls ``make_plan`` then ``build``.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from importlib import metadata
from pathlib import Path

import torch

from convert import backends, contract, gates
from convert.backends.base import FunctionSpec, function_lines, size_lines
from convert.bundle import MANIFEST, staging
from convert.cache import BuildCache
from convert.checks import short_schedule
from convert.compress import apply_quantized
from convert.drafter import DrafterPlan, plan_drafter
from convert.errors import GateError, InputError
from convert.gates import GateReport
from convert.hadamard import rotation_lines
from convert.host import TargetDriver
from convert.models import Layout, family_for, family_of
from convert.packaging import package_formats
from convert.parts import (
    BASE_BYTES,
    MB,
    WHOLE_BYTES_PER_PARAMETER,
    Part,
    build_memory_bytes,
    coreai_target,
    manifest_parts,
    memory_line,
    module_chain,
    part_calls,
    plan_parts,
    recorded_calls,
    shipped_line,
)
from convert.parts import plan_lines as parts_lines
from convert.prism import exact_weights, pack_block, read_pack, source_config, unfolded_snapshot
from convert.processes import in_fresh_process, in_this_process
from convert.progress import console, stage
from convert.quantize import QuantizeResult, estimate_lines, quantize_checkpoint, summary
from convert.recipe import Recipe, check_against_model, load_recipe
from convert.sources import (
    Snapshot,
    file_records,
    license_files,
    load_tensors,
    resolve,
    sha256_file,
    tensor_shapes,
)
from convert.target import TargetModules, build_modules, function_specs
from manifests import identity
from manifests.schema import Manifest

SHIP_DTYPE = torch.float16
# Above this many parameters a parted target's artifact check replays a few rows on each part on its own: the Linux
# Core AI runtime emulates fp16 (about 24 s for one 64-token call at 11.8M parameters, docs/benchmarks.md), so the
# chained run of every part would take hours at 27B.
CHAINED_RUN_PARAMETERS = 50_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
COPIED_CONFIG_FILES = ("config.json", "generation_config.json")
TOOLCHAIN_PACKAGES = ("torch", "coreai-core", "coreai-torch", "coremltools", "transformers", "safetensors", "numpy")


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
    def state_bytes(self) -> int:
        """Every state of the target (KV caches, and a hybrid's conv, recurrent and pending states) as shipped."""
        return sum(s.nbytes for s in self.specs[0].states)

    @cached_property
    def peak_memory_bytes(self) -> int:
        """Estimate of the build's peak host memory (``convert/parts.py``: measured costs), the drafter stage's
        included; computed once (it builds the target's parameterless core)."""
        return max(build_memory_bytes(self.args, self.recipe.target, self.parts, self.specs), self.drafter_stage_bytes)

    @property
    def drafter_stage_bytes(self) -> int:
        """Host memory of the drafter stage (0 without a drafter): it runs the whole target, fp16 and an fp32 copy
        (calibration, acceptance, the A/B), beside the drafter's own whole build."""
        if not self.drafter:
            return 0
        return BASE_BYTES + 6 * self.parameter_count + WHOLE_BYTES_PER_PARAMETER * self.drafter.args.parameter_count


def make_plan(recipe_path: Path, output: str | None = None, cache_root: Path | None = None) -> Plan:
    """Validate the recipe and the checkpoint's config and headers; reads no weights (but a Prism pack's, which is
    unfolded once into ``cache_root``, default the build cache's directory: ``convert.prism.unfolded_snapshot``)."""
    recipe = load_recipe(recipe_path)
    snapshot = resolve(recipe.target.source, recipe_path.resolve().parent)
    contract.check(source_config(snapshot.directory), recipe.target.contract, str(snapshot.directory / "config.json"),
                   "target.contract")
    snapshot = unfolded_snapshot(snapshot, recipe.target.quantization, str(recipe_path),
                                 recipe.target.max_host_memory_gb * 1e9, cache_root)
    config_path = snapshot.directory / "config.json"
    family = family_for(snapshot.config(), str(config_path))
    args = family.Args.from_config(snapshot.config(), where=str(config_path))
    check_against_model(recipe, args.num_hidden_layers, args.max_position_embeddings, recipe_path)
    layout = family.sanitize(tensor_shapes(snapshot.directory), args, f"checkpoint {snapshot.directory}")
    if not (snapshot.directory / "tokenizer.json").is_file():
        raise InputError(f"{snapshot.directory}: no tokenizer.json; a bundle ships its tokenizer and hashes it")
    checkpoint_bytes = sum(p.stat().st_size for p in snapshot.directory.glob("*.safetensors"))
    out = Path(output or recipe.output or Path("bundles") / recipe.name)
    drafter = plan_drafter(recipe, recipe_path, snapshot, args, SHIP_DTYPE) if recipe.drafter else None
    plan = Plan(recipe, recipe_path, out, snapshot, args, layout, function_specs(args, recipe.target, SHIP_DTYPE),
                checkpoint_bytes, plan_parts(args, recipe.target), drafter)
    _check_host_memory(plan)
    return plan


def _check_host_memory(plan: Plan) -> None:
    """A parted target's packaging fits ``target.max_host_memory_gb`` by construction (``plan_parts``); its streamed
    gate holds every window's states, which the gate data sets: refuse a gate that would not fit, before any work."""
    target = plan.recipe.target
    budget = target.max_host_memory_gb * 1e9
    if plan.parts[0].is_whole or plan.peak_memory_bytes <= budget:
        return
    if plan.drafter_stage_bytes > budget:
        raise InputError(f"{plan.recipe_path}: drafter: the drafter stage runs the whole target in memory (fp16 and "
                         f"an fp32 copy: about {plan.drafter_stage_bytes / 1e9:.0f} GB), over "
                         f"target.max_host_memory_gb {target.max_host_memory_gb:g}; build the target alone here (a "
                         "recipe without the drafter), or the pair on a machine with that memory and a "
                         "max_host_memory_gb to match")
    data = target.gate.data
    raise InputError(f"{plan.recipe_path}: target.gate.data: the streamed gate over {data.samples} x {data.length} "
                     f"tokens needs about {plan.peak_memory_bytes / 1e9:.1f} GB of host memory (every window's "
                     f"states, the largest piece of the target in fp16 and fp32), over target.max_host_memory_gb "
                     f"{target.max_host_memory_gb:g}; lower samples or length, or raise max_host_memory_gb")


def shipped_modules(plan: Plan, cache: BuildCache | None = None,
                    file_hashes: dict[str, str] | None = None) -> tuple[TargetModules, dict | None]:
    """The export modules with the weights exactly as they ship (fp16, quantized where the recipe says), and the
    manifest's quantization record. Quantization streams from the checkpoint and is cached per unit
    (``convert/quantize.py``) before the modules are loaded; ``file_hashes``: sha256 by source file name, when
    known."""
    quant = plan.recipe.target.quantization
    result = quantize_stage(plan, cache or BuildCache(), file_hashes, in_memory=True)
    with stage("load weights (safetensors, memory-mapped)"):
        tensors = load_tensors(plan.snapshot.directory)
        modules = build_modules(plan.args, plan.recipe.target, tensors, SHIP_DTYPE, plan.layout)
        del tensors
    if result is None:
        return modules, None
    apply_quantized(modules.core, result.weights)
    return modules, _quantization_record(quant, result, modules)


def exact_result(plan: Plan) -> QuantizeResult:
    """``target.quantization.method: exact``: the pack's own codes, scales and rotations, nothing re-quantized."""
    with stage(f"read the codes and scales of {plan.snapshot.packed.name} (exact: nothing is re-quantized)"):
        return QuantizeResult(exact_weights(read_pack(plan.snapshot.packed)), None, None)


def gate(plan: Plan, modules: TargetModules, report_path: Path | None) -> GateReport:
    """The numeric gate of the modules against the transformers reference; prints its table; fails closed
    (``GateError``) after writing the report to ``report_path`` when given."""
    report = gates.gate_target(plan, modules)
    _print_gate(report, report_path)
    return report


def _print_gate(report: GateReport, report_path: Path | None) -> None:
    """Print the gate's table; fail closed (``GateError``) after writing the report to ``report_path`` if given."""
    console.print(report.table())
    if report_path is not None and not report.passed:
        report.write_json(report_path)
    report.raise_if_failed()


def gate_bundle(recipe_path: Path, bundle: Path | None, report_path: Path) -> GateReport:
    """``spec-convert gate``: the statistical gate on modules rebuilt from the recipe, and with a bundle the
    artifact gate on its .aimodel, after checking the rebuilt weights are the bundle's (lm_head, embeddings). A
    parted target is gated layer by layer; its parts are chained on the runtime up to ``CHAINED_RUN_PARAMETERS``
    (above, the build's per-part replays are its artifact check)."""
    from convert.inspect import open_target

    manifest = open_target(bundle, "gate --bundle", ("coreai",)) if bundle is not None else None
    plan = make_plan(recipe_path)
    names = [p.path for p in manifest.packages if p.format == "coreai"] if manifest else []
    if manifest is not None and bool(manifest.parts) != (len(plan.parts) > 1):
        raise InputError(f"{bundle}: ships {len(manifest.parts or []) or 'one package per format, not'} parts, and "
                         f"{recipe_path} plans {len(plan.parts)}; use the recipe the bundle was built from")
    with ExitStack() as stack:
        if len(plan.parts) > 1:
            loader = parts_loader(plan, BuildCache(), stack)
            report = gates.gate_streamed(plan, loader)
            modules = loader.load([tables_part(plan.args)])[0]
        else:
            modules, _ = shipped_modules(plan)
            report = gates.gate_target(plan, modules)
        if manifest is not None:
            weights_match(manifest, modules, bundle, recipe_path)
        if names and manifest.parts and plan.parameter_count <= CHAINED_RUN_PARAMETERS:
            parts = manifest_parts(manifest)
            reference = module_chain(parts, loader.load(parts), plan.recipe.target.taps)
            with stage(f"artifact gate: {len(names)} parts chained on the Core AI runtime"), \
                    coreai_target(bundle, manifest) as runtime:
                report.artifact = gates.lockstep_result(runtime, reference, loader.outline, ", ".join(names),
                                                        gates.PARTS_CHAINED)
        elif names and manifest.parts:
            console.print(f"  artifact gate not rerun: above {CHAINED_RUN_PARAMETERS:,} parameters the build replays "
                          "each part on the runtime (the bundle's gate_report.json)")
        elif names:
            with stage(f"artifact gate: {names[0]} on the Core AI runtime"):
                report.artifact = gates.artifact_gate(bundle / names[0], modules)
    console.print(report.table())
    report.write_json(report_path)
    report.raise_if_failed()
    return report


def parts_loader(plan: Plan, cache: BuildCache, stack: ExitStack, file_hashes: dict[str, str] | None = None):
    """A ``convert.shipped.PartLoader`` of the plan's target: quantized (when the recipe says so) into ``cache``, or
    into a scratch cache beside the output (removed when ``stack`` closes) when it is disabled (``--no-cache``)."""
    from convert.shipped import PartLoader

    return PartLoader(plan, quantize_stage(plan, parts_cache(plan, cache, stack), file_hashes))


def parts_cache(plan: Plan, cache: BuildCache, stack: ExitStack) -> BuildCache:
    """Where a parted target's quantized weights go: ``cache``, or when it is disabled (``--no-cache``) a scratch
    cache beside the output, removed when ``stack`` closes (the parts read their weights back from its entries)."""
    if cache.enabled or not plan.recipe.target.quantization.format:
        return cache
    plan.output.resolve().parent.mkdir(parents=True, exist_ok=True)
    return BuildCache(Path(stack.enter_context(tempfile.TemporaryDirectory(
        prefix=".quantize-", dir=plan.output.resolve().parent))))


def quantize_stage(plan: Plan, cache: BuildCache, file_hashes: dict[str, str] | None,
                   in_memory: bool = False) -> QuantizeResult | None:
    """The quantize stage (None: the recipe does not quantize): a pre-quantized pack's own weights (``exact``), or
    ``quantize_checkpoint`` into ``cache``, its weights held or (``in_memory`` False: a parted target) in the cache's
    entries only."""
    quant = plan.recipe.target.quantization
    if not quant.format:
        return None
    if quant.format == "exact2":
        return exact_result(plan)
    return quantize_checkpoint(plan.snapshot.directory, plan.args, plan.recipe.target, plan.layout, quant,
                               plan.recipe_path.resolve().parent, cache=cache, in_memory=in_memory,
                               file_hashes=file_hashes)


def weights_match(manifest: Manifest, modules: TargetModules, bundle: Path, recipe_path: Path) -> None:
    """Refuse modules rebuilt from ``recipe_path`` whose shipped tables are not the bundle's (lm_head, embeddings)."""
    for field, tensor in (("lm_head_sha256", modules.core.lm_head.weight),
                          ("embedding_sha256", modules.core.embed_tokens.weight)):
        if getattr(manifest.weights, field) != identity.tensor_sha256(tensor):
            raise InputError(f"{bundle}: weights.{field} differs from the weights {recipe_path} builds; use the "
                             "recipe the bundle was built from")


def build(plan: Plan, cache: BuildCache | None = None) -> Manifest:
    """Build, gate, check and publish the bundle; returns the target's manifest. Raises InputError / GateError.

    With a drafter the bundle holds ``target/`` and ``drafter/``, and the pair check runs before publishing.
    """
    failed_report = plan.output.resolve().parent / f"{plan.output.name}.{gates.REPORT_FILE}"
    cache = cache or BuildCache()
    with staging(plan.output) as tmp:
        target_dir = tmp / plan.target_dir.relative_to(plan.output)
        target_dir.mkdir(exist_ok=True)
        manifest, modules = _build_target(plan, target_dir, failed_report, cache)
        if plan.drafter:
            from convert.drafter_build import build_drafter

            drafter_manifest = build_drafter(plan, modules, manifest, target_dir, tmp / "drafter", cache)
            with stage("check-pair: the drafter's binding against the target bundle"):
                problems = identity.pair_mismatches(drafter_manifest, manifest, target_dir)
            if problems:
                raise GateError(f"check-pair: {problems[0]}")
    return manifest


def _build_target(plan: Plan, out: Path, failed_report: Path, cache: BuildCache) -> tuple[Manifest, TargetModules]:
    """One package per format from the whole modules in memory; a parted target part by part (``_build_parts``)."""
    with stage("hash source files"):
        source_files = file_records(plan.snapshot.source)
    if len(plan.parts) > 1:
        return _build_parts(plan, out, failed_report, cache, source_files)
    modules, quantization = shipped_modules(plan, cache, {r.path: r.sha256 for r in source_files})
    report = gate(plan, modules, failed_report)
    packages = []
    for done in package_formats(plan.recipe.backends, modules, out, plan.recipe.name, cache=cache):
        if done.format == "coreai":
            report.artifact = gates.artifact_from_check(done.path.name, done.check, done.check_seconds)
        packages.append(package_entry(done.format, done.path, out, done.check, done.compiled))
    return _finish_target(plan, out, source_files, modules, packages, None, quantization, report), modules


def _finish_target(plan: Plan, out: Path, source_files, modules: TargetModules, packages, parts, quantization,
                   report: GateReport) -> Manifest:
    """The gate report, the extras, the drafter interface and the manifest (``modules``: at least the whole
    embedding and lm_head, as shipped)."""
    report.write_json(out / gates.REPORT_FILE)
    extra_files = copy_extras(plan.snapshot.directory, out)
    target = plan.recipe.target
    feeds_drafter = plan.drafter is not None or bool(target.taps) or target.hidden
    interface = _write_drafter_interface(plan, modules, out) if feeds_drafter else None
    manifest = _manifest(plan, source_files, modules, packages, parts, extra_files, quantization, report, interface)
    (out / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest


def _build_parts(plan: Plan, out: Path, failed_report: Path, cache: BuildCache,
                 source_files) -> tuple[Manifest, TargetModules | None]:
    """A parted target, which may be larger than host memory, with at most a part (or one decoder layer) of it
    loaded at a time: quantized into the cache (a scratch one beside the output under ``--no-cache``), gated
    layer by layer (``gates.gate_streamed``), packaged part by part (``convert.shipped.PartLoader``). Above
    ``CHAINED_RUN_PARAMETERS`` the quantize stage, the gate and each part run in a fresh process
    (``convert.processes``): this one holds none of their memory. Returns the manifest, and the whole modules when a
    drafter needs them."""
    from convert.shipped import PartLoader

    run = in_fresh_process if plan.parameter_count > CHAINED_RUN_PARAMETERS else in_this_process
    with ExitStack() as stack:
        result = run(quantize_stage, plan, parts_cache(plan, cache, stack), {r.path: r.sha256 for r in source_files})
        report = run(_gate_parts, plan, result)
        _print_gate(report, failed_report)
        loader = PartLoader(plan, result)
        packages, parts = _package_parts(plan, loader, out, cache, report)
        # the record reads every unit back (the tables' codes too) and needs only the core's names and shapes: from
        # the outline, before the tables load (measured at the 27B width: the finish peaked at 13.9 GiB the other
        # way round, 9.2 GiB this way)
        quantization = _quantization_record(plan.recipe.target.quantization, result, loader.outline) \
            if result is not None else None
        with stage("load the embedding and the lm_head (identity hashes, drafter interface)"):
            tables = loader.load([tables_part(plan.args)])[0]
        manifest = _finish_target(plan, out, source_files, tables, packages, parts, quantization, report)
        del tables
        whole = None
        if plan.drafter:
            with stage("load the whole target for the drafter"):
                whole = loader.load([Part.whole(plan.args)])[0]
    return manifest, whole


def _gate_parts(plan: Plan, result: QuantizeResult | None) -> GateReport:
    from convert.shipped import PartLoader

    return gates.gate_streamed(plan, PartLoader(plan, result))


def tables_part(args) -> Part:
    """The embedding and the head without the layers: what the identity hashes and the drafter interface read."""
    return Part("tables", args.vocab_size, embedding=(0, args.vocab_size), head=(0, args.vocab_size))


def _package_parts(plan: Plan, loader, out: Path, cache: BuildCache,
                   report: GateReport) -> tuple[list[dict], list[dict]]:
    """Package, check and compile each part (``convert/parts.py``), no package over ``target.max_part_mb``, each
    part's check replaying the calls it made in the chained torch parts. The Core AI checks are the artifact gate:
    the parts chained on the runtime in lockstep with the torch parts, or, above ``CHAINED_RUN_PARAMETERS``, each part
    replayed on its own (``checks.short_schedule``), each part loaded, recorded and packaged alone in a fresh process
    (``_package_part``). Returns the package entries and the manifest's parts."""
    target, parts = plan.recipe.target, plan.parts
    short = plan.parameter_count > CHAINED_RUN_PARAMETERS
    pieces = None
    packages, records, checked = [], [], []
    if short:
        outline = loader.outline
        driver = TargetDriver(None, outline.widths, outline.contract)
        schedule = [(f, driver.inputs(f, tokens, p0)) for f, tokens, p0 in short_schedule(outline.widths,
                                                                                           plan.args.vocab_size)]
        rows = [None] * len(schedule)
        for i in range(len(parts)):
            entries, record, coreai, rows = in_fresh_process(_package_part, plan, loader.result, i, out, cache,
                                                             schedule, rows)
            packages += entries
            records.append(record)
            checked += coreai
    else:
        with stage(f"record the calls each part's check replays ({len(parts)} parts chained in torch)"):
            pieces = loader.load(parts)
            calls = recorded_calls(parts, pieces, target.taps, loader.outline.contract, plan.args.vocab_size, short)
        for part, piece, part_calls_ in zip(parts, pieces, calls, strict=True):
            entries, record, coreai = _package_piece(plan, part, piece, part_calls_, out, cache)
            packages += entries
            records.append(record)
            checked += coreai
    if checked:
        what = f"{len(checked)} parts chained on the Core AI runtime" if not short else \
            f"{len(checked)} parts, each replayed on its own (the chained run is above {CHAINED_RUN_PARAMETERS:,} " \
            "parameters)"
        with stage(f"artifact gate: {what}"):
            report.artifact = gates.artifact_of_parts(checked, parts, pieces, target.taps, loader.outline, not short)
    return packages, records


def _package_part(plan: Plan, result: QuantizeResult | None, index: int, out: Path, cache: BuildCache,
                  schedule: list, rows: list) -> tuple[list[dict], dict, list, list]:
    """Part ``index`` of a target above ``CHAINED_RUN_PARAMETERS`` alone: loaded, its calls of the short
    ``schedule`` recorded from the previous part's ``rows``, packaged one format after the other (their packaging
    memory in turn). What ``_package_piece`` returns, and the rows for the next part."""
    from convert.shipped import PartLoader

    part = plan.parts[index]
    with stage(f"load part {part.name} ({index + 1} of {len(plan.parts)})"):
        piece = PartLoader(plan, result).load([part])[0]
        calls, rows = part_calls(piece, schedule, rows)
    return *_package_piece(plan, part, piece, calls, out, cache, side_by_side=False), rows


def _package_piece(plan: Plan, part: Part, piece: TargetModules, calls: list, out: Path, cache: BuildCache,
                   side_by_side: bool = True) -> tuple[list[dict], dict, list]:
    """One part's packages in every format (each checked against its size limit), its manifest record, and its
    Core AI ``Packaged`` (the artifact gate's)."""
    recipe, target = plan.recipe, plan.recipe.target
    entries, coreai = [], []
    for done in package_formats(recipe.backends, piece, out, f"{recipe.name}.{part.name}", calls, cache,
                                every_function=True, side_by_side=side_by_side):
        entries.append(package_entry(done.format, done.path, out, done.check, done.compiled, part.name))
        _check_part_size(entries[-1], target.max_part_mb)
        if done.format == "coreai":
            coreai.append(done)
    record = {**part.record(target.taps), "functions": [_function_record(spec) for _, spec in piece.functions.values()],
              "packages": [e["path"] for e in entries]}
    return entries, record, coreai


def _check_part_size(entry: dict, max_part_mb: float) -> None:
    """No package of a part over the limit (its files, as written)."""
    size = sum(f["size"] for f in entry["files"])
    if size > max_part_mb * MB:
        raise GateError(f"{entry['path']}: {size / MB:.1f} MB, over target.max_part_mb {max_part_mb:g}; the plan "
                        "under-estimated it (lower max_part_mb)")


def _write_drafter_interface(plan: Plan, modules: TargetModules, out: Path) -> dict:
    """lm_head.safetensors and embeddings.safetensors: the tables exactly as the target computes with them.

    Written for every target that can feed a drafter (a drafter in the recipe, taps or the hidden output): a
    runtime reads anchor embeddings from them, and a drafter's manifest binds to their hashes."""
    from safetensors.torch import save_file

    files = {}
    for key, filename, tensor in (("lm_head_file", identity.LM_HEAD_FILE, modules.core.lm_head.weight),
                                  ("embeddings_file", identity.EMBEDDINGS_FILE, modules.core.embed_tokens.weight)):
        path = out / filename
        save_file({"weight": tensor.detach().to(SHIP_DTYPE).contiguous()}, str(path))
        files[key] = {"path": filename, "sha256": sha256_file(path), "size": path.stat().st_size}
    return {**files, "hidden_output": plan.recipe.target.hidden}


def package_entry(name: str, path: Path, bundle: Path, check: dict, compiled, part: str | None = None) -> dict:
    backend = backends.load(name)
    files = [
        {"path": f"{path.name}/{r.path}", "sha256": r.sha256, "size": r.size} for r in file_records(path)
    ]
    return {
        "format": name,
        "path": path.relative_to(bundle).as_posix(),
        "part": part,
        "files": files,
        "stable_hash": backend.stable_hash(path),
        "stable_hash_scope": backend.STABLE_HASH_SCOPE,
        "check": check,
        "compile": [vars(c) for c in compiled],
    }


def copy_extras(source: Path, bundle: Path) -> list[dict]:
    """LICENSE / NOTICE at the top, the tokenizer under tokenizer/, config.json as shipped."""
    copied = []
    for path in license_files(source):
        shutil.copy2(path, bundle / path.name)
        copied.append(bundle / path.name)
    (bundle / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, bundle / "tokenizer" / name)
            copied.append(bundle / "tokenizer" / name)
    for name in COPIED_CONFIG_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, bundle / name)
            copied.append(bundle / name)
    return [
        {"path": p.relative_to(bundle).as_posix(), "sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(copied)
    ]


def _special_ids(source: Path, args) -> dict:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    config = source / "tokenizer_config.json"
    if config.is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(str(source))
    return {
        "bos_id": tok.bos_token_id if tok.bos_token_id is not None else args.bos_token_id,
        "eos_id": tok.eos_token_id if tok.eos_token_id is not None else args.eos_token_id,
        "pad_id": tok.pad_token_id if tok.pad_token_id is not None else args.pad_token_id,
    }


def toolchain_versions() -> dict[str, str]:
    versions = {"spec-convert": metadata.version("spec-convert"), "python": platform.python_version()}
    for name in TOOLCHAIN_PACKAGES:
        versions[name] = metadata.version(name)
    return versions


def _quantization_record(quant, result: QuantizeResult, modules: TargetModules) -> dict:
    bits_per_weight, layers = summary(result.items(), modules.core.parameters())
    names = result.names()
    calibration = None
    if result.calibration is not None:
        calibration = {"corpus": result.corpus, **result.calibration.identity()}
    return {
        "method": quant.method,
        "bits": 2 if quant.format == "exact2" else 4,
        "group_size": quant.resolved_group_size,
        "bits_per_weight": bits_per_weight,
        "kept_fp16": sorted(
            n for n, m in modules.core.named_modules()
            if getattr(m, "weight", None) is not None and m.weight.dim() == 2 and n not in names
        ),
        "calibration": calibration,
        "layers": layers,
    }


def _manifest(plan: Plan, source_files, modules: TargetModules, packages, parts, extra_files, quantization,
              report: GateReport, drafter_interface: dict | None) -> Manifest:
    args, snap, core = plan.args, plan.snapshot, modules.core
    tok_records = [r for r in source_files if r.path in TOKENIZER_FILES]
    data = {
        "name": plan.recipe.name,
        "export_id": "",
        "built_at": built_at(),
        "toolchain": toolchain_versions(),
        "source": {
            "reference": snap.reference,
            "repo": snap.repo,
            "revision": snap.revision,
            "files": [vars(r) for r in source_files],
        },
        "architecture": family_of(args).architecture_record(args, plan.recipe.target),
        "host_contract": modules.contract,
        "taps": {"layers": list(plan.recipe.target.taps)} if plan.recipe.target.taps else None,
        "tokenizer": {
            **identity.tokenizer_identity(snap.directory / "tokenizer.json"),
            **_special_ids(snap.directory, args),
            "files": [vars(r) for r in tok_records],
        },
        "weights": {
            "dtype": "float16",
            "embedding_sha256": identity.tensor_sha256(core.embed_tokens.weight),
            "lm_head_sha256": identity.tensor_sha256(core.lm_head.weight),
            "lm_head_tied": args.tie_word_embeddings,
            "parameter_count": sum(p.numel() for p in {id(p): p for p in core.parameters()}.values()),
        },
        "quantization": quantization,
        "gate": report.manifest_entry(),
        "functions": [_function_record(spec) for spec in plan.specs],
        "parts": parts,
        "packages": packages,
        "extra_files": extra_files,
        "drafter_interface": drafter_interface,
    }
    manifest = Manifest.model_validate(data)
    manifest.export_id = identity.export_id(manifest.identity())
    return manifest


def built_at() -> str:
    """Now in UTC, or ``SOURCE_DATE_EPOCH`` when it is set (reproducible builds: the same inputs, the same bytes)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return moment.isoformat(timespec="seconds")


def _function_record(spec: FunctionSpec) -> dict:
    return {"name": spec.name, "inputs": [_desc(t) for t in spec.inputs], "outputs": [_desc(t) for t in spec.outputs],
            "states": [_desc(t) for t in spec.states]}


def _desc(t) -> dict:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}


def describe_plan(plan: Plan) -> list[str]:
    """The plan as lines: functions and shapes, parameters, package size and peak memory estimates."""
    recipe, args = plan.recipe, plan.args
    mib = 2**20
    lines = [
        f"{recipe.name}: {plan.snapshot.reference} -> {plan.target_dir}",
        *family_of(args).plan_lines(args, recipe.target),
        *(f"  {note}" for note in plan.layout.notes()),
        "  functions:",
        *function_lines(plan.specs),
        *size_lines(plan.parameter_count, recipe.backends),
        shipped_line(args, recipe.target),
        *parts_lines(args, recipe.target, plan.parts),
        *(rotation_lines(args, recipe.target, pack_block(plan.snapshot.packed)) if plan.snapshot.packed else []),
        f"  states: {plan.state_bytes / mib:.1f} MiB in all",
        *estimate_lines(args, recipe.target),
        memory_line(recipe.target, plan.peak_memory_bytes),
        *([f"  estimated drafter stage: {plan.drafter_stage_bytes / 1e9:.1f} GB (it runs the whole target in "
           "fp16 and fp32)"] if plan.drafter else []),
    ]
    if plan.drafter:
        lines += describe_drafter(plan)
    return lines


def describe_drafter(plan: Plan) -> list[str]:
    d, a = plan.drafter, plan.drafter.args
    quant = d.config.quantization
    lines = [f"  drafter {d.kind}: {d.snapshot.reference} ({d.layout}) -> {plan.output / 'drafter'}",
             f"    hidden {a.hidden_size}, heads {a.num_attention_heads}/{a.num_key_value_heads} (head_dim "
             f"{a.head_dim}), vocab {a.vocab_size}, quantization {quant.method}",
             *size_lines(a.parameter_count, plan.recipe.backends, "    ")]
    if d.kind == "dflash2":
        lines.append(f"    taps {list(a.target_layer_ids)} (output of layer i, 0-based), block {a.block_size}, mask id "
                     f"{a.mask_token_id} x {d.config.mask_scale}, ring {d.config.ring} rows, selector rank "
                     f"{a.selector_rank} top-k {a.selector_top_k}")
    return lines + function_lines(d.specs)
