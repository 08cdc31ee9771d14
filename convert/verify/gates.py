"""Numeric gates (fail closed): the shipped graphs against the transformers reference, on held-out text.

Reference: the transformers model in fp32 on the evaluation windows. Candidate: the export modules
(``TargetModules``) with the weights exactly as shipped (fp16, quantized where the recipe says), called
function by function the way a runtime calls them, on one KV state per window:

1. ``prefill`` over the first half of the window in chunks of the prefill width (the last chunk
   right-padded, as a host pads a prompt);
2. the block-vs-chain probe: ``verify`` over the next K positions (K = the verify width), then a
   rollback to its first ``a`` rows and K - a ``decode`` steps over the same tokens; the argmax ids of the verify's
   rows a.. and of the chain are compared. A dense target probes one block with a = 0; a hybrid target, whose
   rollback commits the kept rows on the next call, probes four blocks with a = 0, K/2, K-1 and 1 (partial
   accepts, each chain starting from a state the commit made);
3. ``verify`` blocks over the rest of the window, each carrying a draft whose last 0..K/2 tokens are
   wrong (seeded): only the accepted rows are read, and the next block starts at the first rejected
   position, so the rejected rows are rolled back as on a device (``convert.runtime.host.TargetDriver`` calls the
   functions through the target's host contract);
4. ``decode`` steps: a greedy continuation of G tokens from the end of the window.

Every position of the window thus has candidate logits computed from the true tokens before it.

Candidate arithmetic: fp32, on the shipped weights (fp16 values upcast, exactly). On this CPU fp16 torch
runs prefill and verify calls 3-7x slower than fp32, which would take the 32 x 256 fixture gate past a
minute; fp32 isolates what the shipped weights (fp16 rounding, 4-bit quantization) do to the model. The
device's fp16 arithmetic is the second candidate's (``device_pass``): the fp16 modules computed as the device the
layout targets computes (``convert.fp16.DeviceArithmetic``: the ANE's or the GPU's) on the first windows, with its
own bars and a range verdict (``RangeReport``: every product's input and port and every module's output within its
limit, named). ``artifact_gate`` then shows the shipped ``.aimodel`` on the Core AI runtime gives the argmax ids of
the fp16 modules (``convert.verify.checks.run_coreai``). ``compute_dtype`` can select fp16 for a measurement of what
torch's fp16 arithmetic adds (docs/benchmarks.md, "Gates").

Metrics, over every position of every window (n x length):

- ``kl_mean`` / ``kl_p99`` / ``kl_max``: KL(reference || candidate) of the next-token distributions (nats).
- ``top1``: fraction of positions whose argmax ids agree.
- ``logits_cosine``: mean over positions of the cosine between the two logit vectors.
- ``greedy_match``: from the end of each window, both greedily continue G tokens on their own; the
  number of leading tokens that agree, divided by G, averaged over windows (1.0: every continuation
  identical; one diverging at its first token counts 0 for that window). The reference's continuation is
  computed teacher-forced on the candidate's, in one forward (``_reference_window``): up to the first
  difference it is the reference's own, and the metric reads no further.
- ``tap_cosine[i]``: for each tapped layer i, the mean over positions of the cosine between the
  candidate's ``taps`` slice and the reference's layer-i output (the features a conditioned drafter
  reads). The mean, not the minimum: the minimum over n x length positions falls with n and would make
  the bar depend on the amount of data, while the mean is stable.
- ``block_chain_real_flips``: probe positions whose verify argmax differs from the decode chain's by
  more than a near tie (see ``classify_flips``); ``block_chain_near_ties`` is reported, not gated.
"""

from __future__ import annotations

import functools
import inspect
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from convert.errors import InputError, PackageError
from convert.export.functions import compute_copy
from convert.export.hadamard import as_products
from convert.export.lockstep import over_sessions
from convert.export.names import ARGMAX_IDS, LOGITS, TAPS
from convert.export.quantized import dense_products
from convert.fp16 import Peaks, device_arithmetic
from convert.inputs.thresholds import GateThresholds, default_thresholds
from convert.models import family_of
from convert.models.part import HIDDEN_OUT, Part
from convert.progress import bar as progress_bar
from convert.progress import console, steps
from convert.runtime.chain import coreai_chain, coreai_functions, link_inputs, module_chain
from convert.runtime.host import COMMIT, ModuleFunctions, TargetDriver, module_driver, module_lookup
from convert.torch_device import free_bytes
from convert.verify import checks
from convert.verify.reference import memory_mapped, streamed_reference
from convert.verify.report import (
    WHOLE_RUN,
    ArtifactResult,
    DevicePass,
    EvalIdentity,
    Flip,
    GateReport,
    Metric,
    NotRun,
    RangeReport,
)
from convert.weights import rescale
from convert.weights.quantize import calibration_text
from convert.weights.target import TargetModules
from manifests.identity import REPORT_FILE as REPORT_FILE  # the report's name, re-exported (verify reads it there)
from manifests.schema import Rescale
from quant.calibrate import fixture_corpus_text, sample_calibration

# What a parted target's artifact gate ran (ArtifactResult.scope; a whole target's: ``report.WHOLE_RUN``)
PARTS_CHAINED = ("every part's .aimodel chained on the runtime (its own rows passed from part to part) in lockstep "
                 "with the chained torch parts, the same calls as a whole target's; and each part replayed on its own")
PARTS_REPLAYED = ("each part's .aimodel replayed on its own against the torch part over a decode, a kept decode and a "
                  "verify (10 rows at verify 8), fed the torch chain's rows; the prefill function and the runtime's "
                  "own rows carried across parts are not run at this size (every function's quantized constants are "
                  "still read back bit-exact)")


@dataclass(frozen=True)
class EvalData:
    tokens: torch.Tensor  # int64 [n, length]
    identity: EvalIdentity

    @classmethod
    def from_text(cls, text: str, tokenizer, n: int, length: int, seed: int = 0, corpus: str = "text") -> EvalData:
        """``n`` windows of ``length`` tokens of ``text`` through ``tokenizer`` (``sample_calibration``'s sampler)."""
        sample = sample_calibration(text, tokenizer, n=n, length=length, seed=seed)
        identity = EvalIdentity(corpus=corpus, corpus_sha256=sample.corpus_sha256, n=n, length=length, seed=seed)
        return cls(tokens=sample.tokens, identity=identity)

    @classmethod
    def fixture(cls, tokenizer, n: int = 32, length: int = 256, seed: int = 0) -> EvalData:
        """The default evaluation data: the fixture corpus' held-out split (never trained on)."""
        return cls.from_text(fixture_corpus_text("eval"), tokenizer, n, length, seed, corpus="fixture:eval")


# The arithmetic each graph layout's package computes in on the device (``convert.fp16``): the ane layout's programs run
# on the Neural Engine, the stateful layout's on the GPU through Core ML.
DEVICE_OF_LAYOUT = {"ane": "ane", "stateful": "gpu"}


class RowFlip(NamedTuple):
    row: int
    block_id: int
    chain_id: int
    gap: float
    near_tie: bool


def classify_flips(block: torch.Tensor, chain: torch.Tensor, margin: float) -> list[RowFlip]:
    """The rows where the argmax ids of ``block`` [K, V] and ``chain`` [K, V] logits differ.

    The gap is the larger of the two computations' logit differences between the two ids: a flip is a
    near tie only when both the block and the chain had the two ids within ``margin`` of each other.
    """
    block_ids, chain_ids = block.argmax(-1), chain.argmax(-1)
    flips = []
    for row in torch.nonzero(block_ids != chain_ids).flatten().tolist():
        a, b = int(block_ids[row]), int(chain_ids[row])
        gap = max(float(block[row, a] - block[row, b]), float(chain[row, b] - chain[row, a]))
        flips.append(RowFlip(row, a, b, gap, gap < margin))
    return flips


def run_gates(
    reference,
    modules: TargetModules,
    data: EvalData,
    thresholds: GateThresholds,
    taps: list[int] | None = None,
    greedy_tokens: int = 16,
    probe_accepts: tuple[int, ...] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    device: str | None = None,
    device_windows: int = 0,
    torch_device: torch.device | None = None,
) -> GateReport:
    """Gate ``modules`` (weights as shipped) against ``reference`` (a transformers causal LM in fp32).

    ``taps``: tapped layers to gate (default: every tap the modules return). ``probe_accepts``: one verify block
    per entry, compared with the decode chain after keeping that many of its rows (default: ``default_probe``).
    The modules' own states are left untouched: the candidate runs on a copy in ``compute_dtype``.
    ``device`` (``DEVICE_OF_LAYOUT``): the second candidate, the fp16 modules in that device's arithmetic on the first
    ``device_windows`` windows (``DevicePass``). ``torch_device``: where the reference and both candidates compute
    (``convert.torch_device``; default the CPU); the statistics are taken on the CPU.
    """
    start = time.perf_counter()
    taps = list(modules.core.taps) if taps is None else list(taps)
    probe_accepts = default_probe(modules) if probe_accepts is None else tuple(probe_accepts)
    _check_reference(reference, modules)
    _check_inputs(modules, data, taps, greedy_tokens, probe_accepts)
    torch_device = torch_device or torch.device("cpu")
    reference.to(torch_device)
    candidate = compute_copy(modules, compute_dtype, device=torch_device)
    generator = torch.Generator().manual_seed(data.identity.seed)
    stats = _Stats(taps)
    windows = data.tokens.tolist()
    device_windows = min(device_windows, len(windows)) if device else 0
    kept: list[tuple[_Window, _Window]] = []  # the first windows' (reference, candidate), for the device pass
    with progress_bar(progress) as bar:
        task = bar.add_task("numeric gate", total=data.identity.n + device_windows, what="windows")
        for index, window in enumerate(windows):
            cand = _candidate_window(candidate, window, taps, greedy_tokens, probe_accepts, generator)
            ref = _reference_window(reference, window, taps, cand.greedy, modules)
            stats.add(index, ref, cand, thresholds.near_tie_margin)
            stats.add_greedy(ref.greedy, cand.greedy)
            if index < device_windows:
                kept.append((ref, cand))
            bar.advance(task)
        device_result = None
        if device_windows:
            device_result = device_pass(reference, modules, windows[:device_windows], kept, device, thresholds, taps,
                                 greedy_tokens, probe_accepts, data.identity.seed, lambda: bar.advance(task),
                                 torch_device)
    weights = str(next(modules.core.parameters()).dtype).removeprefix("torch.")
    report = _report(stats, thresholds, data, f"export modules, weights as shipped ({weights}), computed in "
                     f"{str(compute_dtype).removeprefix('torch.')}{_on(torch_device)}", greedy_tokens, start)
    report.device = device_result
    return report


def device_pass(reference, modules: TargetModules, windows: list[list[int]], kept: list[tuple[_Window, _Window]],
                device: str, thresholds: GateThresholds, taps: list[int], greedy_tokens: int,
                probe_accepts: tuple[int, ...], seed: int, advance=lambda: None,
                torch_device: torch.device | None = None) -> DevicePass:
    """``DevicePass``: the shipped fp16 modules computed in ``device``'s arithmetic on ``windows`` (the same schedule
    and seeded drafts as the fp32 candidate's), against the reference's windows ``kept`` beside the fp32 candidate's
    (the reference computed again only where the device's greedy ids part from the fp32 candidate's), every product
    port and module output watched (``RangeReport``)."""
    start = time.perf_counter()
    candidate = compute_copy(modules, torch.float16, device=torch_device)
    peaks = Peaks(only=torch.float16, target=candidate.core)
    generator = torch.Generator().manual_seed(seed)
    stats = _Stats(taps)
    for index, (window, (ref, fp32)) in enumerate(zip(windows, kept, strict=True)):
        with device_arithmetic(device, peaks):
            cand = _candidate_window(candidate, window, taps, greedy_tokens, probe_accepts, generator)
        cand.logits = cand.logits.float()
        cand.taps = {t: v.float() for t, v in cand.taps.items()}
        if cand.greedy != fp32.greedy:
            ref = _reference_window(reference, window, taps, cand.greedy, modules)
        stats.add(index, ref, cand, thresholds.near_tie_margin)
        stats.add_greedy(ref.greedy, cand.greedy)
        advance()
    return _device_result(stats, thresholds, device, len(windows), RangeReport.of(device, peaks),
                          time.perf_counter() - start)


TOP1_BEYOND_NEAR_TIES = "top1_beyond_near_ties"  # the device pass's gated top-1 (``_device_result``)


def _device_result(stats: _Stats, thresholds: GateThresholds, device: str, windows: int, range_report: RangeReport,
                   seconds: float) -> DevicePass:
    """A device pass's metrics on its own bars (the rest reported, not gated) and its range verdict. Its top-1 bar
    holds ``top1_beyond_near_ties``: a position where the device's id is not the reference's best counts as agreeing
    when the reference's logit for it is within the near-tie margin of its best (the same margin the block-chain
    probe and the package checks give a tie): fp16 on any device may flip such a near tie, and one flip is a large
    fraction of a pass over one window. ``top1`` is reported beside it."""
    th = thresholds
    gated = {"kl_mean": (th.device_mean_kl_max, "max"), "greedy_match": (th.device_greedy_match_min, "min")}
    metrics = []
    for m in stats.metrics(thresholds):
        if m.name in gated:
            metrics.append(Metric.gated(m.name, m.value, *gated[m.name]))
        elif m.name not in ("kl_p99", "block_chain_real_flips"):
            metrics.append(Metric(name=m.name, value=m.value, threshold=None, bound=None, passed=True))
        if m.name == "top1":
            clear = float(torch.cat(stats.top1_clear).double().mean())
            metrics.append(Metric.gated(TOP1_BEYOND_NEAR_TIES, clear, th.device_top1_min, "min"))
    return DevicePass(device=device, windows=windows, metrics=metrics, range=range_report, seconds=seconds)


def measure_range(modules: TargetModules, windows: list[list[int]], seed: int, greedy_tokens: int = 1,
                  torch_device: torch.device | None = None) -> Peaks:
    """The peaks (``convert.fp16.Peaks``, named under ``target``) of every product's input and port and every module's
    output as the fp32 modules compute ``windows`` through the gate's schedule (on ``torch_device``, default the CPU):
    what ``convert.weights.rescale`` chooses its scales from."""
    candidate = compute_copy(modules, torch.float32, device=torch_device)
    peaks = Peaks(target=candidate.core)
    generator = torch.Generator().manual_seed(seed)
    taps, probe = list(modules.core.taps), default_probe(modules)
    for window in windows:
        with device_arithmetic(None, peaks):
            _candidate_window(candidate, window, taps, greedy_tokens, probe, generator)
    return peaks


def range_scales(modules: TargetModules, data: EvalData, device: str, windows: int,
                 torch_device: torch.device | None = None) -> tuple[rescale.Scales, Rescale]:
    """The scales (``convert.weights.rescale``) that bring the fp32 peaks of ``modules`` (the checkpoint's weights as
    they are) on the first ``windows`` windows of ``data`` within ``device``'s limits, and their record, printed; the
    peaks computed on ``torch_device`` (default the CPU). Raises ``rescale.RangeError`` where no scale reaches a
    tensor past its limit."""
    _check_inputs(modules, data, list(modules.core.taps), 1, default_probe(modules))
    tokens = data.tokens.tolist()[:max(1, windows)]
    peaks = measure_range(modules, tokens, data.identity.seed, torch_device=torch_device)
    return _chosen(peaks, modules.core, device, len(tokens))


def streamed_range_scales(loader, data: EvalData, device: str, windows: int,
                          torch_device: torch.device | None = None) -> tuple[rescale.Scales, Rescale]:
    """``range_scales`` one piece of the target at a time (``streamed_candidate``; ``loader``: a
    ``convert.weights.shipped.PartLoader`` of the checkpoint's weights as they are: neither quantized nor scaled)."""
    outline, peaks = loader.outline, Peaks()
    _check_inputs(outline, data, list(outline.core.taps), 1, default_probe(outline))
    tokens = data.tokens.tolist()[:max(1, windows)]
    streamed_candidate(loader, tokens, list(outline.core.taps), 1, default_probe(outline),
                       torch.Generator().manual_seed(data.identity.seed), peaks=peaks, what="range: the fp32 run",
                       torch_device=torch_device)
    return _chosen(peaks, outline.core, device, len(tokens))


def _chosen(peaks: Peaks, core, device: str, windows: int) -> tuple[rescale.Scales, Rescale]:
    """The scales ``rescale.choose`` takes from ``peaks`` (named under ``target``, as ``core``'s layers are numbered),
    printed, and their record."""
    scales, entries = rescale.choose(peaks, device, rescale.classes(core, "target"), "target")
    for line in rescale.lines(scales, entries, device):
        console.print(line)
    return scales, Rescale.model_validate(rescale.record(scales, entries, device, windows))


@dataclass
class _DeviceRun:
    """A streamed device pass's candidate windows, its range verdict and its seconds (kept as one)."""

    windows: list[_Window]
    range: RangeReport
    seconds: float


def run_streamed_gates(source: Path, loader, data: EvalData, thresholds: GateThresholds,
                       taps: list[int] | None = None, greedy_tokens: int = 16,
                       probe_accepts: tuple[int, ...] | None = None, keep=None, device: str | None = None,
                       device_windows: int = 0, torch_device: torch.device | None = None,
                       state_room: int = 0) -> GateReport:
    """``run_gates`` for a target larger than memory: the transformers reference (``convert.verify.reference``) and the
    candidate (``loader``: a ``convert.weights.shipped.PartLoader``) each hold one decoder layer at a time, running
    every window's calls through it before the next is loaded. The candidate runs first (each greedy token one more
    pass over its pieces), its logits to disk as each window's are computed; then the reference, whose continuation
    follows the candidate's in one pass (``_reference_window``). The same schedule, arithmetic and metrics as
    ``run_gates``. ``keep(name, compute)``: where the candidate's windows (``"candidate"``) and the reference's
    (``"reference"``) are kept once computed and restored from when the gate runs again (``gate_cache.GatePasses``: at
    27B each takes about an hour); without it they are computed. ``device``, ``device_windows``: ``run_gates``'
    device pass, its candidate streamed too (``"device"``), before the reference, whose one pass then also computes
    the windows where the device's greedy ids part from the fp32 candidate's. ``torch_device``: where the reference
    and the candidates' pieces compute (default the CPU). ``state_room``: the bytes of the windows' states the
    candidates may hold in memory between greedy passes (``streamed_candidate``)."""
    start = time.perf_counter()
    outline = loader.outline
    taps = list(outline.core.taps) if taps is None else list(taps)
    probe_accepts = default_probe(outline) if probe_accepts is None else tuple(probe_accepts)
    _check_inputs(outline, data, taps, greedy_tokens, probe_accepts)
    windows = data.tokens.tolist()

    def spill(_index: int, cand: _Window) -> None:  # a window's logits and taps wait on disk for the reference's
        cand.logits = memory_mapped(cand.logits)
        cand.taps = {t: memory_mapped(value) for t, value in cand.taps.items()}

    keep = keep or (lambda _name, compute: compute())
    candidates = keep("candidate", lambda: streamed_candidate(
        loader, windows, taps, greedy_tokens, probe_accepts, torch.Generator().manual_seed(data.identity.seed),
        consume=spill, torch_device=torch_device, state_room=state_room))
    seed = data.identity.seed
    count = min(device_windows, len(windows)) if device else 0
    devices = keep("device", lambda: _streamed_device_run(loader, windows[:count], taps, greedy_tokens, probe_accepts,
                                                          seed, device, spill, torch_device, state_room)) \
        if count else None
    parted = [w for w in range(count) if devices.windows[w].greedy != candidates[w].greedy]
    references = keep("reference", lambda: streamed_reference(
        source, windows + [windows[w] for w in parted], taps,
        [cand.greedy for cand in candidates] + [devices.windows[w].greedy for w in parted],
        torch_device or "cpu"))
    device_result = None
    if count:
        device_stats = _Stats(taps)
        for w, cand in enumerate(devices.windows):
            ref = references[len(windows) + parted.index(w)] if w in parted else references[w]
            device_stats.add(w, ref, cand, thresholds.near_tie_margin)
            device_stats.add_greedy(ref.greedy, cand.greedy)
        device_result = _device_result(device_stats, thresholds, device, count, devices.range, devices.seconds)
        devices = None
    stats = _Stats(taps)
    for index, (ref, cand) in enumerate(zip(references[:len(windows)], candidates, strict=True)):
        stats.add(index, ref, cand, thresholds.near_tie_margin)
        stats.add_greedy(ref.greedy, cand.greedy)
        references[index] = candidates[index] = None  # each window's logits freed once read
    report = _report(stats, thresholds, data, "export modules, weights as shipped (float16), computed in float32"
                     f"{_on(torch_device)}, one layer at a time", greedy_tokens, start)
    report.device = device_result
    return report


def _streamed_device_run(loader, windows: list[list[int]], taps: list[int], greedy_tokens: int,
                         probe_accepts: tuple[int, ...], seed: int, device: str, consume,
                         torch_device: torch.device | None = None, state_room: int = 0) -> _DeviceRun:
    """``device_pass``'s candidate one piece at a time: the fp16 pieces in ``device``'s arithmetic, every product's
    input and port and every module's output watched, the same schedule and seeded drafts as the fp32 candidate's."""
    start = time.perf_counter()
    peaks = Peaks(only=torch.float16)
    windows = streamed_candidate(loader, windows, taps, greedy_tokens, probe_accepts,
                                 torch.Generator().manual_seed(seed), torch.float16, consume, peaks, device,
                                 what=f"numeric gate: the device pass ({device})", torch_device=torch_device,
                                 state_room=state_room)
    return _DeviceRun(windows, RangeReport.of(device, peaks), time.perf_counter() - start)


def _report(stats: _Stats, thresholds: GateThresholds, data: EvalData, candidate: str, greedy_tokens: int,
            start: float) -> GateReport:
    return GateReport(thresholds=thresholds, data=data.identity, candidate=candidate, greedy_tokens=greedy_tokens,
                      metrics=stats.metrics(thresholds), flips=stats.flips, not_run=not_run_here(),
                      seconds=time.perf_counter() - start)


def streamed_candidate(loader, windows: list[list[int]], taps: list[int], greedy_tokens: int,
                       probe_accepts: tuple[int, ...], generator: torch.Generator,
                       compute_dtype: torch.dtype = torch.float32, consume=None, peaks: Peaks | None = None,
                       device: str | None = None, what: str = "numeric gate: the candidate",
                       torch_device: torch.device | None = None, state_room: int = 0) -> list[_Window]:
    """``_candidate_window`` of every window, one piece of the target in memory at a time (``loader.units()``: the
    embedding, each decoder layer, the head, each a part with the part functions of ``convert/pipeline/partition.py``;
    views of a target the loader holds, ``convert.weights.shipped.HeldTarget``). Steps 1-3 depend on no output: each
    piece runs every window's calls, from a fresh state, on the rows the previous piece returned, and keeps its state
    per window (in memory up to ``state_room`` bytes, on an accelerator ``DEVICE_STATE_SHARE`` of its free memory, the
    rest on disk: a 27B's states are about 1 GB a window in fp32); each greedy token is one more pass, restoring and
    keeping those states. ``consume(index, window)``: called with each window once its logits, taps, probe and first
    greedy id are computed; the windows returned keep them as ``consume`` left them. ``device``
    (``convert.fp16.device_arithmetic``): each piece computes in that device's arithmetic; ``peaks``: noted as each
    piece computes, under the whole target's names (``target.layers.i``); with either, the windows run one after the
    other in this thread (the arithmetic and the watch are this thread's), not in step. ``torch_device``: where each
    piece computes (default the CPU), its states kept from there."""
    return _StreamedCandidate(loader, windows, taps, greedy_tokens, probe_accepts, generator, compute_dtype, consume,
                              peaks, device, torch_device, state_room).run(what)


class _StreamedCandidate:
    """``streamed_candidate``'s run: every window's schedule, host driver and inputs, the rows each piece passes to the
    next, and the windows' results as the head computes them; each piece's states per window wait in ``scratch``
    between the greedy passes, or in ``kept`` while ``room`` lasts."""

    def __init__(self, loader, windows: list[list[int]], taps: list[int], greedy_tokens: int,
                 probe_accepts: tuple[int, ...], generator: torch.Generator, compute_dtype: torch.dtype, consume,
                 peaks: Peaks | None, device: str | None, torch_device: torch.device | None = None,
                 state_room: int = 0):
        outline = loader.outline
        self.torch_device = torch_device
        widths, args = outline.widths, outline.core.args
        self.loader, self.windows, self.taps, self.greedy_tokens = loader, windows, taps, greedy_tokens
        self.compute_dtype, self.consume, self.peaks, self.device = compute_dtype, consume, peaks, device
        self.returned, self.hidden = list(outline.core.taps), args.hidden_size
        self.schedules = [_schedule(w, widths, args.vocab_size, probe_accepts, generator) for w in windows]
        self.drivers = [TargetDriver(None, widths, outline.contract) for _ in windows]
        self.inputs = [[d.inputs(c.function, c.tokens, c.p0) for c in calls]
                       for d, calls in zip(self.drivers, self.schedules, strict=True)]
        self.units = loader.units()
        self.results: list[_Window | None] = [None] * len(windows)
        self.watched = peaks is not None or device is not None
        self.scratch: Path | None = None
        self.kept: dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]] = {}
        accelerated = torch_device is not None and torch_device.type != "cpu"
        self.room = int(DEVICE_STATE_SHARE * free_bytes(torch_device)) if accelerated else state_room

    def run(self, what: str) -> list[_Window]:
        """The first pass (steps 1-3 and the first greedy id) over every piece, then one pass a greedy token."""
        windows, units, passes = self.windows, self.units, self.greedy_tokens
        with tempfile.TemporaryDirectory(prefix="spec-convert-gate-") as scratch:
            self.scratch = Path(scratch)
            in_step = "one window after the other" if self.watched else "the windows in step"
            with steps(f"{what}, one piece at a time, {in_step} ({len(units)} pieces x {passes} passes)",
                       len(units) * passes, "loads") as advance:
                rows = [[None] * len(calls) for calls in self.schedules]
                tapped = [[{} for _ in calls] for calls in self.schedules]
                for u, unit in enumerate(units):
                    self.each(unit, functools.partial(self.first, u, unit, unit.own_taps(self.returned), rows, tapped))
                    advance()
                for step in range(1, passes):
                    given = [self.drivers[w].inputs("decode", [self.results[w].greedy[-1]], len(windows[w]) + step - 1)
                             for w in range(len(windows))]
                    rows = [None] * len(windows)
                    for u, unit in enumerate(units):
                        self.each(unit, functools.partial(self.later, u, unit, step, given, rows))
                        advance()
        return self.results

    def each(self, unit: Part, work) -> None:
        """``work(host, window)`` of every window over a host per window session of the unit's piece (the ane
        layout's buffers carry between calls), its fp16 weights computing in ``compute_dtype`` a block at a
        time, so that the sessions run in step read each block once (``export.lockstep``); one host, in this
        thread, when ``watched`` or on an accelerator. There each call is a few hundred small kernels, which the
        interpreter dispatches for every session in turn, so sessions in step gain nothing (at 27B a piece took about
        10 s, the candidate 3 h, on an H100: docs/bench-logs/gpu-stages-gate-h100-2026-12-07-candidate.log; py-spy
        found the Hadamard butterflies, the step's barrier and the host's row lookups on top,
        docs/bench-logs/gpu-stages-candidate-pyspy-h100-2026-12-07.txt): the windows run one after the other and,
        unwatched, with fewer, larger kernels: each quantized linear of the piece from its weight dequantized once
        (``export.quantized.dense_products``), each Walsh-Hadamard rotation as one product
        (``export.hadamard.as_products``)."""
        windows = self.windows
        piece = compute_copy(self.loader.load([unit])[0], self.compute_dtype, share_weights=True,
                             device=self.torch_device)
        if not self.watched and _in_step(self.torch_device):
            hosts = [ModuleFunctions(piece)] + [ModuleFunctions(piece.session()) for _ in windows[1:]]
            over_sessions(len(windows), hosts, work)
            return
        if not self.watched:  # on an accelerator fewer, larger kernels: the weights dequantized once, H a product
            dense_products(piece.core)
            as_products(piece.core)
        if self.peaks is not None:
            self.peaks.name({"layers.0": f"layers.{unit.layer_indices[0]}"} if unit.layer_indices else None,
                            own=False, target=piece.core)
        host = ModuleFunctions(piece)
        with device_arithmetic(self.device, self.peaks):
            for w in range(len(windows)):
                work(host, w)

    def first(self, u: int, unit: Part, own: list[int], rows: list[list], tapped: list[list[dict]],
              piece: ModuleFunctions, w: int) -> None:
        """Window ``w``'s calls of steps 1-3 through piece ``u``, on the rows the previous piece returned; the head's
        piece makes the window's result (``consume`` called with it)."""
        calls = self.schedules[w]
        piece.reset()
        outs = []
        for c, call in enumerate(calls):
            got = self.call(piece, call.function, self.inputs[w][c], rows[w][c])
            rows[w][c] = got.get(HIDDEN_OUT, rows[w][c])
            if own:
                tapped[w][c].update(zip(own, np.split(got[TAPS], len(own), axis=-1), strict=True))
            if unit.head is not None:
                outs.append(_rows_of(call, got, tapped[w][c], self.returned))
        if self.greedy_tokens > 1:
            self.keep(piece, w, u)
        if unit.head is not None:
            result = self.results[w] = _window_of(calls, outs, len(self.windows[w]), self.taps, self.returned,
                                                  self.hidden)
            result.greedy = [int(result.logits[-1].argmax())]
            if self.consume is not None:
                self.consume(w, result)

    def later(self, u: int, unit: Part, step: int, given: list[dict], rows: list, piece: ModuleFunctions,
              w: int) -> None:
        """Greedy pass ``step`` of window ``w`` through piece ``u``: a decode of its last greedy id from the states
        the previous pass kept."""
        self.restore(piece, w, u)
        got = self.call(piece, "decode", given[w], rows[w])
        if step + 1 < self.greedy_tokens:
            self.keep(piece, w, u)
        rows[w] = got.get(HIDDEN_OUT, rows[w])
        if unit.head is not None:
            self.results[w].greedy.append(int(got[ARGMAX_IDS][0, 0]))

    @staticmethod
    def call(piece: ModuleFunctions, function: str, given: dict, rows) -> dict[str, np.ndarray]:
        return piece.call(function, link_inputs(piece.modules.functions[function][1], given, rows))

    def keep(self, piece: ModuleFunctions, w: int, u: int) -> None:
        """Window ``w``'s states of piece ``u``, for the next pass: in memory (where they are: a GPU's states stay
        there) when they were before or fit what is left of ``room``, else on disk."""
        states, buffers = piece.modules.states(), piece.host_buffers()
        held = self.kept.get((w, u))
        if held is not None:
            for mine, theirs in ((held[0], states), (held[1], buffers)):
                for name, value in theirs.items():
                    mine[name][...] = value
            return
        size = sum(t.nbytes for t in states.values()) + sum(b.nbytes for b in buffers.values())
        if size <= self.room:
            self.room -= size
            self.kept[w, u] = ({k: v.clone() for k, v in states.items()}, {k: _copy(v) for k, v in buffers.items()})
            return
        torch.save({**states, **{k: torch.as_tensor(_copy(v)) for k, v in buffers.items()}},
                   self.scratch / f"{w}-{u}.pt")

    def restore(self, piece: ModuleFunctions, w: int, u: int) -> None:
        buffers, states = piece.host_buffers(), piece.modules.states()
        held = self.kept.get((w, u))
        if held is not None:
            for name, value in (*held[0].items(), *held[1].items()):
                (buffers if name in buffers else states)[name][...] = value
            return
        for name, value in torch.load(self.scratch / f"{w}-{u}.pt").items():
            held = (buffers if name in buffers else states)[name]
            held[...] = value.numpy() if isinstance(held, np.ndarray) else value


def _copy(buffer):
    """A copy of a host buffer: a numpy array's, or a tensor's where the host holds it on an accelerator."""
    return buffer.clone() if isinstance(buffer, torch.Tensor) else buffer.copy()


DEVICE_STATE_SHARE = 0.5
"""The share of an accelerator's memory free when a streamed candidate starts that its windows' states may take
between greedy passes (they stay where they are computed; the rest: a piece's compute copy, at 27B the head's 5 GB
of fp32 weights, and its activations). On the CPU the plan's ``gate_state_room`` sets it."""


def _in_step(torch_device: torch.device | None) -> bool:
    """Whether a streamed candidate's windows run in step (``_StreamedCandidate.each``): on the CPU."""
    return torch_device is None or torch_device.type == "cpu"


def _rows_of(call: _Call, got: dict[str, np.ndarray], tapped: dict[int, np.ndarray], returned: list[int]) -> dict:
    """A call's outputs as ``TargetDriver.run`` gives the whole target's: its real rows, the taps in order."""
    out = dict(got)
    if tapped:
        out[TAPS] = np.concatenate([tapped[t] for t in returned], axis=-1)
    return {k: np.asarray(v)[0, : len(call.tokens)] for k, v in out.items()}


def default_probe(modules: TargetModules) -> tuple[int, ...]:
    """The probe's accepted rows per block: (0,) for a positional rollback (keeping rows is only a position there);
    partial accepts for a commit-next-call one, where the kept rows go through the commit."""
    if modules.contract["rollback"] != COMMIT:
        return (0,)
    k = modules.widths["verify"]
    return tuple(dict.fromkeys((0, k // 2, k - 1, min(1, k - 1))))


def artifact_gate(package_path: Path, modules: TargetModules, prompt: list[int] | None = None) -> ArtifactResult:
    """Run the shipped ``.aimodel`` on the Core AI runtime in lockstep with ``modules`` (as shipped, fp16).

    A greedy sequence of prefill, decode steps and a verify block after a rollback
    (``checks.run_coreai``); every argmax must equal the modules' except near ties of the fp16 runtime,
    and returned logits or taps must agree within the fp16 bound. On Linux the runtime is the CPU
    reference interpreter (fp16 emulated: ~30 s for one prefill of 64 on the fixture), so keep it short.
    """
    if package_path.suffix != ".aimodel":
        raise InputError(f"{package_path}: the artifact gate runs a Core AI .aimodel")
    with coreai_functions(package_path, modules.contract, module_lookup(modules.core)) as session:
        return lockstep_result(session, ModuleFunctions(modules), modules, package_path.name, WHOLE_RUN, prompt)


def lockstep_result(runtime, reference, modules: TargetModules, package: str, scope: str,
                    prompt: list[int] | None = None) -> ArtifactResult:
    """``checks.lockstep`` of ``runtime`` against ``reference`` as the artifact gate's result (a failure recorded),
    the torch side computing as this CPU's runtime does (``checks.like_the_runtime``, as every package check's)."""
    start = time.perf_counter()
    try:
        with checks.like_the_runtime():
            stats = checks.lockstep(runtime, reference, modules.widths, modules.contract,
                                    modules.core.args.vocab_size, prompt)
    except PackageError as error:
        return ArtifactResult(package=package, passed=False, scope=scope, error=str(error),
                              seconds=time.perf_counter() - start)
    keys = ("runtime_calls", "argmax_compared", "argmax_near_ties", "max_output_delta")
    return ArtifactResult(package=package, passed=True, scope=scope, seconds=time.perf_counter() - start,
                          greedy_ids=[int(i) for i in stats["greedy_ids"].split()], **{k: stats[k] for k in keys})


def artifact_of_parts(checked: list, parts: list, pieces: list, taps, modules: TargetModules,
                      chained: bool) -> ArtifactResult:
    """A parted target's artifact gate, after each part's package check replayed the calls the chained torch parts
    made (``checked``: their Core AI ``Packaged``). ``chained``: then also every part's .aimodel chained on the runtime
    in lockstep with the chained torch parts (``checks.lockstep``); otherwise the replays are the gate, and they do
    not show that the runtime's own rows carried from part to part stay within the bound over a longer run."""
    names = ", ".join(done.path.name for done in checked)
    seconds = sum(done.check_seconds for done in checked)
    if not chained:
        heads = [done.check for done, part in zip(checked, parts, strict=True) if part.head is not None]
        return ArtifactResult(package=names, passed=True, scope=PARTS_REPLAYED, seconds=seconds,
                              runtime_calls=sum(d.check["runtime_calls"] for d in checked),
                              argmax_compared=sum(h["ids_compared"] for h in heads),
                              argmax_near_ties=sum(h["id_near_ties"] for h in heads),
                              max_output_delta=max(d.check["max_output_delta"] for d in checked))
    with coreai_chain(parts, [done.path for done in checked], taps, modules.contract,
                      module_lookup(pieces[0].core)) as runtime:
        result = lockstep_result(runtime, module_chain(parts, pieces, taps), modules, names, PARTS_CHAINED)
    result.seconds += seconds
    return result


def artifact_from_check(package: str, check: dict, seconds: float) -> ArtifactResult:
    """The build's Core AI package check (``checks.check_package``) is this gate's run: record it as such."""
    keys = ("runtime_calls", "argmax_compared", "argmax_near_ties", "max_output_delta")
    return ArtifactResult(package=package, passed=True, seconds=seconds,
                          greedy_ids=[int(i) for i in str(check.get("greedy_ids", "")).split()],
                          **{k: check[k] for k in keys})


def artifact_against_reference(result: ArtifactResult, reference, prompt: list[int], generated: list[int],
                               margin: float) -> ArtifactResult:
    """The package's greedy ids (``generated`` after ``prompt``, from its check's run) against the fp32 ``reference``
    fed the same ids: each must be the reference's argmax, or a near tie (its logit within ``margin`` of the top), so a
    package and torch modules that are wrong the same way fail. Fills ``result``'s reference counts; a mismatch fails
    it naming the step."""
    with torch.no_grad():
        ids = torch.tensor([prompt + generated[:-1]])
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1:].float()
    result.reference_compared, result.reference_near_ties = len(generated), 0
    for step, (row, got) in enumerate(zip(logits, generated, strict=True)):
        best = int(row.argmax())
        if best == got:
            continue
        gap = float(row[best] - row[got])
        if gap <= margin:
            result.reference_near_ties += 1
            continue
        result.passed = False
        result.error = (f"greedy step {step}: the package gives id {got}, the fp32 reference {best} (its logit "
                        f"{gap:.4g} higher, past the near-tie margin {margin:g})")
        break
    return result


def gate_target(plan, modules: TargetModules,
                settings: tuple[GateThresholds, EvalData] | None = None) -> GateReport:
    """The recipe's gate (``target.gate``) on a build plan's shipped modules: the reference is the transformers
    model in fp32 from the same pinned snapshot, the data the recipe's evaluation text through its tokenizer
    (``settings``: ``recipe_gate(plan)`` when the caller has it already)."""
    thresholds, data = settings or recipe_gate(plan)
    reference = load_reference(plan.snapshot.directory)
    gate = plan.recipe.target.gate
    return run_gates(reference, modules, data, thresholds, greedy_tokens=gate.greedy_tokens,
                     device=DEVICE_OF_LAYOUT[plan.recipe.target.layout], device_windows=gate.device_samples,
                     torch_device=plan.torch_device)


def gate_streamed(plan, loader, keep=None,
                  settings: tuple[GateThresholds, EvalData] | None = None) -> GateReport:
    """``gate_target`` one layer at a time (``run_streamed_gates``, with its ``keep``; ``loader``: a
    ``convert.weights.shipped.PartLoader`` or ``HeldTarget``), the windows' states in memory up to the plan's
    ``gate_state_room``."""
    thresholds, data = settings or recipe_gate(plan)
    gate = plan.recipe.target.gate
    return run_streamed_gates(plan.snapshot.directory, loader, data, thresholds, greedy_tokens=gate.greedy_tokens,
                              keep=keep, device=DEVICE_OF_LAYOUT[plan.recipe.target.layout],
                              device_windows=gate.device_samples, torch_device=plan.torch_device,
                              state_room=plan.gate_state_room)


def recipe_gate(plan) -> tuple[GateThresholds, EvalData]:
    """The recipe's thresholds (defaults of its method, overridden by ``target.gate.thresholds``) and data."""
    from transformers import PreTrainedTokenizerFast

    target, source = plan.recipe.target, plan.snapshot.directory
    settings = target.gate
    defaults = default_thresholds(target.quantization.method).model_dump()
    thresholds = GateThresholds(**{**defaults, **settings.thresholds})
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    spec = settings.data
    text = calibration_text(spec.corpus, plan.recipe_path.resolve().parent, field="target.gate.data.corpus")
    try:
        data = EvalData.from_text(text, tokenizer, spec.samples, spec.length, spec.seed, corpus=spec.corpus)
    except ValueError as exc:
        raise InputError(f"{plan.recipe_path}: target.gate.data: {exc}") from None
    return thresholds, data


def load_reference(source: Path):
    """The transformers model of a checkpoint, in fp32: the class its config.json names (``architectures``), so a
    vision-language checkpoint is its own ``*ForConditionalGeneration``; never remote code."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(source))
    named = [getattr(transformers, a, None) for a in (config.architectures or [])]
    cls = next((c for c in named if c is not None and hasattr(c, "from_pretrained")), AutoModelForCausalLM)
    return cls.from_pretrained(str(source), dtype=torch.float32).eval()


def not_run_here() -> list[NotRun]:
    """Candidates that cannot run on this platform, with the reason."""
    if platform.system() == "Darwin":
        return [NotRun(what="Core ML runtime (.mlpackage)",
                       reason="the .mlpackage candidate is not wired into the gate yet; its weights are checked "
                              "bit for bit by the package check")]
    return [
        NotRun(what="Core ML runtime (.mlpackage)", reason="coremltools predicts only on macOS; its weights are "
               "checked bit for bit by the package check"),
        NotRun(what="Core AI device-specialized package", reason="needs macOS with coreai-build; the artifact gate "
               "runs the .aimodel on the runtime's Linux CPU reference"),
    ]


def _check_reference(reference, modules: TargetModules) -> None:
    dtype = next(reference.parameters()).dtype
    if dtype != torch.float32:
        raise InputError(f"the gate's reference must be the transformers model in float32, got {dtype}")
    vocab = reference.config.get_text_config().vocab_size
    if vocab != modules.core.args.vocab_size:
        raise InputError(f"reference vocab {vocab} != modules vocab {modules.core.args.vocab_size}: not the same model")


def _check_inputs(modules: TargetModules, data: EvalData, taps, greedy_tokens: int, probe_accepts: tuple[int, ...]):
    """Refuse, naming the quantity, what the schedule cannot run."""
    missing = [t for t in taps if t not in modules.core.taps]
    if missing:
        raise InputError(f"tap layer {missing[0]} is not returned by the modules (taps {list(modules.core.taps)})")
    widths, length, split = modules.widths, data.identity.length, data.identity.length // 2
    if split + len(probe_accepts) * widths["verify"] > length:
        raise InputError(f"evaluation length {length} is too short for {len(probe_accepts)} probe block(s) of "
                         f"{widths['verify']} after a prefill of {split}")
    if not all(0 <= a < widths["verify"] for a in probe_accepts):
        raise InputError(f"probe accepts {list(probe_accepts)} must lie in 0..{widths['verify'] - 1}")
    if greedy_tokens < 1:
        raise InputError(f"greedy_tokens must be at least 1, got {greedy_tokens}")
    rows = {  # cache rows written, padding included
        "prefill chunks": -(-split // widths["prefill"]) * widths["prefill"],
        "verify blocks": length - 1 + widths["verify"],
        "greedy continuation": length + greedy_tokens - 1,
    }
    what, needed = max(rows.items(), key=lambda item: item[1])
    if needed > modules.core.context:
        raise InputError(f"evaluation length {length}: the {what} need {needed} cache rows; the target's context is "
                         f"{modules.core.context}")


@dataclass
class _Window:
    logits: torch.Tensor  # [length, V]
    taps: dict[int, torch.Tensor]  # layer -> [length, hidden]
    greedy: list[int]
    probe: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None  # (first position, block, chain logits)


@torch.no_grad()
def _reference_window(reference, window: list[int], taps: list[int], continuation: list[int], modules) -> _Window:
    """The reference's logits and taps over ``window``, and its greedy ids teacher-forced on ``continuation`` (the
    candidate's greedy ids): its argmax after the window, then after each of those ids but the last, in one forward
    on its cache. Up to the first id where the two differ that is the reference's own greedy continuation, and
    ``greedy_match`` reads no further: the same metric as continuing on its own, in one call instead of G."""
    captured = {}
    layers = family_of(modules.core.args).reference_layers(reference)
    hooks = [layers[t].register_forward_hook(
        lambda _m, _i, out, t=t: captured.__setitem__(t, out[0] if isinstance(out, tuple) else out))
        for t in taps]
    where = next(reference.parameters()).device
    try:
        out = reference(input_ids=torch.tensor([window], device=where), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    cache = _cache_keyword(reference)
    logits = out.logits[0].float().cpu()
    greedy = [int(logits[-1].argmax())]
    if len(continuation) > 1:
        out = reference(input_ids=torch.tensor([continuation[:-1]], device=where), use_cache=True,
                        **{cache: out[cache]})
        greedy += out.logits[0].argmax(-1).tolist()
    return _Window(logits, {t: captured[t].reshape(len(window), -1).float().cpu() for t in taps}, greedy)


def _on(torch_device: torch.device | None) -> str:
    """What a report's candidate line adds for a torch device other than the CPU's: `` on cuda``."""
    return "" if torch_device is None or torch_device.type == "cpu" else f" on {torch_device.type}"


def _cache_keyword(reference) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(reference.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class _Call:
    """One call of a window's schedule (module docstring, steps 1-3): ``keep`` rows from ``p0`` go into the window's
    logits and taps; ``probe``: (block index, rows kept) of a probe's verify (``block``) or one of its decodes."""

    function: str
    tokens: list[int]
    p0: int
    keep: int = 0
    probe: tuple[int, int] | None = None
    block: bool = False


def _schedule(window: list[int], widths: dict[str, int], vocab: int, probe_accepts: tuple[int, ...],
              generator: torch.Generator) -> list[_Call]:
    """The calls of steps 1-3 for one window: they depend on the window and the seeded drafts, not on any output, so
    a streamed gate runs them one layer at a time."""
    length, split, k = len(window), len(window) // 2, widths["verify"]
    calls = [_Call("prefill", window[p0 : p0 + min(widths["prefill"], split - p0)], p0,
                   min(widths["prefill"], split - p0)) for p0 in range(0, split, widths["prefill"])]
    p = split
    for index, kept in enumerate(probe_accepts):
        calls.append(_Call("verify", window[p : p + k], p, k, (index, kept), block=True))
        calls += [_Call("decode", [window[q]], q, probe=(index, kept)) for q in range(p + kept, p + k)]
        p += k
    while p < length:
        rejected = int(torch.randint(0, k // 2 + 1, (), generator=generator))
        accepted = min(k - rejected, length - p)
        wrong = [(t + 1) % vocab for t in window[p + accepted : p + k]]
        calls.append(_Call("verify", window[p : p + accepted] + wrong, p, accepted))
        p += accepted
    return calls


def _window_of(calls: list[_Call], outs: list[dict[str, np.ndarray]], length: int, taps: list[int],
               returned: list[int], hidden: int) -> _Window:
    """The window's candidate logits and taps (and probe logits) from its calls' outputs (``TargetDriver.run``'s:
    real rows only); the greedy ids are added after."""
    vocab = outs[0][LOGITS].shape[-1]
    logits = torch.empty(length, vocab)
    features = {t: torch.empty(length, hidden) for t in taps}
    blocks, chains = {}, {}
    for call, out in zip(calls, outs, strict=True):
        if call.keep:
            logits[call.p0 : call.p0 + call.keep] = torch.from_numpy(out[LOGITS][: call.keep])
            for t in taps:
                i = returned.index(t)
                features[t][call.p0 : call.p0 + call.keep] = torch.from_numpy(
                    out[TAPS][: call.keep, i * hidden : (i + 1) * hidden])
        if call.probe is not None:
            index, kept = call.probe
            if call.block:
                blocks[index] = (call.p0 + kept, torch.from_numpy(out[LOGITS][kept:]).clone())
            else:
                chains.setdefault(index, []).append(torch.from_numpy(out[LOGITS][0]))
    probe = [(blocks[i][0], blocks[i][1], torch.stack(chains[i])) for i in sorted(blocks)]
    return _Window(logits, features, [], probe)


def _candidate_window(modules: TargetModules, window: list[int], taps: list[int], greedy_tokens: int,
                      probe_accepts: tuple[int, ...], generator: torch.Generator) -> _Window:
    """One window through the functions as a runtime calls them (module docstring, steps 1-4)."""
    calls = _schedule(window, modules.widths, modules.core.args.vocab_size, probe_accepts, generator)
    driver = module_driver(modules)
    driver.reset()
    outs = [driver.run(c.function, c.tokens, c.p0) for c in calls]
    result = _window_of(calls, outs, len(window), taps, list(modules.core.taps), modules.core.args.hidden_size)
    result.greedy = [int(result.logits[-1].argmax())]
    for q in range(len(window), len(window) + greedy_tokens - 1):
        result.greedy.append(int(driver.run("decode", [result.greedy[-1]], q)[ARGMAX_IDS][0]))
    return result


class _Stats:
    """Per-position values accumulated over windows, reduced to metrics at the end."""

    def __init__(self, taps: list[int]):
        self.kl, self.top1, self.cosine, self.greedy = [], [], [], []
        self.top1_clear = []  # agreement, or the reference's logit for the candidate's id within the near-tie margin
        self.tap_cosine = {t: [] for t in taps}
        self.flips: list[Flip] = []
        self.probed = 0

    def add(self, index: int, ref: _Window, cand: _Window, margin: float) -> None:
        """A window's logits, taps and probe (its greedy ids: ``add_greedy``)."""
        ref_logp = torch.log_softmax(ref.logits.double(), -1)
        cand_logp = torch.log_softmax(cand.logits.double(), -1)
        self.kl.append((ref_logp.exp() * (ref_logp - cand_logp)).sum(-1).clamp(min=0))
        best, chosen = ref.logits.argmax(-1), cand.logits.argmax(-1)
        self.top1.append(best == chosen)
        gap = ref.logits.gather(-1, best[:, None])[:, 0] - ref.logits.gather(-1, chosen[:, None])[:, 0]
        self.top1_clear.append((best == chosen) | (gap < margin))
        self.cosine.append(torch.cosine_similarity(ref.logits.double(), cand.logits.double(), dim=-1))
        for t, values in self.tap_cosine.items():
            values.append(torch.cosine_similarity(ref.taps[t].double(), cand.taps[t].double(), dim=-1))
        for p0, block, chain in cand.probe:
            self.probed += block.shape[0]
            for f in classify_flips(block, chain, margin):
                self.flips.append(Flip(sample=index, position=p0 + f.row, block_id=f.block_id, chain_id=f.chain_id,
                                       gap=f.gap, near_tie=f.near_tie))

    def add_greedy(self, ref: list[int], cand: list[int]) -> None:
        matched = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=True)) if a != b), len(ref))
        self.greedy.append(matched / len(ref))

    def metrics(self, th: GateThresholds) -> list[Metric]:
        kl = torch.cat(self.kl)
        real = sum(not f.near_tie for f in self.flips)
        metrics = [
            Metric.gated("kl_mean", float(kl.mean()), th.mean_kl_max, "max"),
            Metric.gated("kl_p99", float(torch.quantile(kl, 0.99)), th.p99_kl_max, "max"),
            Metric.gated("kl_max", float(kl.max()), th.max_kl_max, "max"),
            Metric.gated("top1", float(torch.cat(self.top1).double().mean()), th.top1_min, "min"),
            Metric.gated("logits_cosine", float(torch.cat(self.cosine).mean()), th.cosine_min, "min"),
            Metric.gated("greedy_match", sum(self.greedy) / len(self.greedy), th.greedy_match_min, "min"),
        ]
        for t, values in self.tap_cosine.items():
            metrics.append(Metric.gated(f"tap_cosine[{t}]", float(torch.cat(values).mean()), th.tap_cosine_min, "min"))
        metrics.append(Metric.gated("block_chain_real_flips", real, th.block_chain_real_flips_max, "max"))
        metrics.append(Metric(name="block_chain_near_ties", value=len(self.flips) - real, threshold=None, bound=None,
                              passed=True))
        metrics.append(Metric(name="block_chain_positions", value=self.probed, threshold=None, bound=None, passed=True))
        return metrics
