"""The build plan: a recipe and its checkpoint's config and headers read into what the build will do (functions,
parts, memory, the drafter's plan), refused before any weight is read when it cannot be done here; and the
``--dry-run`` description of it, also from the recipe's contracts alone when a source is not on this machine."""

from __future__ import annotations

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
from convert.inputs import contract
from convert.inputs.checkpoint import checkpoint_shapes
from convert.inputs.contract import _MISSING, as_config, lookup
from convert.inputs.prism import BLOCK_FIELD, pack_block, source_config, unfolded_snapshot
from convert.inputs.recipe import Recipe, check_against_model, load_recipe
from convert.inputs.sources import Snapshot, resolve
from convert.models import dflash2, family_for, family_of, mtp
from convert.models.layout import Layout
from convert.models.part import Part
from convert.pipeline.drafter import (
    MAX_SESSIONS,
    DrafterPlan,
    drafter_contract,
    head_ranges,
    own_phase_bytes,
    plan_drafter,
    stage_target,
)
from convert.pipeline.partition import (
    BASE_BYTES,
    build_memory_bytes,
    held_target_bytes,
    memory_line,
    piece_sizes,
    plan_lines,
    plan_parts,
    shipped_line,
)
from convert.verify import placement
from convert.weights.quantize import estimate_lines, kept_modules
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
        sizes = piece_sizes(self.args, self.recipe.target)
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


def make_plan(recipe_path: Path, output: str | None = None, cache_root: Path | None = None) -> Plan:
    """Validate the recipe and the checkpoint's config and headers; reads no weights (but a Prism pack's, which is
    unfolded once into ``cache_root``, default the build cache's directory:
    ``convert.inputs.prism.unfolded_snapshot``)."""
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
    layout = family.sanitize(checkpoint_shapes(snapshot.directory), args, f"checkpoint {snapshot.directory}")
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
        return lines + target_lines + drafter_lines
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
    return lines + target_lines + memory + drafter_lines


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
