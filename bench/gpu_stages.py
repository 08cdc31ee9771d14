"""Benchmark: the release pair's torch stages at full size on one torch device, timed phase by phase (issue #43).

Writes the release rehearsal's seeded Ternary Bonsai 2 27B pack into a Hugging Face cache under ``--workdir``
(``bench.release_rehearsal.write_pack``, the layout ``recipes/bonsai2_27b_dflash2.yaml`` pins), plans that recipe
unchanged with ``--device`` (``make_plan(torch_device=...)``, as ``build --device`` does), then runs the build's own
functions for ``--stage``:

- ``gate``: the range scales (``build.streamed_range_stage``) when the recipe rescales, the pack's own weights
  (``build.exact_result``), then the streamed gate (``gates.gate_streamed``) with each of its passes timed through its
  ``keep`` (``candidate``: the fp32 candidate and its 16 greedy passes; ``device``: the device pass in the layout's
  arithmetic; ``reference``: the transformers reference), and the gate's verdict.
  ``--gate-pass candidate`` or ``device`` times that pass alone (the 27B's passes each fit one command).
- ``calls``: the range scales, then every part's package-check calls (``calls_stage``) on the torch device, timed a
  part at a time (without coreai-torch, as on the GPU machine: ``_without_coreai_torch``).
- ``package``: the packaging stage on the host's cores (``package_stage``): every part's calls recorded, then every
  (part, format) job of the pool (``convert/pipeline/package_pool.py``) one after the other, each timed with its
  process's peak and its package's bytes. Longer than one command on a 2-core machine (about 3 h): it resumes from
  the files it keeps in ``--workdir`` (run it from one commit's copy, as ``bench/release_rehearsal.py`` says).
- ``drafter``: the drafter stage's torch phases (``drafter_stage``); ``drafter-package``: the drafter's (format)
  jobs on the host's cores (``drafter_package_stage``).
- ``target-calls``: the drafter stage's target calls alone, from its codes and from dense weights
  (``target_calls_stage``), each call counted (``--profile-target-calls N`` profiles some).
- ``drafter-devices``: the drafter stage's torch phases on the CPU, then on ``--device``, from one target, compared
  (``drafter_devices_stage``: GPTQ codes apart, lut4 tables, acceptance fields, verdicts). With ``--layers 2
  --drafter-layers 1`` it is the pair at the 27B width over two layers: a drafter of ``--drafter-layers`` at the
  published width tapping five layers spread over the pack's ``--layers``; ``--drafter-prompts N`` cuts its
  calibration (on the shipped validation split, which any Python reads) and acceptance to N prompts.

Each phase's seconds, the GPU's peak memory (``torch.cuda.max_memory_allocated``) and the process's host peak
(``VmHWM``), and the disk the inputs and the plan use. The seeded values make the verdict the gate's own (the
rehearsal's docstring); the bench measures time and memory. A stage runs in one command from freshly written inputs
(the device machine keeps no files between commands).

``--layers N`` writes and plans the pack's first N layers only (a quick rehearsal of the same stages).
``--no-range`` skips the range stage and takes its scales as the identity, which is what it measures on the seeded
pack (``residual stream x 1/1, MLP intermediate none`` on an H100:
``docs/bench-logs/gpu-stages-gate-h100-2026-12-07-candidate.log``), an hour saved on 2 cores before the package
stage. ``--host-memory-gb`` sets the recipe's ``target.max_host_memory_gb`` (default the recipe's own, 16): with
the plan's estimate it sets how many of the gate's window states stay in memory between greedy passes
(``gate_state_room``).
``--check-bound`` sets the package checks' fp16 output bound for the run (logged, and kept in the JSON): the
seeded drafter's fp16 floor at the 27B width is about 3%, above the build's 2%
(``docs/lab/2026-12-07-the-drafter-check-at-27b.md``), so its check stops at the first call; a wider bound times the
whole check and records its largest delta (``max_output_delta``). The build's bound is not changed.
Mind the disk: a budget the unfolded pack fits in makes the plan write the pack unfolded (at 102 GB the GPU
machine's 64 GB disk ran out, ``docs/bench-logs/gpu-stages-gate-h100-2026-12-07-disk.log``).

    PYTHONPATH=. python3 -m bench.gpu_stages --workdir DIR [--device cuda] [--layers 64] [--json out.json]
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from bench.common import arguments, write_json
from bench.scale_build import _status
from bench.torch_device import _peak_gib

STAGES = ("gate", "calls", "package", "drafter", "drafter-package", "drafter-devices", "target-calls")


class Phases:
    """Seconds and peaks of each named phase, printed as each ends; with the target's calls counted
    (``TargetCalls``), the calls the phase made."""

    def __init__(self, device: torch.device, no_range: bool = False, calls: TargetCalls | None = None):
        self.device, self.rows, self.no_range, self.calls = device, {}, no_range, calls

    def run(self, name: str, compute):
        from convert.torch_device import synchronize

        start, made = time.perf_counter(), self.calls.made if self.calls else 0
        value = compute()
        synchronize(self.device)
        self.rows[name] = {"seconds": round(time.perf_counter() - start, 1), "gpu_peak_gib": _peak_gib(self.device),
                           "host_peak_gib": round(_status(os.getpid())["VmHWM"] / 2**30, 2)}
        if self.calls:
            self.rows[name]["target_calls"] = self.calls.made - made
        print(name, self.rows[name], flush=True)
        return value


class TargetCalls:
    """Counts every target call (``TargetModules.call``, all functions) from its installation on, and profiles calls
    ``skip + 1 .. skip + profiled`` (``torch.profiler``, the GPU's kernels too): each one's seconds and rows, then its
    operators by their own time on the device (the CPU's without one), printed as it ends. ``rows`` keeps the
    profiled calls' (function, rows, seconds, the operators' top rows)."""

    def __init__(self, device: torch.device, profiled: int = 0, skip: int = 2, top: int = 15):
        from convert.weights.target import TargetModules

        self.device, self.profiled, self.skip, self.top = device, profiled, skip, top
        self.made, self.rows = 0, []
        original = TargetModules.call

        def call(modules, name, *args, **kwargs):
            self.made += 1
            if not self.skip < self.made <= self.skip + self.profiled:
                return original(modules, name, *args, **kwargs)
            return self._profiled(functools.partial(original, modules, name, *args, **kwargs), name, args, kwargs)

        TargetModules.call = call

    def _profiled(self, compute, name: str, args, kwargs):
        from torch.profiler import ProfilerActivity, profile

        from convert.torch_device import synchronize

        on_gpu = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
        synchronize(self.device)
        with profile(activities=activities) as profiler:
            start = time.perf_counter()
            value = compute()
            synchronize(self.device)
            seconds = time.perf_counter() - start
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("hidden_states"))
        rows = None if ids is None else int(ids.shape[1])
        key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=key, row_limit=self.top)
        print(f"target call {self.made} ({name}, {rows} rows): {seconds:.3f} s\n{table}", flush=True)
        self.rows.append({"call": self.made, "function": name, "rows": rows, "seconds": round(seconds, 4),
                          "operators": table.splitlines()[: self.top + 4]})
        return value


def shipped(plan, phases: Phases):
    """The range scales (when the recipe rescales) and the pack's weights, each phase timed."""
    from convert.pipeline import build
    from convert.weights.rescale import Scales

    ranged = plan.recipe.target.rescale and not phases.no_range
    scales = phases.run("range", lambda: build.streamed_range_stage(plan)[0]) if ranged else Scales()
    return phases.run("pack weights", lambda: build.exact_result(plan, scales)), scales


GATE_PASSES = ("all", "candidate", "device")


class _PassDone(Exception):
    """The one gate pass asked for (``--gate-pass``) is timed: the gate stops there."""


def gate_stage(plan, phases: Phases, only: str = "all") -> dict:
    """The streamed gate, each pass timed; ``only`` (``--gate-pass``): that pass alone (``candidate``: the fp32
    candidate; ``device``: the device pass, which needs nothing of the candidate's), the gate stopped after it, so that
    each of the 27B's passes fits one command of the GPU machine."""
    from convert.pipeline import build
    from convert.verify import gates

    def keep(name: str, compute):
        if only == "all":
            return phases.run(name, compute)
        if name != only:
            return None
        phases.run(name, compute)
        raise _PassDone

    result, scales = shipped(plan, phases)
    loader = phases.run("hold the target", lambda: build.gate_loader(plan, result, scales))
    try:
        report = phases.run("gate", lambda: gates.gate_streamed(plan, loader, keep=keep))
    except _PassDone:
        return {"pass": only, "seconds": phases.rows[only]["seconds"]}
    return {"passed": report.passed, "metrics": {m.name: m.value for m in report.metrics},
            "device_passed": report.device.passed if report.device else None}


def calls_stage(plan, phases: Phases) -> dict:
    """The package checks' recorded calls of every part as the build records them above
    ``CHAINED_RUN_PARAMETERS`` (``build.record_part``: the part loaded as it is packaged, a copy of it on the torch
    device, the short schedule on the rows the previous part returned), the products in the runtime's true fp16
    (measured on both CPU kinds: the GPU machine has no runtime to ask). Returns each part's call count and the last
    part's largest logit."""
    from convert.pipeline import build

    _without_coreai_torch()
    result, scales = shipped(plan, phases)
    calls = every_parts_calls(plan, result, scales, phases, functools.partial(build.record_part, rounds=True))
    last = calls[-1][-1][2]
    return {"calls": {part.name: len(c) for part, c in zip(plan.parts, calls, strict=True)},
            "largest_logit": float(abs(last["logits"]).max()) if "logits" in last else None}


def every_parts_calls(plan, result, scales, phases: Phases, record) -> list[list]:
    """Each part's package-check calls, one part after the other on the rows the previous part returned, each timed:
    ``record`` is ``build.record_part`` or a call of it (in a fresh process, say)."""
    from convert.pipeline import build
    from convert.weights.shipped import PartLoader

    schedule = build.short_schedule_inputs(PartLoader(plan, result, scales), plan.args.vocab_size)
    rows, calls = [None] * len(schedule), []
    for index, part in enumerate(plan.parts):
        part_calls, rows = phases.run(f"calls {part.name}", functools.partial(
            record, plan, result, index, schedule, rows, scales))
        calls.append(part_calls)
    return calls


def _without_coreai_torch() -> None:
    """Where coreai-torch is not installed (the GPU machine: it needs the 188 MB coreai), a part is loaded with each
    quantized layer's packed module (``export.quantized._packed_module``: coreai-torch's, which only the export and
    the package read) a plain module holding the same codes and tables; a loaded part's calls compute from its fp16
    weight (``QuantizedLinear.shipped_weight``), so what is recorded is the same."""
    import importlib.util

    from torch import nn

    from convert.export import quantized

    if importlib.util.find_spec("coreai_torch") is not None:
        return

    def held(q):  # the codes under coreai-torch's names (``QuantizedLinear.quantized_weight`` reads them)
        module = nn.Module()
        module.register_buffer("indices" if q.method == "lut4" else "quantized_data", q.codes.contiguous())
        for name in ("scale", "zero_point", "lut"):
            if getattr(q, name) is not None:
                module.register_buffer(name, getattr(q, name).contiguous())
        return module

    quantized._packed_module = held
    print("coreai-torch not installed: the parts' packed modules are plain holders of their codes", flush=True)


def package_stage(plan, phases: Phases, work: Path) -> dict:
    """Every part's check calls (``build.record_part`` one part after the other, the build's own arithmetic; saved
    to ``calls.pt`` in ``work``), then every (part, format) job (``package_pool.jobs_of``: the longest first) one at
    a time, each in a fresh process as the pool runs it (``package_pool.package_job``, no build cache), its seconds,
    its process's peak (``VmHWM``) and its package's bytes appended to ``package-jobs.json`` in ``work`` as it ends. A
    job with a row is not run again and the calls file is read back: a stage longer than one command resumes (from the
    same code: the rows do not say which). Returns the jobs' count, the measured rows' count and their seconds."""
    from bench.release_rehearsal import du
    from convert.cache import BuildCache
    from convert.pipeline import build, package_pool
    from convert.processes import in_fresh_process

    result, scales = shipped(plan, phases)
    saved, rows_file = work / "calls.pt", work / "package-jobs.json"
    if saved.is_file():
        calls = torch.load(saved, weights_only=False)
    else:
        calls = every_parts_calls(plan, result, scales, phases, functools.partial(in_fresh_process, build.record_part))
        torch.save(calls, saved)
    done = json.loads(rows_file.read_text()) if rows_file.is_file() else {}
    jobs = package_pool.jobs_of(plan)
    for job in jobs:
        if job.name in done:
            continue
        out = work / "package-job"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        started = time.perf_counter()
        packaged, peak = in_fresh_process(_timed_job, plan, result, scales, job, out, BuildCache(enabled=False),
                                          calls[job.index], len(jobs))
        done[job.name] = {"part": job.part, "format": job.format, "layers": len(plan.parts[job.index].layer_indices),
                          "seconds": round(time.perf_counter() - started, 1),
                          "check_seconds": round(packaged.check_seconds, 1), "host_peak_gib": round(peak / 2**30, 2),
                          "package_bytes": du(packaged.path)}
        print(job.name, done[job.name], flush=True)
        rows_file.write_text(json.dumps(done, indent=1))
        shutil.rmtree(out)
    return {"jobs": len(jobs), "measured": len(done), "seconds": round(sum(r["seconds"] for r in done.values()), 1)}


def whole_target(plan, result, scales):
    """The whole target loaded as the drafter stage holds it (``build._build_parts``'s ``lean_whole``): its quantized
    weights as packed codes."""
    from convert.models.part import Part
    from convert.weights.shipped import PartLoader

    return PartLoader(plan, result, scales).load([Part.whole(plan.args)], lean=True)[0]


def drafter_stage(plan, phases: Phases) -> dict:
    """The drafter stage's torch phases (``drafter_build.build_drafter`` up to its packaging), each timed; a phase
    that raises (the device pass's ``GateError`` on seeded weights, say) is recorded with its message."""
    result, scales = shipped(plan, phases)
    lean_whole = functools.partial(whole_target, plan, result, scales)
    target = phases.run("load the whole target as its codes", lean_whole)
    run = _drafter_run(plan, target, lambda: lean_whole().core.layers, phases.run)
    quantization = run["quantization"]
    verdict = {"tokens_per_round": run["acceptance"].get("tokens_per_round"),
               "quantization": None if quantization is None else quantization.get("method")}
    if isinstance(run["verdicts"]["device_pass"], str):  # the seeded pair's verdict is recorded, the time was spent
        verdict["device_pass"] = run["verdicts"]["device_pass"]
    return verdict


TARGET_CALL_TOKENS = 8
"""``target-calls``: ids of plain greedy decoding timed each way (a prefill of 64 ids, then decode calls)."""


def target_calls_stage(plan, phases: Phases) -> dict:
    """The drafter stage's target calls alone: the whole target held as its codes, its fp32 stage copy on the device
    (``drafter_build.stage_copy``'s, at 128 rows of context), plain greedy decoding of 64 ids (a prefill, then
    ``TARGET_CALL_TOKENS - 1`` decode calls) timed computing from the codes, each ``CodesLinear`` dequantizing its
    weight on every call as in the drafter stage, then again from fp32 weights laid out once on the device
    (``export.quantized.dense_products``, as the gate's candidate computes a piece). Returns each way's seconds a
    call and whether their ids agree. The dense weights take 4 bytes a parameter on the device (about 108 GB at
    27B): use ``--layers`` on a smaller GPU."""
    from convert.export.functions import compute_copy
    from convert.export.quantized import dense_products
    from convert.runtime.host import module_driver
    from convert.weights.shipped import at_context

    result, scales = shipped(plan, phases)
    target = phases.run("load the whole target as its codes", lambda: whole_target(plan, result, scales))
    prompt = list(range(1_000, 1_064))
    context = plan.recipe.target.model_copy(update={"context": 128, "ladder": []})  # as drafter.stage_target's
    target32 = phases.run("stage copy", lambda: compute_copy(at_context(target, plan.args, context), torch.float32,
                                                             share_weights=True, device=plan.torch_device))
    ids, seconds = {}, {}
    for way in ("codes", "dense"):
        if way == "dense":
            phases.run("lay the weights out dense in fp32", lambda: dense_products(target32.core))
        name = f"greedy from the {way}"
        ids[way] = phases.run(name, lambda: module_driver(target32).greedy(prompt, TARGET_CALL_TOKENS)[0])
        row = phases.rows[name]
        seconds[way] = round(row["seconds"] / max(1, row.get("target_calls", 0)), 3)
    return {"seconds_a_call": seconds, "ids_agree": ids["codes"] == ids["dense"]}


ACCEPTANCE_FIELDS = ("tokens_per_round", "acceptance_by_position", "lossless", "near_ties", "rounds", "economics",
                     "ngram")


def drafter_devices_stage(plan, phases: Phases) -> dict:
    """The drafter stage's torch phases on the CPU, then on ``plan``'s device, from one target held as its codes; the
    second against the first: the GPTQ'd codes apart and the largest lut4 table difference (relative), each acceptance
    field equal or not, and the verdicts (lossless, the device pass, the A/B's loss)."""
    import dataclasses

    result, scales = shipped(plan, phases)
    target = phases.run("load the whole target as its codes", lambda: whole_target(plan, result, scales))
    runs = {}
    for device in (torch.device("cpu"), plan.torch_device):
        on = dataclasses.replace(plan, torch_device=device)
        runs[device.type] = phases.run(f"drafter stage on {device.type}", functools.partial(
            _drafter_run, on, target, lambda: whole_target(plan, result, scales).core.layers))
    cpu, other = runs["cpu"], runs[plan.torch_device.type]
    weights = {device: {name: m.quantized_weight() for name, m in run["modules"].core.named_modules()
                        if hasattr(m, "quantized_weight")} for device, run in runs.items()}
    codes = apart = 0
    lut_gap = 0.0
    for name, want in weights["cpu"].items():
        got = weights[plan.torch_device.type][name]
        codes += want.codes.numel()
        apart += int((want.codes != got.codes).sum())
        if want.lut is not None:
            lut_gap = max(lut_gap, float(((got.lut.float() - want.lut.float()).abs() /
                                          want.lut.float().abs().clamp_min(1e-12)).max()))
    acceptance = {key: other["acceptance"].get(key) == cpu["acceptance"].get(key) for key in ACCEPTANCE_FIELDS}
    return {"codes": codes, "codes_apart": apart, "codes_apart_fraction": apart / max(1, codes),
            "lut_max_relative_difference": lut_gap, "acceptance_fields_equal": acceptance,
            "verdicts": {device: run["verdicts"] for device, run in runs.items()},
            "tokens_per_round": {device: run["acceptance"].get("tokens_per_round") for device, run in runs.items()}}


def _drafter_run(plan, target, reload_layers, run=lambda _name, compute: compute()) -> dict:
    """One device's drafter stage, as ``drafter_build.build_drafter`` runs its torch phases (no cache), each phase
    through ``run`` (``Phases.run`` to time it): its modules, quantization record, acceptance and verdicts."""
    from convert.pipeline import drafter_accept, drafter_build
    from convert.progress import stage

    target32 = run("stage copy", lambda: drafter_build.stage_copy(plan, target))
    modules, fp16_modules, quantization = run("shipped drafter", lambda: drafter_build.shipped_drafter(
        plan, target, target32, reload_layers))
    if not len(target32.core.layers):  # let go while GPTQ ran: made again, as build_drafter does
        target32 = run("stage copy again", lambda: drafter_build.stage_copy(plan, target))
    held_out = drafter_build.held_out_prompts(plan)
    acceptance, ab = run("held-out acceptance", lambda: drafter_build.measure_held_out(
        plan, target, target32, modules, fp16_modules, held_out))
    verdicts = {"lossless": acceptance.get("lossless"), "ab_significant_loss": (ab or {}).get("significant_loss")}
    try:
        def device_pass():
            with stage(f"device pass of the pair on {plan.torch_device.type}"):  # its heartbeat: minutes at 27B
                return drafter_accept.device_pass(plan, target, target32, modules, held_out[0][0],
                                                  plan.drafter.config.accept.tokens)

        device = run("device pass", device_pass)
        verdicts["device_pass"] = {"lossless": device["lossless"], "over": device["range"]["over"]}
    except Exception as error:  # noqa: BLE001 - a seeded drafter's verdict is recorded (and compared)
        verdicts["device_pass"] = f"{type(error).__name__}: {error}"
    return {"modules": modules, "quantization": quantization, "acceptance": acceptance, "verdicts": verdicts}


def drafter_package_stage(plan, phases: Phases, work: Path) -> dict:
    """The drafter's (format) jobs as ``drafter_build.build_drafter`` packages them after its torch phases: its
    modules over the lean target (round to nearest in place of GPTQ, see the module docstring), the check's calls
    by its modules as packaged (``drafter_build.packaged_calls``), the target's decoder layers let go, then each
    format alone (``package_formats``, no build cache) with its seconds, its check's seconds, the process's peak so
    far and the package's bytes."""
    from bench.release_rehearsal import du
    from convert.cache import BuildCache
    from convert.pipeline import drafter, drafter_build, drafter_calibration
    from convert.pipeline.packaging import package_formats

    result, scales = shipped(plan, phases)
    dplan, quant = plan.drafter, plan.drafter.config.quantization
    target = phases.run("load the whole target as its codes", lambda: whole_target(plan, result, scales))
    modules = phases.run("load the drafter", lambda: drafter.build_modules(dplan, plan.recipe, target,
                                                                           torch.float16))
    rounded = quant.model_copy(update={"method": quant.format})  # lut4-gptq's format, rounded to nearest
    phases.run(f"quantize the drafter ({rounded.method}, round to nearest)",
               lambda: drafter_calibration.quantize(modules, rounded))
    calls = phases.run("the check's recorded calls", lambda: drafter_build.packaged_calls(
        plan, target, modules, drafter_build.held_out_prompts(plan)))
    target.core.layers = torch.nn.ModuleList()
    stem = drafter_build.package_stem(dplan)
    rows_file = work / "drafter-jobs.json"
    done = json.loads(rows_file.read_text()) if rows_file.is_file() else {}
    for name in plan.recipe.backends:
        if name in done:
            continue
        out = work / "drafter-job"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        started = time.perf_counter()
        (packaged,) = package_formats([name], modules, out, stem, calls, BuildCache(enabled=False),
                                      side_by_side=False)
        done[name] = {"format": name, "seconds": round(time.perf_counter() - started, 1),
                      "check_seconds": round(packaged.check_seconds, 1),
                      "host_peak_gib_so_far": round(_status(os.getpid())["VmHWM"] / 2**30, 2),
                      "package_bytes": du(packaged.path), "calls": len(calls),
                      "max_output_delta": packaged.check.get("max_output_delta")}
        print(f"drafter {name} package", done[name], flush=True)
        rows_file.write_text(json.dumps(done, indent=1))
        shutil.rmtree(out)
    return {"jobs": len(plan.recipe.backends), "measured": len(done)}


def _timed_job(*args):
    """``package_pool.package_job`` in its process; its package and the process's peak resident bytes."""
    from convert.pipeline.package_pool import package_job

    torch.set_num_threads(os.cpu_count() or 1)
    return package_job(*args).packaged, _status(os.getpid())["VmHWM"]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--stage", choices=STAGES, default="gate")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=64, help="the pack's first layers (a quick rehearsal)")
    parser.add_argument("--host-memory-gb", type=float, default=None,
                        help="the recipe's target.max_host_memory_gb (default the recipe's own)")
    parser.add_argument("--calibration-samples", type=int, default=None,
                        help="the drafter stage's GPTQ calibration prompts (default the recipe's)")
    parser.add_argument("--gate-pass", choices=GATE_PASSES, default="all",
                        help="one pass of the gate to time, the gate stopped after it (default: all, and the verdict)")
    parser.add_argument("--no-range", action="store_true",
                        help="skip the range stage, its scales the identity (what it measures on the seeded pack); in "
                             "a drafter stage the drafter's range too (x 1/1 on the seeded pair, 156.5 s on an H100: "
                             "docs/lab/2026-12-08-the-drafter-stage-on-an-h100.md)")
    parser.add_argument("--drafter-layers", type=int, default=None,
                        help="a drafter of N layers at the published width tapping the pack's first --layers (default: "
                             "the published 5 layers, which tap layer 61 and need all 64)")
    parser.add_argument("--drafter-prompts", type=int, default=None,
                        help="the drafter's calibration and acceptance cut to N prompts of 64 ids, 32 generated, "
                             "calibrated on the fixture corpus's shipped validation split")
    parser.add_argument("--check-bound", type=float, default=None,
                        help="the package checks' fp16 output bound for this run (default the build's, "
                             "checks.FP16_OUTPUT_BOUND): to time a whole check of a seeded checkpoint above it")
    parser.add_argument("--profile-target-calls", type=int, default=0, metavar="N",
                        help="a drafter (or target-calls) stage's target calls 3 .. N + 2 profiled (torch.profiler: "
                             "each call's seconds and its operators by their time on the device); every phase counts "
                             "its target calls")
    options = parser.parse_args()

    from bench import release_rehearsal as seeded

    with_drafter = options.stage.startswith("drafter")
    if with_drafter and options.layers < 64 and options.drafter_layers is None:
        parser.error(f"--stage {options.stage} needs the pack's 64 layers (the drafter's taps reach layer 61) or "
                     "--drafter-layers")
    taps = seeded.DRAFTER_TAPS if options.drafter_layers is None else \
        sorted({round(i * (options.layers - 1) / 4) for i in range(5)})  # five spread over the pack's layers

    work = options.workdir.resolve()
    cache = work / "hf-cache"
    os.environ.update({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "SPEC_CONVERT_CACHE": str(work / "cache")})
    from convert.pipeline.plan import make_plan
    from convert.torch_device import describe, resolve

    device = resolve(options.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    counted = options.stage.startswith("drafter") or options.stage == "target-calls"
    calls = TargetCalls(device, options.profile_target_calls) if counted else None
    phases = Phases(device, options.no_range, calls)
    result: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                    "device": describe(device), "stage": options.stage, "phases": phases.rows}
    if options.check_bound is not None:
        from convert.verify import checks

        print(f"the package checks' output bound {options.check_bound} for this run (the build's: "
              f"{checks.FP16_OUTPUT_BOUND})", flush=True)
        result["check_bound"] = checks.FP16_OUTPUT_BOUND = options.check_bound
    written = work / f"pack-{options.layers}-layers.written"
    if not written.is_file():  # a resumed stage keeps the pack its first command wrote
        pack = seeded.snapshot_dir(cache, seeded.PACK_REPO, seeded.PACK_REVISION)
        phases.run("write the pack", lambda: seeded.write_pack(pack, layers=options.layers))
        written.touch()
    drafter_written = work / ("drafter.written" if options.drafter_layers is None else
                              f"drafter-{options.drafter_layers}-layers-{options.layers}.written")
    if with_drafter and not drafter_written.is_file():
        checkpoint = seeded.snapshot_dir(cache, seeded.DRAFTER_REPO, seeded.DRAFTER_REVISION)
        for old in work.glob("drafter*.written"):
            old.unlink()
        phases.run("write the drafter", lambda: seeded.write_drafter(
            checkpoint, layers=options.drafter_layers or 5, taps=taps))
        drafter_written.touch()
    import yaml

    recipe = yaml.safe_load(seeded.RECIPE.read_text())
    if not with_drafter:
        recipe.pop("drafter", None)  # the target's stages: the drafter's checkpoint is not written
    elif options.calibration_samples:
        recipe["drafter"]["quantization"]["calibration"] = {"samples": options.calibration_samples}
    if with_drafter and options.no_range:
        recipe["target"]["rescale"] = False  # the drafter stage ranges the drafter where the target rescales
    if with_drafter and options.drafter_prompts:
        cut = {"samples": options.drafter_prompts, "length": 64, "tokens": 32}
        recipe["drafter"]["quantization"]["calibration"] = {"corpus": "fixture:validation", **cut}
        recipe["drafter"]["accept"] = cut
    if with_drafter and options.drafter_layers is not None:
        count = options.drafter_layers
        recipe["drafter"]["contract"].update({"num_hidden_layers": count, "layer_types": ["sliding_attention"] * count,
                                              "dflash_config.target_layer_ids": taps})
    contract = recipe["target"]["contract"]
    contract["text_config.layer_types"] = contract["text_config.layer_types"][:options.layers]
    contract["text_config.num_hidden_layers"] = options.layers
    recipe["target"]["taps"] = taps if with_drafter and options.drafter_layers is not None else \
        [t for t in recipe["target"]["taps"] if t < options.layers] or [0]
    if options.host_memory_gb:
        recipe["target"]["max_host_memory_gb"] = options.host_memory_gb
    planned = work / seeded.RECIPE.name
    planned.write_text(yaml.safe_dump(recipe))
    plan = phases.run("plan", lambda: make_plan(planned, str(work / "bundle"), torch_device=device))
    stages = {"gate": functools.partial(gate_stage, only=options.gate_pass), "calls": calls_stage,
              "package": functools.partial(package_stage, work=work),
              "drafter": drafter_stage, "drafter-package": functools.partial(drafter_package_stage, work=work),
              "drafter-devices": drafter_devices_stage, "target-calls": target_calls_stage}
    if calls:
        result["profiled_target_calls"] = calls.rows
    result["verdict"] = stages[options.stage](plan, phases)
    result["disk"] = {"hf_cache": seeded.du(cache), "build_cache": seeded.du(work / "cache")}
    print(result["verdict"], result["disk"], flush=True)
    write_json(options.json, result)


if __name__ == "__main__":
    main()
