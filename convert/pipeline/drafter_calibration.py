"""The drafter's quantization: GPTQ's Hessians over speculative decoding as deployed (taken live, or replayed from
recorded drafter calls a group of linears at a time), the quantizers over its own linears, their codes kept in and
restored from the build cache, and the recorded calls its package check replays.

The Hessians are summed where the compute copies run and the quantizers run on the build's torch device
(``build --device``: ``Plan.torch_device``), each linear's codes and tables brought back to the CPU modules that are
packaged; the package check's recorded calls are the CPU runtime's arithmetic and are made on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from convert import cache as build_cache
from convert.errors import InputError
from convert.export.functions import torch_device_of
from convert.export.quantized import apply_quantized
from convert.inputs.recipe import DrafterQuantization
from convert.pipeline.drafter import BORROWED, PromptJournal, drivers, over_prompts
from convert.pipeline.drafter_memory import hessian_groups, own_linears
from convert.runtime import speculative
from convert.runtime.host import ModuleFunctions
from convert.verify.checks import like_the_runtime
from convert.weights.quantize import read_entry, round_to_nearest, summary, to_cpu, write_entry
from quant.gptq import HessianAccumulator, gptq_quantize
from quant.types import QuantizedWeight


def calibration_hessians(kind: str, target_modules, drafter_modules, prompts: list[list[int]], tokens: int,
                         embeddings: np.ndarray, sessions: int = 1,
                         journal: PromptJournal | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Input Hessians of the drafter's own linears over speculative decoding of ``prompts``, a group of linears at a
    time (``hessian_groups``): the drafter sees exactly what it sees deployed (context rows from the target's taps or
    hidden states, draft blocks, accepted rows). A chunk's padding rows repeat its last row and count again.

    The speculative run (the target's calls) happens once, in this call, over ``sessions`` prompts at a time
    (``over_prompts``). With one group, run one prompt at a time, it takes the Hessians as the calls happen;
    otherwise the drafter's calls are recorded, prompt by prompt, and every group's Hessians are taken by replaying
    them in prompt order, from reset states, through the drafter alone: the same calls on the same inputs in the same
    order, so the same Hessians bit for bit, however many sessions ran them. (No group's Hessians are held beside the
    target while it runs: at 27B a group is up to 2 GiB, and the target's 7.5 GB and the sessions' states are held
    then.) Yields {linear name: Hessian} per group, each summed on the torch device the drafter's compute copy is on;
    a linear that saw no input is left out. ``journal``: the recordings are kept there prompt by prompt
    (``over_prompts``; not where the Hessians are taken live)."""
    groups = hessian_groups(drafter_modules.core)
    # hooks see the calls as they happen only when one session makes them
    live = min(sessions, len(prompts)) <= 1 and len(groups) == 1

    def run(target, drafter, index: int) -> list | None:
        recording = None if live else Recording(ModuleFunctions(drafter), outputs=False)
        drives = drivers(kind, target, drafter, embeddings,
                         None if recording is None else (ModuleFunctions(target), recording))
        speculative.speculate(*drives, prompts[index], tokens)
        return None if recording is None else recording.calls

    if not live:
        recordings = over_prompts(run, len(prompts), sessions, target_modules, drafter_modules, journal)
        return _replayed(groups, drafter_modules, recordings)
    with _accumulating(drafter_modules.core, groups[0]) as accumulators:
        over_prompts(run, len(prompts), 1, target_modules, drafter_modules)
    return iter([_hessians(accumulators)])  # nothing to replay: the drafter's modules are not held on


def _replayed(groups: list[list[str]], drafter_modules, recordings: list[list]) -> Iterator[dict]:
    """Each group's Hessians by replaying ``recordings`` through ``drafter_modules``. Before the last group's are
    handed on, the compute copy and the recordings are let go: the last group's GPTQ (the widest linear's:
    ``grouped_by_hessian``) runs without the fp16 weights of the linears quantized before it."""
    for index, group in enumerate(groups):
        with _accumulating(drafter_modules.core, group) as accumulators:
            _replay(drafter_modules, recordings)
        hessians = _hessians(accumulators)
        if index == len(groups) - 1:
            del drafter_modules, recordings
        yield hessians


def _replay(drafter_modules, recordings: list[list]) -> None:
    """The recorded drafter calls (each prompt's ``Recording.calls``), in order, through ``drafter_modules`` as the
    driver called them (a recording's resets included; through the host's buffers where the modules' contract has
    them)."""
    functions = ModuleFunctions(drafter_modules)
    for calls in recordings:
        for function, inputs, _ in calls:
            if function == "reset":
                functions.reset()
            else:
                functions.call(function, inputs)


def _hessians(accumulators: dict[str, HessianAccumulator]) -> dict[str, torch.Tensor]:
    """The Hessians of ``accumulators`` (emptied as it goes: one sum and one Hessian of a linear held at a time)."""
    return {name: accumulators.pop(name).hessian() for name in list(accumulators) if accumulators[name].count}


@contextmanager
def _accumulating(core: torch.nn.Module, names: list[str]) -> Iterator[dict[str, HessianAccumulator]]:
    """Forward hooks feeding each named linear's inputs into its ``HessianAccumulator`` (on the core's torch device)
    while the block runs."""
    modules, device = dict(core.named_modules()), torch_device_of(core)
    accumulators, hooks = {}, []
    for name in names:
        accumulators[name] = HessianAccumulator(modules[name].in_features, device)
        hooks.append(modules[name].register_forward_hook(
            lambda _m, inputs, _out, acc=accumulators[name]: acc.add(inputs[0])))
    try:
        yield accumulators
    finally:
        for hook in hooks:
            hook.remove()


def quantize(modules, quant: DrafterQuantization, hessians: Iterable[dict[str, torch.Tensor]] | None = None,
             keep: Callable[[str, QuantizedWeight], None] | None = None, device: torch.device | None = None) -> dict:
    """4-bit of the drafter's own linears (round to nearest, or GPTQ under ``hessians``: groups of {name: Hessian},
    as ``calibration_hessians`` yields them, each dropped once its linears are quantized); the borrowed tables stay
    as the target ships them. Each linear becomes a ``CodesLinear`` as soon as it is quantized (its codes packed, the
    weight computed at each call: at the 27B drafters' size 0.5 bytes a weight, where the unpacked codes of every
    linear held until the end were 1 and a dense copy beside them 2 more), until
    ``export.quantized.packaged_from_codes`` makes them the layers a package is made from. Returns the manifest's
    quantization record. ``keep(name, weights)``: called with each linear's result as it is quantized
    (``store_quantized``). ``device``: the torch device the quantizers run on (the build's; default where the weights
    are), each linear's weight moved there and its codes and tables brought back to the CPU."""
    method, group = quant.format, quant.resolved_group_size
    linears = dict(own_linears(modules.core))
    own = [p for n, p in modules.core.named_parameters() if not n.startswith(BORROWED)]

    def quantized() -> Iterator[tuple[str, QuantizedWeight]]:
        for taken in ({name: None for name in linears},) if hessians is None else hessians:
            for name in list(taken):
                weight, hessian = linears.pop(name).weight.detach(), taken.pop(name)
                weight = (weight if device is None else weight.to(device)).float()
                result = to_cpu(round_to_nearest(method, weight, group) if hessian is None
                                else gptq_quantize(weight, hessian, method, group, name=name))
                apply_quantized(modules.core, {name: result}, codes_only=True)
                if keep is not None:
                    keep(name, result)
                yield name, result

    bits_per_weight, layers = summary(quantized(), own)  # one linear's unpacked codes held at a time
    if linears:
        raise InputError(f"drafter.quantization.calibration: linear {next(iter(linears))} saw no calibration input")
    return {"method": quant.method, "group_size": group, "bits_per_weight": bits_per_weight, "layers": layers}


def store_quantized(modules, quant: DrafterQuantization, hessians, directory: Path,
                    device: torch.device | None = None) -> dict:
    """``quantize`` (on ``device``), each linear's codes written into ``directory`` (a build cache entry's) as soon as
    it is quantized: a build killed in GPTQ leaves no entry. Returns the entry's metadata, which
    ``restore_quantized`` reads back."""
    linears = {}

    def keep(name: str, weights: QuantizedWeight) -> None:
        (directory / name).mkdir()
        linears[name] = write_entry(directory / name, {name: weights})

    return {"record": quantize(modules, quant, hessians, keep, device), "linears": linears}


def restore_quantized(modules, entry) -> dict:
    """The drafter's linears as ``store_quantized`` left them, from its build cache ``entry``; returns its
    quantization record."""
    for name, meta in entry.meta["linears"].items():
        weights = read_entry(build_cache.Entry(entry.path(name), meta))
        apply_quantized(modules.core, weights, codes_only=True)
        del weights
    return entry.meta["record"]


class Recording:
    """A ``speculative.Functions`` that records every call with its outputs (the package check replays them), or
    without them (``outputs=False``: a calibration's replays need the inputs alone, and a draft call's outputs hold its
    fp32 logits, 7 MB at the 27B vocabulary)."""

    def __init__(self, functions: ModuleFunctions, outputs: bool = True, arithmetic=nullcontext):
        """``arithmetic``: a context each call computes in (``checks.like_the_runtime``: the runtime's)."""
        self.functions, self.calls, self.outputs, self.arithmetic = functions, [], outputs, arithmetic

    def reset(self) -> None:
        self.functions.reset()
        self.calls.append(("reset", {}, {}))

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.arithmetic():
            out = self.functions.call(function, inputs)
        self.calls.append((function, {k: np.array(v) for k, v in inputs.items()}, out if self.outputs else {}))
        return out


def recorded_calls(kind: str, target_modules, drafter_modules, prompt: list[int], tokens: int,
                   embeddings: np.ndarray) -> list:
    """The drafter calls of a short speculative run of the fp16 modules (as packaged: ``drafter_build.packaged_calls``),
    with their outputs, the drafter's computed as this CPU's Core AI runtime computes (``checks.like_the_runtime``):
    what the drafter's package check replays. The target's calls, which only make the drafter's inputs, compute in
    torch's own fp16 kernels: the runtime's true fp16 is one elementwise op an inner index, and a 27B target's
    prefill in it ran past 40 minutes on 2 cores (docs/lab/2026-12-07-host-buffers-and-the-drafter-check.md)."""
    target, drafter = drivers(kind, target_modules, drafter_modules, embeddings)
    drafter.functions = Recording(drafter.functions, arithmetic=like_the_runtime)  # the runtime asked once a process
    speculative.speculate(target, drafter, prompt, tokens)
    return drafter.functions.calls
