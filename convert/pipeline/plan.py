"""The build plan: a recipe and its checkpoint's config and headers read into what the build will do (functions,
parts, memory, the drafter's plan), refused before any weight is read when it cannot be done here
(``plan_costs``: its memory and time arithmetic; ``plan_text``: the ``--dry-run`` description)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from convert.errors import InputError
from convert.export.spec import SHIP_DTYPE, FunctionSpec
from convert.inputs import contract, prism
from convert.inputs.checkpoint import checkpoint_shapes
from convert.inputs.prism import source_config, unfolded_snapshot
from convert.inputs.recipe import Recipe, check_against_model, load_recipe
from convert.inputs.sources import (
    Snapshot,
    headers_record,
    read_json,
    resolve,
    tensor_shapes,
    weight_bytes,
)
from convert.models import family_for, family_of
from convert.models.layout import Layout
from convert.models.part import Part
from convert.pipeline import plan_costs
from convert.pipeline.drafter import DrafterPlan, check_drafter_recipe, plan_drafter
from convert.pipeline.drafter_memory import own_linear_shapes, own_phase_bytes
from convert.pipeline.partition import held_target_bytes, piece_sizes, plan_parts
from convert.pipeline.plan_costs import check_host_memory
from convert.weights.quantize import check_group_size, check_group_widths
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
    torch_device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # --device
    package_jobs: int | None = None  # --jobs: a parted target's packaging jobs at once (None: the cores and memory)

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
        """Estimate of the build's peak host memory, the drafter stage's included (``plan_costs``); computed once."""
        return plan_costs.peak_memory_bytes(self)

    @property
    def gate_state_room(self) -> int:
        return plan_costs.gate_state_room(self)

    @property
    def drafter_stage_target_bytes(self) -> int:
        return plan_costs.drafter_stage_target_bytes(self)

    @property
    def drafter_stage_bytes(self) -> int:
        return plan_costs.drafter_stage_bytes(self)

    @cached_property
    def drafter_phases(self) -> dict[str, dict[str, int]]:
        return plan_costs.drafter_phases(self)

    @cached_property
    def drafter_own_phases(self) -> dict[str, int]:
        """The drafter's own share of each phase of its stage (``drafter_memory.own_phase_bytes``)."""
        return own_phase_bytes(self.drafter)

    @property
    def drafter_session_bytes(self) -> int:
        return plan_costs.drafter_session_bytes(self)

    @cached_property
    def drafter_sessions(self) -> int:
        return plan_costs.drafter_sessions(self)


def planned_recipe(recipe_path: Path) -> Recipe:
    """The recipe at ``recipe_path``, refused (naming the file) where its drafter's family cannot be built with it
    (``check_drafter_recipe``)."""
    recipe = load_recipe(recipe_path)
    check_drafter_recipe(recipe, recipe_path)
    return recipe


def make_plan(recipe_path: Path, output: str | Path | None = None, cache_root: Path | None = None,
              refuse: bool = True, torch_device: torch.device | None = None,
              package_jobs: int | None = None) -> Plan:
    """Validate the recipe and the checkpoint's config and headers; reads no weights (but a Prism pack's, which is
    unfolded once into ``cache_root``, default the build cache's directory:
    ``convert.inputs.prism.unfolded_snapshot``; within ``sources.headers_only()`` a pack on the hub is planned from its
    headers, ``_pack_headers_view``). ``refuse``: raise when the build would not fit ``target.max_host_memory_gb``
    (``refusal``); the dry run says so in its summary instead. ``torch_device``: where the torch stages compute
    (``convert.torch_device.resolve``'s; default the CPU; ``torch_stages`` says which do). ``package_jobs``: at most
    this many of a parted target's (part, format) packaging jobs at once (``package_pool.pool_width``; default as many
    as the cores and ``target.max_host_memory_gb`` allow)."""
    recipe = planned_recipe(recipe_path)
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
                checkpoint_bytes, plan_parts(args, recipe.target), drafter, torch_device or torch.device("cpu"),
                package_jobs)
    if refuse:
        check_host_memory(plan)
    return plan


def _pack_headers_view(snapshot: Snapshot) -> tuple[Snapshot, dict[str, tuple[int, ...]]]:
    """A headers-only Prism pack's unfolded view (``prism.write_view``'s config.json and tokenizer files, beside the
    stubs) and its tensors' shapes in the unfolded checkpoint (``prism.UnfoldedPack.shapes``), from its config's modules
    list and the safetensors headers alone: the scales and signs ``read_pack`` checks are tensor data, read by the
    build."""
    directory = snapshot.directory
    config = read_json(directory / "config.json")
    prism.check_pack_config(config, directory / "config.json")
    records = prism.module_records(config, directory / "config.json")
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
    prism.copy_pack_files(pack, view)
    return dataclasses.replace(snapshot, directory=view, packed=directory), shapes


def host_buffer_names(args, target) -> tuple[str, ...]:
    """The inputs the host owns (the ane layout's history; none in the stateful layout)."""
    return tuple(family_of(args).host_contract(args, target).get("buffers", {}))


def torch_stages(plan: Plan) -> list[tuple[str, torch.device]]:
    """Each torch stage of the build and the torch device it computes on: ``plan.torch_device`` where the stage
    honours it, the CPU where it does not (yet, issue #43; or by design: the drafter's package check's calls)."""
    cpu, device = torch.device("cpu"), plan.torch_device
    quant = plan.recipe.target.quantization
    stages = [("quantize", device)] if quant.format and quant.format != "exact2" else []
    if plan.snapshot.packed is not None:  # written unfolded while planning, or unfolded as the reference reads it
        stages.append(("pack unfold", device if (plan.snapshot.directory / prism.VIEW_FILE).is_file() else cpu))
    if plan.recipe.target.rescale:
        stages.append(("range", device))
    candidate = "gate candidate and device pass"
    if device.type != "cpu" and not plan.parts[0].is_whole:
        held = held_target_bytes(plan.args, plan.recipe.target, lean=True)
        amount = f"{held / 1e9:.1f} GB" if held >= 1e8 else f"{held / 1e6:.1f} MB"
        candidate += f" (the target held there as its codes, about {amount}, where it fits)"
    # above it each part records its calls alone (``build.record_part``); below, the parts chained on the CPU
    calls = device if plan.parameter_count > plan_costs.CHAINED_RUN_PARAMETERS else cpu
    stages += [("gate reference", device), (candidate, device), ("package checks' recorded calls", calls)]
    if plan.recipe.drafter is not None:
        stages += drafter_stages(plan)
    return stages


def drafter_stages(plan: Plan) -> list[tuple[str, torch.device]]:
    """The drafter stage's torch phases (``drafter_build.build_drafter``) and where they compute: every phase of the
    fp32 or fp16 compute copies on ``plan.torch_device`` (the recipe's: its range scale where the target is rescaled,
    its quantization, acceptance, economics, n-gram baseline, the A/B of a quantized drafter, the device pass); the
    package check's recorded calls on the CPU (the CPU runtime's arithmetic, which the check replays)."""
    quant = plan.recipe.drafter.quantization
    quantized = quant.method != "none"
    phases = [*(["range"] if plan.recipe.target.rescale else []),
              *([("calibration, GPTQ" if quant.uses_gptq else "quantization")] if quantized else []),
              "plain greedy, acceptance, economics, n-gram baseline", *(["A/B"] if quantized else []), "device pass"]
    return [(f"drafter stage: {', '.join(phases)}", plan.torch_device),
            ("drafter package check's recorded calls", torch.device("cpu"))]
