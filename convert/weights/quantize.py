"""The quantize stage: the recipe's method applied to the target's weights exactly as they ship, streamed from the
checkpoint one unit (a decoder layer, the lm_head, the embedding table) at a time and cached per unit.

Round-to-nearest methods quantize every weight on its own. GPTQ methods run the layer-sequential calibration of
``quant/calibrate.py`` (each decoder linear quantized under the Hessian of its real inputs, the quantized layer's
outputs feeding the next), then the lm_head under the Hessian of the final-norm outputs. The embedding table has no
input Hessian (its "input" is a one-hot row) and is always rounded to nearest.

Streaming (``convert/weights/stream.py``): the core is a skeleton whose parameters take no memory; each unit is filled
from the checkpoint in the computing copy's precision (fp16 values in fp32) on ``device`` (``build --device``; called
without one, the GPU when there is one), quantized, and
freed; only the calibration activations [n, length, hidden] stay between units. Peak memory is one unit's weights
plus the activations, whatever the model's size. Large tables are rounded in row chunks (both formats' groups are
row-local, so the codes do not change).

Cache (``convert/cache.py``): each unit's result is stored under a key of its tensors' source files (sha256), the
recipe's quantization, the calibration identity, the device kind, the toolchain and the quantizer's code; GPTQ keys
chain layer to layer. A resumed build reuses every stored unit, recomputes the calibration activations up to the
first missing one with a forward pass (the same arithmetic, so the same values), and quantizes from there: after a
kill it redoes at most the unit that was in flight.

The resulting ``QuantizedWeight``s replace the fp16 core's modules (``convert/export/quantized.py``), so the gates, the
checks and both packages see the same codes and tables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from convert import cache as build_cache
from convert.errors import InputError
from convert.export.functions import parameters_on_meta
from convert.export.spec import SHIP_DTYPE
from convert.inputs.prism import PackedModule, core_name, exact_weight, read_pack_once
from convert.inputs.recipe import Quantization
from convert.inputs.sources import CheckpointReader
from convert.models import family_of
from convert.models.layout import Layout
from convert.progress import console, steps
from convert.weights import rescale
from convert.weights.stream import Streamer, checkpoint_key, skeleton
from manifests import identity
from quant.affine import quantize_affine
from quant.calibrate import (
    CalibrationSet,
    QuantizeLinears,
    SequentialResult,
    fixture_corpus_text,
    quantize_layer,
    sample_calibration,
)
from quant.gptq import HessianAccumulator, gptq_quantize, gptq_quantize_shared
from quant.lut import quantize_lut
from quant.types import GROUP_TENSORS, QuantizedWeight

ALIASES = {"embeddings": "embed_tokens", "lm_head": "lm_head"}
WORK_DTYPE = torch.float32
CHUNK_ELEMENTS = 1 << 26  # a table larger than this is read and rounded in row chunks (256 MB of fp32 each)
CACHE_STAGE = "quantize"
# TF32 matmuls in the calibration passes on CUDA (layer forwards and Hessian products, not the GPTQ solves: inputs
# rounded to 10-bit significands, as in the fp16 the device computes in, fp32 sums). Off: on one H200 they made an
# attention layer's passes 3.4x faster (a Gated DeltaNet layer's chunked recurrence is not matmul-bound: 0.9-1.6x)
# but moved the quantized weights by about as much as quantization itself (6-29% of the codes differ;
# bench/scale.py --compare-tf32, docs/benchmarks.md "Scale to 27B"), and whether that costs accuracy is not measured
# yet. The build computes the passes in fp32; the bench switches this on to measure it.
CUDA_TF32_PASSES = False
# the code a quantize cache entry depends on: any change to it invalidates every entry
CODE = ("convert.weights.quantize", "convert.weights.stream", "convert.export.quantized", "quant.affine",
        "quant.lut", "quant.gptq", "quant.calibrate", "quant.types")


@dataclass
class QuantizeResult:
    """The shipped weights by export-core module name: in ``weights``, or (``quantize_checkpoint(in_memory=False)``:
    a target larger than memory) read back one unit at a time from the cache ``entries`` (``unit``, ``items``), or
    (method exact) read one unit at a time from the Prism pack at ``pack``: a 27B pack's codes are 27 GB unpacked,
    so they are neither held whole nor sent whole to a stage's process (only the path travels)."""

    weights: dict[str, QuantizedWeight]
    calibration: CalibrationSet | None
    corpus: str | None
    units: dict[str, str] = field(default_factory=dict)  # unit -> "cached" | "computed"
    entries: dict[str, build_cache.Entry] = field(default_factory=dict)  # unit -> its cache entry
    pack: Path | None = None
    factors: dict[str, float] = field(default_factory=dict)  # a pack's modules' range-fold factors (exact: 1 if absent)

    def unit(self, prefix: str) -> dict[str, QuantizedWeight]:
        """The weights of unit ``prefix`` (``layers.3``, ``lm_head``, ``embed_tokens``; none for another module)."""
        if prefix in self.entries:
            return read_entry(self.entries[prefix])
        if self.pack is not None:
            return {n: self._exact(n, m) for n, m in pack_modules(self.pack).items() if _under(n, prefix)}
        return {n: w for n, w in self.weights.items() if _under(n, prefix)}

    def names(self) -> set[str]:
        """Every quantized module's name (read from the entries' metadata when the weights are not held)."""
        packed = set(pack_modules(self.pack)) if self.pack is not None else set()
        return set(self.weights) | packed | {n for e in self.entries.values() for n in e.meta["weights"]}

    def items(self) -> Iterator[tuple[str, QuantizedWeight]]:
        """Every (name, weight), one unit in memory at a time."""
        yield from self.weights.items()
        for prefix in self.entries:
            yield from self.unit(prefix).items()
        if self.pack is not None:
            for name, module in pack_modules(self.pack).items():
                yield name, self._exact(name, module)

    def _exact(self, name: str, module: PackedModule) -> QuantizedWeight:
        """A pack's matrix as it ships: its own codes, its group scales times the range fold's power of two."""
        weight = exact_weight(module)
        factor = self.factors.get(name, 1.0)
        if factor == 1:
            return weight
        return replace(weight, scale=rescale.exactly_scaled(weight.scale, factor, module.key))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def pack_modules(directory: Path) -> dict[str, PackedModule]:
    """The Prism pack's packed matrices by export-core module name (its scales and signs, read once a process;
    never its codes)."""
    return {core_name(m): m for m in read_pack_once(directory).modules.values()}


@dataclass(frozen=True)
class Unit:
    """What the stage quantizes and caches as one: ``prefix`` (``layers.3``, ``lm_head``, ``embed_tokens``), its
    2-D weight modules by core name, and whether GPTQ calibrates it (then its key chains to the previous unit's)."""

    prefix: str
    modules: tuple[str, ...]
    gptq: bool


@dataclass(frozen=True)
class Measured:
    """One machine's measured cost per unit (``bench/scale.py``, docs/benchmarks.md "Scale to 27B"): seconds at the
    Qwen3.8-27B geometry as (total, of which GPTQ solves), by method and unit kind, with ``tokens`` calibration
    tokens (GPTQ methods). A kind left out was not measured there."""

    device: str
    tokens: int
    seconds: dict[str, dict[str, tuple[float, float]]]


# The estimate scales a unit's GPTQ solves by its weights and the rest (the calibration passes, reading and casting)
# by weights x calibration tokens (round to nearest: by weights); a dense model's layers are priced as attention
# layers.
COST_MODEL = (
    Measured("one H200", 128 * 2048, {
        "lut4-gptq": {"linear_attention": (16.1, 4.3), "full_attention": (13.4, 4.5), "lm_head": (5.2, 3.4),
                      "embed_tokens": (3.7, 0.0)},
        "affine4-gptq": {"linear_attention": (14.6, 3.9), "full_attention": (12.8, 4.2), "lm_head": (3.6, 1.9),
                         "embed_tokens": (1.7, 0.0)}}),
    Measured("2 CPU cores", 8 * 512, {
        "affine4": {"linear_attention": (22.9, 0.0), "full_attention": (21.3, 0.0), "lm_head": (68.0, 0.0),
                    "embed_tokens": (83.0, 0.0)},
        "lut4-gptq": {"linear_attention": (474.3, 403.4), "full_attention": (457.3, 393.8),
                      "embed_tokens": (380.4, 0.0)}}),
)
MEASURED_WEIGHTS = {"linear_attention": 383_221_760, "full_attention": 372_244_480, "lm_head": 1_271_398_400,
                    "embed_tokens": 1_271_398_400}


def _estimates(args, target) -> list[tuple[str, float, list[str]]]:
    """(machine, the quantize stage's seconds there, the unit kinds not measured there) for each machine the cost model
    measured the method on: each unit's GPTQ solves scaled by its weights, its calibration passes by weights x
    tokens."""
    quant = target.quantization
    units = unit_weights(args, target)
    estimates = []
    for measured in COST_MODEL:
        costs = measured.seconds.get(quant.method)
        if costs is None:
            continue
        tokens = quant.calibration.samples * quant.calibration.length / measured.tokens if quant.uses_gptq else 1
        seconds = sum(weights / MEASURED_WEIGHTS[kind] * (costs[kind][1] + (costs[kind][0] - costs[kind][1]) * tokens)
                      for kind, weights in units if kind in costs)
        estimates.append((measured.device, seconds, sorted({kind for kind, _ in units if kind not in costs})))
    return estimates


def quantize_seconds(args, target) -> dict[str, float]:
    """The quantize stage's estimated seconds by machine (``_estimates``)."""
    return {device: seconds for device, seconds, _ in _estimates(args, target)}


def estimate_lines(args, target) -> list[str]:
    """The plan's line on the quantize stage's time on each machine the cost model measured the method on."""
    quant = target.quantization
    estimates = [f"{_duration(seconds)} on {device}" + (f" ({', '.join(missing)} not measured there)"
                                                        if missing else "")
                 for device, seconds, missing in _estimates(args, target)]
    if not estimates:
        return []
    tokens = f", {quant.calibration.samples} x {quant.calibration.length} calibration tokens" if quant.uses_gptq \
        else ""
    return [f"  estimated quantize time ({quant.method}{tokens}): {'; '.join(estimates)} (bench/scale.py's per-unit "
            "cost at the 27B geometry, scaled by weights and calibration tokens)"]


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def unit_weights(args, target) -> list[tuple[str, int]]:
    """(kind, 2-D weights) of every unit the stage quantizes: the layers by kind (``linear_attention`` /
    ``full_attention``), the lm_head and the embedding unless tied (from a parameterless core: nothing is read)."""
    with parameters_on_meta():
        core = family_of(args).build_core(args, target)
    kinds = getattr(args, "layer_types", None) or ("full_attention",) * args.num_hidden_layers

    def weights(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p.dim() == 2)

    units = [(kind, weights(layer)) for kind, layer in zip(kinds, core.layers, strict=True)]
    if not args.tie_word_embeddings:
        units += [("lm_head", weights(core.lm_head)), ("embed_tokens", weights(core.embed_tokens))]
    return units


# The group sizes a refusal suggests: affine4's allowed ones (``convert.inputs.recipe``), lut4's usual ones
GROUP_CHOICES = {"affine4": (32, 64, 128), "lut4": (16, 8, 4, 32)}


def check_group_size(args, target) -> None:
    """Refuse, at plan time, a group size that does not divide a width of a weight the stage quantizes (affine4
    groups its input columns, lut4 its output rows): the quantizer would fail there mid-build. The weights are those
    ``plan_units`` picks from a parameterless core (nothing is read), named as ``keep_fp16`` names them."""
    quant = target.quantization
    if quant.format not in GROUP_CHOICES:
        return
    with parameters_on_meta():
        core = family_of(args).build_core(args, target)
    shapes = {name: tuple(core.get_submodule(name).weight.shape)
              for unit in plan_units(core, kept_modules(core, quant), gptq=False) for name in unit.modules}
    check_group_widths(quant, shapes, "target.quantization", "keep those weights fp16 (target.quantization.keep_fp16)")


def check_group_widths(quant, shapes: dict[str, tuple[int, ...]], field: str, otherwise: str) -> None:
    """``check_group_size`` over ``shapes`` (the [out, in] of each weight quantized with ``quant``, by name): an
    InputError naming ``field``.group_size, the first weight whose width the group does not divide, and a group size
    that divides them all (else ``otherwise``)."""
    if quant.format not in GROUP_CHOICES:
        return
    axis, what = (1, "input width") if quant.format == "affine4" else (0, "output rows")
    group = quant.resolved_group_size
    bad = [(name, shape) for name, shape in shapes.items() if shape[axis] % group]
    if not bad:
        return
    name, shape = bad[0]
    others = f"; {len(bad) - 1} more quantized weights like it" if len(bad) > 1 else ""
    choices = GROUP_CHOICES[quant.format]
    fits = [g for g in choices if all(s[axis] % g == 0 for s in shapes.values())]
    fix = f"set a group size that divides every quantized weight's {what}, e.g. {fits[0]}" if fits else \
        f"no group size of {', '.join(map(str, choices))} divides every quantized weight's {what}: {otherwise}"
    default = "" if quant.group_size else ", the default"
    raise InputError(f"{field}.group_size: {group} ({quant.format}{default}) does not divide the {what} "
                     f"{shape[axis]} of {name} (weight {list(shape)}{others}); {fix}")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def quantize_checkpoint(directory: Path, args, target, layout: Layout, quant: Quantization, recipe_dir: Path, *,
                        cache: build_cache.BuildCache | None = None, file_hashes: dict[str, str] | None = None,
                        device: torch.device | str | None = None, in_memory: bool = True,
                        observe: Callable[[str, float], None] | None = None,
                        scales: rescale.Scales | None = None) -> QuantizeResult:
    """Quantize the checkpoint at ``directory`` (stored under ``layout``) as ``target.quantization`` (``quant``) says,
    unit by unit; returns the shipped weights by export-core module name. ``file_hashes``: sha256 by weight-file name
    when the caller has them (the build hashes every source file anyway); ``observe(unit, seconds)`` is called after
    each unit (``bench/scale.py`` reads the peak memory there). The architecture's small weights
    (``KEEP_FP16``: a Gated DeltaNet's in_proj_a / in_proj_b) stay fp16 always. ``in_memory=False``: the result holds
    the units' cache entries instead of their weights (a target larger than memory; needs an enabled cache).
    ``scales``: the range scales (``convert/weights/rescale.py``), folded into the weights as they are read, so GPTQ
    calibrates and the tables hold the weights as they ship."""
    device = torch.device(device) if device is not None else default_device()
    cache = cache or build_cache.BuildCache(enabled=False)
    if not in_memory and not cache.enabled:
        raise ValueError("quantize_checkpoint(in_memory=False) reads the units back from the cache: give it one")
    core = skeleton(args, target, SHIP_DTYPE, WORK_DTYPE, device)
    scales = scales or rescale.Scales()
    factors = rescale.weight_factors(core, scales)
    rescale.fold_constants(core, scales)
    reader = CheckpointReader(directory)
    streamer = Streamer(core, reader, layout, SHIP_DTYPE, WORK_DTYPE, device, factors)
    keep = kept_modules(core, quant)
    calibration = _calibration_set(quant, directory, recipe_dir) if quant.uses_gptq else None
    units = plan_units(core, keep, quant.uses_gptq)
    keys = _unit_keys(units, core, reader, layout, quant, calibration, device, directory, file_hashes, factors)
    entries = {u.prefix: cache.get(CACHE_STAGE, keys[u.prefix]) for u in units}
    # GPTQ needs the calibration activations at every unit it computes: forward through the stored units before it
    last_missing = max((i for i, u in enumerate(units) if u.gptq and entries[u.prefix] is None), default=-1)
    weights: dict[str, QuantizedWeight] = {}
    stored: dict[str, build_cache.Entry] = {}
    done: dict[str, str] = {}
    x = runner = None
    with steps(f"quantize {quant.method} (groups of {quant.resolved_group_size}) on {device.type}",
               len(units), "units") as advance:
        if last_missing >= 0:
            x, runner = _calibration_inputs(core, streamer, calibration.tokens.to(device))
            runner = _pass_precision(runner, device)
        for i, unit in enumerate(units):
            start = time.perf_counter()
            entry = entries[unit.prefix]
            forward = unit.gptq and unit.prefix.startswith("layers.") and i < last_missing
            if entry is not None:
                result = read_entry(entry) if in_memory or forward else {}
                if forward:
                    x = _forward_stored(core, streamer, unit, result, x, runner)
                done[unit.prefix] = "cached"
            else:
                result = _compute(core, streamer, unit, quant, x, runner, forward, keep)
                if forward:
                    x = result.pop("__outputs__")
                entry = cache.put(CACHE_STAGE, keys[unit.prefix], lambda d, r=result: write_entry(d, r))
                done[unit.prefix] = "computed"
            if in_memory:
                weights.update(result)
            else:
                stored[unit.prefix] = entry
            del result
            if observe is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                observe(unit.prefix, time.perf_counter() - start)
            advance()
    if cache.enabled:
        reused = sum(v == "cached" for v in done.values())
        console.print(f"  quantize cache {cache.root}: {reused} of {len(units)} units reused, "
                      f"{len(units) - reused} computed and stored")
    return QuantizeResult(weights, calibration, quant.calibration.corpus if calibration else None, done, stored)


def kept_modules(core: nn.Module, quant: Quantization) -> set[str]:
    """The 2-D weights that ship fp16: the recipe's ``keep_fp16``, the family's small ones, a tied table."""
    keep = _kept(core, quant.keep_fp16)
    small = family_of(core.args).KEEP_FP16
    keep |= {name for name, _ in core.named_modules() if small and name.endswith(small)}
    if core.args.tie_word_embeddings:
        keep |= {"embed_tokens", "lm_head"}  # one shared table: quantizing it would untie and duplicate it
    return keep


def plan_units(core: nn.Module, keep: set[str], gptq: bool) -> list[Unit]:
    """The decoder layers in order, then the lm_head, then the embedding table (each with what it quantizes)."""
    def matrices(prefix: str) -> tuple[str, ...]:
        module = core.get_submodule(prefix)
        names = [prefix] if prefix in ("lm_head", "embed_tokens") else \
            [f"{prefix}.{n}" for n, _ in module.named_modules() if n]
        return tuple(n for n in names if n not in keep and _is_matrix(core.get_submodule(n)))

    units = [Unit(f"layers.{i}", matrices(f"layers.{i}"), gptq) for i in range(len(core.layers))]
    units += [Unit(p, matrices(p), gptq and p == "lm_head") for p in ("lm_head", "embed_tokens") if p not in keep]
    return units


def _is_matrix(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and weight.dim() == 2


def _kept(core: nn.Module, names: list[str]) -> set[str]:
    modules = dict(core.named_modules())
    kept = set()
    for name in names:
        resolved = ALIASES.get(name, name)
        if resolved not in modules:
            raise InputError(f"target.quantization.keep_fp16: {name!r} is not 'embeddings', 'lm_head' or a module name")
        kept.add(resolved)
    return kept


def round_to_nearest(method: str, weight: torch.Tensor, group: int) -> QuantizedWeight:
    if method == "lut4":
        return quantize_lut(weight.float(), group)
    return quantize_affine(weight.float(), group)


LAYER_STATS = ("weight_mse", "gptq_output_error", "rtn_output_error", "damping", "cholesky_retries")


def summary(weights: dict[str, QuantizedWeight] | Iterable[tuple[str, QuantizedWeight]],
            parameters) -> tuple[float, list[dict]]:
    """Bits per weight over ``parameters`` (those not in ``weights`` count 16) and the per-layer records the
    manifests carry (method, group size, bits per weight and the quantizer's statistics). ``weights``: a dict, or
    (name, weight) pairs read one at a time (``QuantizeResult.items``)."""
    params = {id(p): p for p in parameters}.values()
    quantized = bits = 0
    layers = []
    for name, qw in weights.items() if isinstance(weights, dict) else weights:
        quantized += qw.codes.numel()
        bits += qw.bits_per_weight * qw.codes.numel()
        layers.append({"name": name, "method": qw.method, "group_size": qw.group_size,
                       "bits_per_weight": qw.bits_per_weight,
                       **{k: qw.stats[k] for k in LAYER_STATS if qw.stats.get(k) is not None}})
    bits += 16 * (sum(p.numel() for p in params) - quantized)
    return bits / sum(p.numel() for p in params), sorted(layers, key=lambda r: r["name"])


def _unit_keys(units: list[Unit], core: nn.Module, reader: CheckpointReader, layout: Layout, quant: Quantization,
               calibration: CalibrationSet | None, device: torch.device, directory: Path,
               file_hashes: dict[str, str] | None, factors: dict[str, float]) -> dict[str, str]:
    """Each unit's cache key: its tensors' source files and the factors they are read with, everything the
    quantization reads; GPTQ units chained."""
    hashes = dict(file_hashes or {})
    for path in set(reader.files.values()):
        if path.name not in hashes:
            hashes[path.name] = identity.file_sha256(path)
    base = {
        "stage": CACHE_STAGE, "code": build_cache.code_fingerprint(CODE + (family_of(core.args).__name__,)),
        "toolchain": build_cache.versions(("spec-convert", "torch", "safetensors")), "device": device.type,
        "layout": layout.prefix,
        "config": json.loads((directory / "config.json").read_text()),
        "quantization": quant.model_dump(mode="json"), "calibration": calibration.identity() if calibration else None,
        "ship_dtype": str(SHIP_DTYPE), "work_dtype": str(WORK_DTYPE), "chunk_elements": CHUNK_ELEMENTS,
        "passes": "tf32" if device.type == "cuda" and CUDA_TF32_PASSES else "fp32",
    }
    keys, previous = {}, None
    for unit in units:
        names = [n for n, _ in core.get_submodule(unit.prefix).named_parameters()]
        stored = sorted({layout.stored(checkpoint_key(core, f"{unit.prefix}.{n}")) for n in names})
        tensors = [(k, reader.files[k].name, hashes[reader.files[k].name]) for k in stored if k in reader.files]
        scaled = {n: factors[f"{unit.prefix}.{n}"] for n in names if f"{unit.prefix}.{n}" in factors}
        keys[unit.prefix] = build_cache.key({**base, "unit": unit.prefix, "modules": unit.modules,
                                             "tensors": tensors, "previous": previous if unit.gptq else None,
                                             **({"factors": scaled} if scaled else {})})
        if unit.gptq:
            previous = keys[unit.prefix]
    return keys


def _calibration_inputs(core: nn.Module, streamer: Streamer, tokens: torch.Tensor):
    """The embedded calibration samples [n, length, hidden] and the family's layer runner (which reads the
    embedding's dtype and device when it is made)."""
    streamer.fill("embed_tokens")
    try:
        with torch.no_grad():
            x = core.embed_tokens(tokens.long()) * core.residual_scale  # as the layers receive them
        runner = family_of(core.args).calibration_runner(core, tokens.shape[1])
    finally:
        streamer.free("embed_tokens")
    return x, runner


def _pass_precision(runner, device: torch.device):
    """``runner`` with TF32 matmuls on CUDA (``CUDA_TF32_PASSES``); unchanged elsewhere."""
    if device.type != "cuda" or not CUDA_TF32_PASSES:
        return runner

    def passes(layer, x):
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return runner(layer, x)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous

    return passes


def _gptq_names(core: nn.Module, unit: Unit) -> set[str]:
    layer = core.get_submodule(unit.prefix)
    groups = family_of(core.args).linear_groups(core, layer)
    return {f"{unit.prefix}.{n}" for group in groups for n in group}


@torch.no_grad()
def _forward_stored(core, streamer: Streamer, unit: Unit, stored: dict[str, QuantizedWeight], x, runner):
    """A stored layer's outputs over the calibration activations: its GPTQ'd linears dequantized, as when it was
    computed (other weights as in the checkpoint)."""
    layer = streamer.fill(unit.prefix)
    try:
        for name in _gptq_names(core, unit) & set(stored):
            linear = core.get_submodule(name)
            linear.weight.copy_(stored[name].dequantize().to(linear.weight.device, linear.weight.dtype))
        return runner(layer, x)
    finally:
        streamer.free(unit.prefix)


@torch.no_grad()
def _compute(core, streamer: Streamer, unit: Unit, quant: Quantization, x, runner, forward: bool,
             keep: set[str]) -> dict:
    """Quantize one unit: a GPTQ layer under its calibration Hessians (with ``forward``, its outputs under
    ``__outputs__``), the GPTQ'd lm_head under the Hessian of the final-norm outputs, anything else to nearest."""
    method, group = quant.format, quant.resolved_group_size
    result: dict = {}
    if unit.gptq and unit.prefix == "lm_head":
        streamer.fill("norm")
        accumulator = HessianAccumulator(core.args.hidden_size, device=x.device)
        for sample in x:
            accumulator.add(core.norm(sample))
        streamer.free("norm")
        hessian = accumulator.hessian()
        result["lm_head"] = _in_row_chunks(streamer, "lm_head", group, lambda w: to_cpu(gptq_quantize(
            w, hessian, method, group, lut_refits=quant.lut_refits, name="lm_head")))
        return result
    if unit.gptq:
        layer = streamer.fill(unit.prefix)
        index = int(unit.prefix.split(".")[1])

        def quantize_linears(names: list[str], weights: list[torch.Tensor],
                             hessian: torch.Tensor) -> list[QuantizedWeight | None]:
            """The linears sharing ``hessian`` in one stacked sweep (``gptq_quantize_shared``), the kept ones not."""
            chosen = [k for k, name in enumerate(names) if name.removeprefix("model.") not in keep]
            results: list[QuantizedWeight | None] = [None] * len(names)
            if chosen:
                stacked = gptq_quantize_shared([weights[k] for k in chosen], hessian, method, group,
                                               lut_refits=quant.lut_refits, names=[names[k] for k in chosen])
                for k, qw in zip(chosen, stacked, strict=True):
                    results[k] = to_cpu(qw)
            return results

        family = family_of(core.args)
        done = quantize_layer(layer, index, family.linear_groups(core, layer), x, runner, quantize_linears,
                              blocks=family.cached_blocks(core, layer), outputs=forward)
        if forward:
            done, result["__outputs__"] = done
        result.update({name.removeprefix("model."): qw for name, qw in done.items()})
        streamer.free(unit.prefix)
    for name in unit.modules:
        if name not in result:
            result[name] = _round_streamed(streamer, name, method, group)
    return result


def _round_streamed(streamer: Streamer, name: str, method: str, group: int) -> QuantizedWeight:
    """Round-to-nearest of module ``name``'s weight (``_in_row_chunks``)."""
    return _in_row_chunks(streamer, name, group, lambda w: to_cpu(round_to_nearest(method, w, group)))


def _in_row_chunks(streamer: Streamer, name: str, group: int, quantize) -> QuantizedWeight:
    """``quantize`` of module ``name``'s weight, read and quantized in row chunks of about ``CHUNK_ELEMENTS`` (a
    multiple of the lut4 row group) when it is larger: both formats' groups are row-local and GPTQ treats rows
    independently under one Hessian, so the codes are the whole table's (GPTQ's lut4 refits are decided per chunk)."""
    meta = streamer.core.get_submodule(name).weight
    rows, columns = meta.shape
    step = rows if rows * columns <= CHUNK_ELEMENTS else max(group, CHUNK_ELEMENTS // columns // group * group)
    if step >= rows:
        streamer.fill(name)
        try:
            return quantize(streamer.core.get_submodule(name).weight)
        finally:
            streamer.free(name)
    return concat_rows([quantize(streamer.rows(f"{name}.weight", i, min(i + step, rows)))
                        for i in range(0, rows, step)])


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight from row chunks quantized alone (their ``weight_mse`` averaged by rows, GPTQ's output errors
    summed, the most lut4 refits any chunk kept)."""
    first = parts[0]
    fields = {f: torch.cat([getattr(p, f) for p in parts]) for f in GROUP_TENSORS if getattr(first, f) is not None}
    qw = QuantizedWeight(first.method, torch.cat([p.codes for p in parts]), first.group_size, **fields)
    rows = sum(p.codes.shape[0] for p in parts)
    qw.stats.update(first.stats)  # GPTQ's damping, retries, dead columns and settings: one Hessian for every chunk
    qw.stats["weight_mse"] = sum(p.stats["weight_mse"] * p.codes.shape[0] for p in parts) / rows
    if "gptq_output_error" in first.stats:  # output errors add up over rows
        for key in ("gptq_output_error", "rtn_output_error"):
            qw.stats[key] = sum(p.stats[key] for p in parts)
        rtn = qw.stats["rtn_output_error"]
        qw.stats["error_ratio"] = qw.stats["gptq_output_error"] / rtn if rtn else None
        qw.stats["lut_refits_kept"] = max(p.stats["lut_refits_kept"] for p in parts)
    return qw


WEIGHT_FILE = "weights.safetensors"


def write_entry(directory: Path, weights: dict[str, QuantizedWeight]) -> dict:
    """A unit's weights as one safetensors file (4-bit codes packed two per byte, low nibble first) and the
    metadata (method, group size, shape, stats) that ``read_entry`` needs."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, qw in sorted(weights.items()):
        codes = qw.codes
        packed = codes.shape[1] % 2 == 0
        tensors[f"{name}/codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous() if packed else codes
        for f in GROUP_TENSORS:
            if getattr(qw, f) is not None:
                tensors[f"{name}/{f}"] = getattr(qw, f).contiguous()
        meta[name] = {"method": qw.method, "group_size": qw.group_size, "shape": list(codes.shape),
                      "packed": packed, "stats": qw.stats}
    save_file(tensors, str(directory / WEIGHT_FILE))
    return {"weights": meta}


def read_entry(entry: build_cache.Entry) -> dict[str, QuantizedWeight]:
    from safetensors.torch import load_file

    tensors = load_file(str(entry.path(WEIGHT_FILE)))
    weights = {}
    for name, m in entry.meta["weights"].items():
        codes = tensors[f"{name}/codes"]
        if m["packed"]:
            codes = torch.stack([codes & 15, codes >> 4], dim=2).reshape(m["shape"])
        fields = {f: tensors[f"{name}/{f}"] for f in GROUP_TENSORS if f"{name}/{f}" in tensors}
        weights[name] = QuantizedWeight(m["method"], codes, m["group_size"], stats=m["stats"], **fields)
    return weights


def to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with its codes and group tensors on the CPU (quantized on the torch device, kept and packaged here)."""
    for name in ("codes", *GROUP_TENSORS):
        value = getattr(qw, name)
        if value is not None:
            setattr(qw, name, value.cpu())
    return qw


def _calibration_set(quant: Quantization, source: Path, recipe_dir: Path) -> CalibrationSet:
    from transformers import PreTrainedTokenizerFast

    spec = quant.calibration
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    try:
        return sample_calibration(calibration_text(spec.corpus, recipe_dir), tokenizer, spec.samples, spec.length,
                                  spec.seed)
    except ValueError as exc:
        raise InputError(f"target.quantization.calibration: {exc}") from None


def calibration_text(corpus: str, recipe_dir: Path, field: str = "target.quantization.calibration.corpus") -> str:
    """The text named by ``fixture:SPLIT`` or ``path:FILE`` (relative to the recipe); errors name ``field``."""
    from fixtures import corpus as fixture_corpus

    kind, _, value = corpus.partition(":")
    if kind == "path":
        path = Path(value) if Path(value).is_absolute() else recipe_dir / value
        if not path.is_file():
            raise InputError(f"{field}: {path} does not exist")
        return path.read_text(encoding="utf-8")
    if kind != "fixture" or value not in fixture_corpus.SPLITS:
        raise InputError(f"{field}: {corpus!r} is not fixture:SPLIT or path:FILE")
    try:
        if value == "train" and not fixture_corpus.TRAIN_TEXT_PATH.is_file():
            from fixtures.build_corpus import write_train_split

            write_train_split()
        return fixture_corpus_text(value)
    except fixture_corpus.CorpusError as exc:
        raise InputError(f"{field}: {corpus}: {exc}") from None


@torch.no_grad()
def quantize_sequential(core: torch.nn.Module, tokens: torch.Tensor,
                        quantize_linears: QuantizeLinears) -> SequentialResult:
    """Quantize every decoder-layer linear of an export ``core`` in place, layer by layer, on calibration ``tokens``
    [n, L]; the core's architecture family says how a layer runs over a sample and which linears it quantizes.
    (The whole core in memory: the build streams the same loop from the checkpoint, ``convert/weights/quantize.py``.)"""
    family = family_of(core.args)
    runner = family.calibration_runner(core, tokens.shape[1])
    x = core.embed_tokens(tokens.to(core.embed_tokens.weight.device).long()) * core.residual_scale
    quantized = {}
    for i, layer in enumerate(core.layers):
        done, x = quantize_layer(layer, i, family.linear_groups(core, layer), x, runner, quantize_linears,
                                 blocks=family.cached_blocks(core, layer), outputs=True)
        quantized.update(done)
    return SequentialResult(quantized=quantized, hidden=x)
