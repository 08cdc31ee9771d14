"""Benchmark: the fp32 compute copies of a drafter at the 27B drafters' size (1.92B own parameters), plain and
weight-sharing (``compute_copy(share_weights=True)``: ``HalfLinear``), as the drafter stage makes them (calibration,
acceptance, the A/B).

Builds the DFlash2 drafter of ``bench/release_rehearsal.py``'s config (hidden 5120, 5 layers, 25600 tap features)
with seeded fp16 weights and, as a lean target lends it, the 248320-row head as a ``CodesLinear`` (seeded exact2
codes); while a thread samples this process's resident memory (``VmRSS``) every 20 ms it makes each copy and runs a
context_update (64 rows) and a draft call (block of 8) through it, and checks that both copies return the same ids.

    PYTHONPATH=. python3 -m bench.archive.drafter_copies [--json out.json]
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import Sampler, arguments, machine
from bench.lean_target import ternary
from bench.release_rehearsal import drafter_config
from convert.export.functions import compute_copy, parameters_on_meta
from convert.export.quantized import CodesLinear, HalfLinear
from convert.models.dflash2 import DFlash2Args
from convert.models.dflash2.core import DFlash2Core
from convert.models.dflash2.export import ENTRIES, DrafterFunction, DrafterModules, function_specs

RING, UPDATE, APPEND, CONTEXT = 2048, 64, 8, 4096


def seeded_drafter(args: DFlash2Args, generator: torch.Generator) -> DrafterModules:
    """The drafter's modules in fp16: buffers as constructed, every own parameter seeded (norms at one), the head a
    ``CodesLinear`` as a lean target lends it."""
    with parameters_on_meta():
        core = DFlash2Core(args, RING, CONTEXT, args.block_size)
    core.to(torch.float16)  # the buffers (RoPE tables) as the shipped core's; the parameters are still on meta
    core.lm_head = CodesLinear("lm_head", ternary("lm_head", (args.vocab_size, args.hidden_size), generator))
    for module in core.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            scale = p.shape[-1] ** -0.5
            value = torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=generator) * scale
            module._parameters[name] = torch.nn.Parameter(value.half(), requires_grad=False)
    core.mask_embedding.copy_(torch.randn(args.hidden_size, generator=generator).half())
    specs = function_specs(args, UPDATE, APPEND, RING, torch.float16, args.block_size)
    states = {s.name: torch.zeros(s.shape, dtype=torch.float16) for s in specs[0].states}
    functions = {s.name: (DrafterFunction(core, s, states, ENTRIES[s.name]), s) for s in specs}
    return DrafterModules(core=core, functions=functions)


def run_calls(modules, generator: torch.Generator) -> tuple[np.ndarray, float]:
    """A context_update of 64 rows, then a draft at the next position: the draft ids and the two calls' seconds."""
    args = modules.core.args
    modules.reset()
    began = time.perf_counter()
    taps = torch.randn(1, UPDATE, args.feature_size, generator=generator)
    modules.call("context_update", taps=taps, position_ids=torch.arange(UPDATE, dtype=torch.int32)[None])
    anchor = torch.randn(1, 1, args.hidden_size, generator=generator)
    out = modules.call("draft", anchor_embedding=anchor, anchor_id=torch.tensor([[5]], dtype=torch.int32),
                       position_ids=torch.arange(UPDATE, UPDATE + args.block_size, dtype=torch.int32)[None])
    return out["draft_ids"].numpy(), time.perf_counter() - began


def main() -> None:
    parser = arguments(__doc__)
    a = parser.parse_args()
    args = DFlash2Args.from_config(drafter_config())
    sampler = Sampler()
    with sampler.phase("the drafter's fp16 modules (own weights seeded, the head as codes)"):
        modules = seeded_drafter(args, torch.Generator().manual_seed(0))
    own = sum(p.numel() for p in modules.core.parameters())
    results = {}
    for label, share in (("plain", False), ("sharing", True)):
        with sampler.phase(f"fp32 compute copy, {label}"):
            copy32 = compute_copy(modules, torch.float32, share_weights=share)
        with sampler.phase(f"context_update (64 rows) and draft through the {label} copy"):
            ids, seconds = run_calls(copy32, torch.Generator().manual_seed(1))
        halves = sum(isinstance(m, HalfLinear) for m in copy32.core.modules())
        results[label] = {"ids": ids.tolist(), "call_s": round(seconds, 2), "half_linears": halves}
        del copy32
    sampler.stop()
    phases = {p["phase"]: p for p in sampler.phases}
    for label in results:
        made = phases[f"fp32 compute copy, {label}"]
        results[label]["copy_gib"] = round(made["end_gib"] - made["start_gib"], 2)
    record = {"machine": machine("cpu"), "threads": torch.get_num_threads(), "own_parameters": own,
              "same_ids": results["plain"]["ids"] == results["sharing"]["ids"], "copies": results,
              "phases": sampler.phases}
    sampler.report(f"{own / 1e9:.2f}B own parameters; an fp32 copy holds {results['plain']['copy_gib']} GiB plain, "
                   f"{results['sharing']['copy_gib']} GiB sharing ({results['sharing']['half_linears']} HalfLinears); "
                   f"two calls {results['plain']['call_s']} s / {results['sharing']['call_s']} s; "
                   f"same ids: {record['same_ids']}", record, a.json)

if __name__ == "__main__":
    main()
