"""A plan's costs: its host memory against ``target.max_host_memory_gb`` (the drafter stage's phases, the refusal
of a build that would not fit) and its stages' estimated time, from measured rates. Each function takes a
``plan.Plan`` (which reads its memory through them: this module imports no plan)."""

from __future__ import annotations

import math

from convert.errors import InputError
from convert.export.spec import buffer_specs, size_text
from convert.models import family_of
from convert.pipeline.drafter import MAX_SESSIONS, stage_target
from convert.pipeline.partition import (
    BASE_BYTES,
    build_memory_bytes,
    held_target_bytes,
)
from convert.weights.quantize import quantize_seconds


def refusal(plan) -> tuple[str, str] | None:
    """Why the build would be refused for host memory (``check_host_memory``), as (the stage over the budget, what
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


def check_host_memory(plan) -> None:
    """A parted target's packaging fits ``target.max_host_memory_gb`` by construction (``plan_parts``); its streamed
    gate holds every window's states, which the gate data sets: refuse a gate that would not fit, before any work."""
    target, refused = plan.recipe.target, refusal(plan)
    if refused is None:
        return
    if refused[0] == "the drafter stage":
        raise InputError(f"{plan.recipe_path}: drafter: the drafter stage needs about "
                         f"{plan.drafter_stage_bytes / 1e9:.0f} GB ({drafter_stage_parts(plan)}), over "
                         f"target.max_host_memory_gb {target.max_host_memory_gb:g}; build the target alone here (a "
                         "recipe without the drafter), or the pair on a machine with that memory and a "
                         "max_host_memory_gb to match")
    data = target.gate.data
    raise InputError(f"{plan.recipe_path}: target.gate.data: the streamed gate over {data.samples} x {data.length} "
                     f"tokens needs about {plan.peak_memory_bytes / 1e9:.1f} GB of host memory (every window's "
                     f"states and taps, the largest piece of the target in fp16 and fp32), over "
                     f"target.max_host_memory_gb {target.max_host_memory_gb:g}; lower samples or length, or raise "
                     "max_host_memory_gb")


def drafter_stage_parts(plan) -> str:
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


# Measured rates the summary's time estimates scale (an estimate, never a promise; a stage not measured says so).
# The quantize stage: ``convert.weights.quantize.COST_MODEL`` (bench/scale.py at the 27B geometry, one H200 and 2 CPU
# cores). The gate: the 27B gate on this repo's 2-core CPU machine (docs/lab/2026-12-05-gate-candidate-in-step.md and
# -gate-streamed-reference.md): the candidate about 2.25 h and the streamed reference 3,022 s, about 3.1 h, for
# 26,895,998,464 parameters over 16 windows of 256 tokens and 16 greedy tokens; scaled by parameters x windows x
# (length + greedy). On one GPU (``build --device cuda``, docs/lab/2026-12-06-torch-stages-on-a-gpu.md): the
# reference 40.7 s on one H200; the candidate 341.0 s on one H100 at full size, the target held there as its codes
# (bench/gpu_stages.py --gate-pass candidate, docs/lab/2026-12-07-27b-pair-on-an-h100.md).
GATE_REFERENCE_CPU_SECONDS = 3022
GATE_CANDIDATE_CPU_SECONDS = 2.25 * 3600
GATE_REFERENCE_GPU_SECONDS = 40.7
GATE_CANDIDATE_GPU_SECONDS = 341.0


GATE_MEASURED_PARAMETERS = 26_895_998_464


# The range stage (``target.rescale``): one fp32 pass, one piece at a time, over the gate's first window of 256 ids,
# on the 16-core CPU of the device tool's H100 machine (bench/gpu_stages.py, docs/bench-logs/gpu-stages-gate-h100.log):
# 52 of the 27B's 66 pieces in 346 s, about 439 s for all; with ``--device cuda`` on that machine's H100, all 66 in
# 111.9 s (docs/bench-logs/gpu-stages-gate-h100-2026-12-07-candidate.log); not measured on the 2-core machine.
RANGE_SECONDS_16_CORES = 439
RANGE_SECONDS_GPU = 111.9


GATE_MEASURED_TOKENS = 16 * (256 + 16)


# Packaging: the parted 27B target in both formats on the same machine (docs/lab/2026-12-07-27b-on-an-h100-profiles.md,
# bench/gpu_stages.py --stage package): its 14 parts' check calls recorded in 547.9 s, then its 28 (part, format) jobs
# one after the other in 12,361.5 s; scaled by parameters and formats. Core AI's and Core ML's converters and the
# runtime's check run on the CPU: on the GPU machine (16 cores, 128 GB) a pool of 8 jobs at once, longest first, takes
# about 1,700 s of the same jobs (computed from the measured jobs, 2 cores each; not run), after the 14 parts' check
# calls recorded on its H100 in 84.4 s (bench/gpu_stages.py --stage calls, docs/lab/2026-12-07-27b-pair-on-an-h100.md).
PACKAGING_CPU_SECONDS = 547.9 + 12_361.5
PACKAGING_CALLS_GPU_SECONDS = 84.4
PACKAGING_POOL_SECONDS = 1_700


PACKAGING_MEASURED_PARAMETERS = 26_895_998_464


PACKAGING_MEASURED_FORMATS = 2


# The drafter's packages: the Bonsai 27B DFlash2 drafter (1,924,404,480 parameters, lut4) on the 2-core machine
# (bench/gpu_stages.py --stage drafter-package, docs/lab/2026-12-07-27b-pair-on-an-h100.md): its check's calls recorded
# by its packaged modules in 1,305.6 s, then each (format) job with its check: Core AI 2,131.1 s (the runtime's replay
# of 23 calls 2,068.4 s), Core ML 162.0 s; scaled by the drafter's parameters.
DRAFTER_CALLS_CPU_SECONDS = 1_305.6
DRAFTER_JOB_CPU_SECONDS = {"coreai": 2_131.1, "coreml": 162.0}
DRAFTER_MEASURED_PARAMETERS = 1_924_404_480


# The drafter stage's torch phases on one H100 at full size (bench/gpu_stages.py --stage drafter --drafter-prompts 2,
# the seeded Bonsai 27B pair, docs/lab/2026-12-08-the-drafter-stage-on-an-h100.md): the range over speculative
# decoding of 32 tokens in 156.5 s, the GPTQ calibration's speculative decoding of 2 prompts of 64 ids, 32 generated,
# in 165.9 s; (seconds, tokens: generated for the range, prompt and generated for the calibration), scaled by the
# target's parameters and the recipe's tokens. With the seeded drafter's acceptance, not a trained one's. Its GPTQ,
# acceptance and A/B were not measured there.
DRAFTER_RANGE_GPU = (156.5, 32)
DRAFTER_CALIBRATION_GPU = (165.9, 2 * (64 + 32))


CPU_MACHINE = "2 CPU cores"  # COST_MODEL's name of the CPU machine the rates were measured on


GPU_MACHINE = "one H200"


GB = 1e9

# Above this many parameters a parted target's artifact check replays a few rows on each part on its own: the Linux
# Core AI runtime emulates fp16 (about 24 s for one 64-token call at 11.8M parameters, docs/benchmarks.md), so the
# chained run of every part would take hours at 27B. The build reads it as ``build.CHAINED_RUN_PARAMETERS``.
CHAINED_RUN_PARAMETERS = 50_000_000


def cpu_seconds(plan) -> dict[str, float]:
    """The estimated seconds of the stages measured on the CPU machine (``quantize``, ``gate``, ``packaging``), scaled
    from the rates above; a stage with nothing to do or no measured rate left out."""
    target = plan.recipe.target
    seconds = {}
    if target.quantization.format not in (None, "exact2"):
        quantize = quantize_seconds(plan.args, target).get(CPU_MACHINE)
        if quantize is not None:
            seconds["quantize"] = quantize
    seconds["gate"] = (GATE_REFERENCE_CPU_SECONDS + GATE_CANDIDATE_CPU_SECONDS) * gate_scale(plan)
    seconds["packaging"] = PACKAGING_CPU_SECONDS * packaging_scale(plan)
    return seconds


def packaging_scale(plan) -> float:
    """The plan's packaging against the measured one: parameters x formats."""
    return plan.args.parameter_count / PACKAGING_MEASURED_PARAMETERS * len(plan.recipe.backends) / \
        PACKAGING_MEASURED_FORMATS


def gpu_packaging_seconds(plan) -> float:
    """The packaging stage on the GPU machine: the parts' check calls on its GPU (scaled by parameters), then the
    pool of (part, format) jobs on its cores (parameters x formats)."""
    return PACKAGING_CALLS_GPU_SECONDS * plan.args.parameter_count / PACKAGING_MEASURED_PARAMETERS + \
        PACKAGING_POOL_SECONDS * packaging_scale(plan)


def drafter_packaging_seconds(plan) -> float:
    """The drafter's packages on the 2-core machine: its check's calls, then its (format) jobs, by its parameters."""
    return (DRAFTER_CALLS_CPU_SECONDS + sum(DRAFTER_JOB_CPU_SECONDS[name] for name in plan.recipe.backends)) * \
        plan.drafter.args.parameter_count / DRAFTER_MEASURED_PARAMETERS


def drafter_gpu_seconds(plan) -> dict[str, float]:
    """The drafter stage's torch phases measured on one H100 (``DRAFTER_RANGE_GPU``, ``DRAFTER_CALIBRATION_GPU``)
    that this plan runs: its range where the target rescales, its GPTQ calibration for a ``-gptq`` method."""
    config, scale = plan.drafter.config, plan.args.parameter_count / GATE_MEASURED_PARAMETERS
    seconds = {}
    if plan.recipe.target.rescale:
        measured, tokens = DRAFTER_RANGE_GPU
        seconds["range"] = measured * scale * config.accept.tokens / tokens
    calibration = config.quantization.calibration
    if config.quantization.method.endswith("-gptq"):
        measured, tokens = DRAFTER_CALIBRATION_GPU
        seconds["calibration"] = measured * scale * calibration.samples * (calibration.length + calibration.tokens) / \
            tokens
    return seconds


def range_seconds(plan, measured: float) -> float:
    """The range stage's seconds where it took ``measured`` at 27B (``RANGE_SECONDS_16_CORES``,
    ``RANGE_SECONDS_GPU``), scaled by parameters x windows x (length + 1)."""
    target = plan.recipe.target
    return measured * plan.args.parameter_count / GATE_MEASURED_PARAMETERS * \
        max(1, target.gate.device_samples) * (target.gate.data.length + 1) / (256 + 1)


def gate_scale(plan) -> float:
    """The plan's gate against the measured one: parameters x windows x (length + greedy tokens)."""
    target, data = plan.recipe.target, plan.recipe.target.gate.data
    return plan.args.parameter_count / GATE_MEASURED_PARAMETERS * data.samples * (
        data.length + target.gate.greedy_tokens) / GATE_MEASURED_TOKENS


def peak_memory_bytes(plan) -> int:
    """Estimate of the build's peak host memory (``convert/pipeline/partition.py``: measured costs), the drafter
    stage's included; computed once (it builds the target's parameterless core)."""
    return max(build_memory_bytes(plan.args, plan.recipe.target, plan.parts, plan.specs), plan.drafter_stage_bytes)


def gate_state_room(plan) -> int:
    """Bytes of the streamed gate's window states its candidate may hold in memory between greedy passes rather than
    on disk: what ``target.max_host_memory_gb`` leaves above the build's peak estimate (which counts them on disk)."""
    return max(0, int(plan.recipe.target.max_host_memory_gb * 1e9) - plan.peak_memory_bytes)


def drafter_stage_target_bytes(plan) -> int:
    """The target as the drafter stage holds it with its fp32 compute copy (calibration, acceptance, the A/B): a
    whole target's modules, a parted target's quantized weights as packed codes (``held_target_bytes``)."""
    return held_target_bytes(plan.args, plan.recipe.target, lean=not plan.parts[0].is_whole)


def drafter_stage_bytes(plan) -> int:
    """Host memory of the drafter stage (0 without a drafter): its largest phase (``drafter_phases``) above the
    process's base."""
    if not plan.drafter:
        return 0
    return BASE_BYTES + max(sum(shares.values()) for shares in plan.drafter_phases.values())


def drafter_phases(plan) -> dict[str, dict[str, int]]:
    """Each phase of the drafter stage's host memory by share: the drafter's own (``drafter_memory.own_phase_bytes``),
    the target as that phase holds it (all of it while it is called: load, calibration, acceptance; a parted
    target's tables alone while GPTQ runs, its layers loaded again after; its tables at packaging) and, where
    prompts run, the sessions' states (``drafter_sessions``)."""
    whole = plan.drafter_stage_target_bytes
    sizes = plan.sizes
    tables = int((sizes.embedding_row + sizes.head_row) * plan.args.vocab_size) + sizes.norm
    let_go = {"package"} | ({"quantize"} if not plan.parts[0].is_whole and
                             plan.drafter.config.quantization.uses_gptq else set())
    sessions = plan.drafter_sessions * plan.drafter_session_bytes
    return {phase: {"target": tables if phase in let_go else whole, "drafter": own,
                    "sessions": sessions if phase in ("calibrate", "accept") else 0}
            for phase, own in plan.drafter_own_phases.items()}


def drafter_session_bytes(plan) -> int:
    """One session of the drafter stage's prompts: the states (the ane layout: the host's buffers) of the target's
    and the drafter's fp32 compute copies (every element counted at 4 bytes), the target's at the rows the stage
    reaches (``drafter.stage_target``)."""
    specs = family_of(plan.args).function_specs(plan.args, stage_target(plan.recipe))
    states = [*specs[0].states, *plan.drafter.specs[0].states, *buffer_specs(specs, plan.host_buffers),
              *buffer_specs(plan.drafter.specs, tuple(plan.drafter.contract.get("buffers", {})))]
    return sum(4 * math.prod(s.shape) for s in states)


def drafter_sessions(plan) -> int:
    """Prompts the drafter stage runs at once (``convert.pipeline.drafter.over_prompts``): as many sessions as
    ``target.max_host_memory_gb`` holds beside the rest of the phases that run prompts (calibration, acceptance),
    at least one, at most ``drafter.MAX_SESSIONS`` (each block of a weight is made once for all of them:
    ``bench/sessions_in_step.py``)."""
    own = plan.drafter_own_phases
    held = plan.drafter_stage_target_bytes + max(own.get("calibrate", 0), own["accept"])
    room = plan.recipe.target.max_host_memory_gb * 1e9 - BASE_BYTES - held
    return int(min(MAX_SESSIONS, max(1, room // plan.drafter_session_bytes)))
