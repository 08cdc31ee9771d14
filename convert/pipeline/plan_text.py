"""The ``--dry-run`` description of a plan (``plan.make_plan``), also from the recipe's contracts alone when a source
is not on this machine: a summary (what is built, downloads, memory, time), the target's functions, states, parts and
placement, the drafter's."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from convert import fields
from convert.errors import InputError, SourceUnavailable
from convert.export.functions import parameters_on_meta
from convert.export.spec import (
    FunctionSpec,
    buffer_bytes,
    function_lines,
    size_lines,
)
from convert.inputs.contract import MISSING, as_config, lookup
from convert.inputs.prism import BLOCK_FIELD, pack_block
from convert.inputs.recipe import Recipe
from convert.inputs.sources import headers_only, headers_record
from convert.models import drafter_family, family_for, family_of
from convert.models.part import Part
from convert.pipeline.drafter import DrafterPlan, drafter_contract, head_ranges
from convert.pipeline.drafter_memory import own_linear_shapes, own_shapes
from convert.pipeline.partition import (
    matrix_bytes,
    memory_line,
    plan_lines,
    plan_parts,
    shipped_line,
)
from convert.pipeline.plan import Plan, host_buffer_names, make_plan, planned_recipe, torch_stages
from convert.pipeline.plan_costs import (
    CPU_MACHINE,
    GATE_CANDIDATE_GPU_SECONDS,
    GATE_REFERENCE_GPU_SECONDS,
    GB,
    GPU_MACHINE,
    RANGE_SECONDS_16_CORES,
    RANGE_SECONDS_GPU,
    cpu_seconds,
    drafter_gpu_seconds,
    drafter_packaging_seconds,
    drafter_stage_parts,
    gate_scale,
    gpu_packaging_seconds,
    range_seconds,
    refusal,
)
from convert.torch_device import describe
from convert.verify import placement
from convert.weights.quantize import (
    estimate_lines,
    kept_modules,
    quantize_seconds,
)


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
        torch_stages_line(plan),
        memory_line(recipe.target, plan.peak_memory_bytes),
        *([f"  estimated drafter stage: {plan.drafter_stage_bytes / 1e9:.1f} GB ({drafter_stage_parts(plan)})"]
          if plan.drafter else []),
    ]
    if plan.drafter:
        lines += describe_drafter(plan)
    return lines


def torch_stages_line(plan: Plan) -> str:
    """``  torch stages: quantize, gate reference on cuda (NVIDIA H100 80GB HBM3); ... on cpu (2 threads)``."""
    by_device: dict[torch.device, list[str]] = {}
    for name, device in torch_stages(plan):
        by_device.setdefault(device, []).append(name)
    return "  torch stages: " + "; ".join(f"{', '.join(names)} on {describe(device)}"
                                          for device, names in by_device.items())


def dry_run(recipe_path: Path, output: str | Path | None = None, cache_root: Path | None = None,
            torch_device: torch.device | None = None) -> list[str]:
    """``build --dry-run``: the plan's summary, then its signatures. Loads no weights: an ``hf://`` source that is not
    in the Hugging Face cache is planned from its config, tokenizer files and safetensors headers
    (``sources.headers_only``); one that cannot be reached either, from the recipe's contracts (``describe_contract``).
    A build the plan would refuse is said so in the summary (exit 0: the plan is what was asked for)."""
    with headers_only():
        try:
            plan = make_plan(recipe_path, output, cache_root, refuse=False, torch_device=torch_device)
        except SourceUnavailable as unavailable:
            return describe_contract(planned_recipe(recipe_path), recipe_path, unavailable)
        return [*summary_lines(plan), *describe_plan(plan)]


def summary_lines(plan: Plan, contract_note: str = "") -> list[str]:
    """The plan's first lines: what is built (parts, formats, sizes), what a build downloads, the estimated peak host
    memory against the budget (and, when the build would be refused, a plain line saying so and what to change), the
    estimated time per stage on the CPU and on one GPU (from ``plan_costs``' measured rates and ``COST_MODEL``) and the
    disk it takes."""
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
    if target.rescale:
        lines.append(f"    range ({max(1, target.gate.device_samples)} x {data.length} tokens): not measured | "
                     f"{_hours(range_seconds(plan, RANGE_SECONDS_GPU))} (one H100; on its 16 CPU cores: "
                     f"{_hours(range_seconds(plan, RANGE_SECONDS_16_CORES))})")
    gate, packaging = cpu["gate"], cpu["packaging"]
    windows = target.gate.device_samples
    lines.append(f"    gate ({data.samples} x {data.length} tokens): {_hours(gate)} | the reference "
                 f"{_hours(GATE_REFERENCE_GPU_SECONDS * gate_scale(plan))}, the candidate "
                 f"{_hours(GATE_CANDIDATE_GPU_SECONDS * gate_scale(plan))} (one H100, --device cuda); its device "
                 f"pass ({windows} window{'s' if windows > 1 else ''} in the device's arithmetic): not measured at "
                 "this size")
    lines.append(f"    packaging ({len(plan.parts)} part{'s' if len(plan.parts) > 1 else ''} x "
                 f"{len(plan.recipe.backends)} formats): {_hours(packaging)} | "
                 f"{_hours(gpu_packaging_seconds(plan))} (the parts' check calls on the GPU, then 8 jobs at once "
                 "on 16 cores; the converters run on the CPU)")
    if plan.recipe.drafter is not None:
        packages = _hours(drafter_packaging_seconds(plan))
        measured = ", ".join(f"{name} {_hours(seconds)}" for name, seconds in drafter_gpu_seconds(plan).items())
        if measured:
            measured += " (the seeded 27B DFlash2 pair on one H100), "
        lines.append("    drafter stages (calibration, quantize, acceptance A/B): not measured at this size | "
                     f"{measured}its GPTQ, acceptance and A/B not measured")
        lines.append(f"    drafter packages (the check's calls, {len(plan.recipe.backends)} formats): {packages} | not "
                     "measured (after its torch phases, beside the target's packaging pool)")
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
             *size_lines(a.parameter_count, plan.recipe.backends, "    "), *d.family.plan_lines(a, d.config)]
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
        drafter_lines, drafter = _contract_drafter_lines(recipe, recipe_path, pinned, hidden, vocab)
    if planned is None:
        return ["summary: sizes, host memory and time are planned from config.json at build time (the recipe's "
                "contracts do not pin every shape)", *lines, *target_lines, *drafter_lines]
    args, specs, parts = planned
    plan = Plan(recipe, recipe_path, Path(recipe.output or Path("bundles") / recipe.name), None, args, None, specs,
                0, parts, drafter)
    memory = [memory_line(target, plan.peak_memory_bytes)]
    if drafter is not None:
        memory.append(f"  estimated drafter stage: {plan.drafter_stage_bytes / 1e9:.1f} GB "
                      f"({drafter_stage_parts(plan)})")
    elif recipe.drafter is not None:
        memory.append("  estimated drafter stage: from the drafter's config.json at build time (its contract does "
                      "not pin every shape)")
    summary = summary_lines(plan, " from the recipe's contracts")
    return summary + lines + target_lines + memory + drafter_lines


def _contract_drafter_lines(recipe: Recipe, recipe_path: Path, pinned: dict, hidden: int,
                            vocab: int) -> tuple[list[str], DrafterPlan | None]:
    """The drafter's functions from the contracts (its family's ``contract_plan``), and its plan when they pin every
    shape its memory depends on."""
    drafter = recipe.drafter
    family = drafter_family(drafter.kind)
    lines, args, layout = family.contract_plan(recipe, recipe_path, pinned)
    if args is None:
        return lines, None
    where = f"{recipe_path}: drafter.contract"
    for field, mine, theirs in (("hidden_size", args.hidden_size, hidden), ("vocab_size", args.vocab_size, vocab)):
        if mine != theirs:
            raise InputError(f"{where}: {field} {mine} differs from the target contract's {theirs}")
    ranges = head_ranges(recipe, args.vocab_size)
    specs = family.specs(args, recipe, torch.float16, ranges)
    sizes = size_lines(args.parameter_count, recipe.backends, "    ") if layout is not None else []
    planned = DrafterPlan(drafter, None, args, layout, specs, ranges) if layout is not None else None
    return [*lines, *sizes, *drafter_function_lines(specs, drafter_contract(drafter.kind, args, drafter, ranges))], \
        planned


def _target_lines(pinned: dict, target, backends: list[str], where: str) -> tuple[list[str], tuple | None]:
    """The target's architecture, functions and states from a contract that pins the architecture (architectures or
    model_type) and every field its shapes depend on (the family's ``PLAN_FIELDS``), with (args, function specs,
    parts); otherwise what is missing, and None."""
    text = pinned.get("text_config", pinned)
    if not any(k in c for c in (pinned, text) for k in ("architectures", "model_type")):
        return ["  functions: pin architectures or model_type (and the architecture's shape fields) in "
                "target.contract to plan them"], None
    family = family_for(pinned, where)
    missing = [f for f in family.PLAN_FIELDS if lookup(text, f) is MISSING and not
               any(lookup(text, alt) is not MISSING for alt in family.PLAN_ALTERNATIVES.get(f, ()))]
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
    if block is not MISSING:
        fields.check_integer(block, BLOCK_FIELD, where)
    rotations = rotation_lines(args, target, None if block is MISSING else block) \
        if target.quantization.method == "exact" else []
    return [*family.plan_lines(args, target), "  functions:", *function_lines(specs, owned),
            *size_lines(args.parameter_count, backends), shipped_line(args, target), *plan_lines(args, target, parts),
            *rotations, f"  states: {total:.1f} MiB in all", *host_buffer_lines(specs, owned, args, target),
            *placement_lines(args, target, parts),
            *estimate_lines(args, target)], (args, specs, parts)


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
