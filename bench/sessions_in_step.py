"""Benchmark: several sessions' target calls in step (``convert.export.lockstep.in_step``) over a target held as its
packed codes at the Ternary Bonsai 2 27B width, as the drafter stage runs its prompts.

Builds ``--layers`` decoder layers' quantized matrices and the 248320-row head as ``CodesLinear``s
(``bench/lean_target.py``'s seeded exact2 matrices) and their fp32 compute copy. Then, for each width (1: decode, 8:
verify) and each session count, it runs that many sessions in step, each calling every matrix once in model order on
its own seeded input: each block of a weight made once for every session. It reports the time per session's call (the
step's time over the sessions; the best of ``--repeats``, this machine's timings vary), extrapolated to a 64-layer
target call by weights, and checks every session's outputs against the same call made alone (bit for bit).

    PYTHONPATH=. python3 -m bench.sessions_in_step [--layers 4] [--sessions 1,2,4,8] [--json out.json]
"""

from __future__ import annotations

import copy
import functools
import time

import torch
from torch import nn

from bench.common import Sampler, arguments, machine
from bench.lean_target import codes_layers, ternary
from bench.part_memory import KINDS
from bench.scale import GEOMETRY
from convert.export.lockstep import StepRecord, in_step
from convert.export.quantized import CodesLinear


def call_every_matrix(target: nn.Module, width: int, seed: int) -> list[torch.Tensor]:
    """One session's call: every matrix, in model order, on seeded inputs [1, width, in]; the head's output kept whole,
    the others' first row (a check of each product)."""
    generator = torch.Generator().manual_seed(seed)
    kept = []
    for module in [*(m for layer in target.layers for m in layer.values()), target.lm_head]:
        out = module(torch.randn(1, width, module.shape[1], generator=generator))
        kept.append(out if module is target.lm_head else out[0, 0].clone())
    return kept


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layer-types", default="LLLF", help="L (Gated DeltaNet) / F (attention), cycled")
    parser.add_argument("--sessions", default="1,2,4,8")
    parser.add_argument("--widths", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    g = GEOMETRY
    kinds = [KINDS[a.layer_types[i % len(a.layer_types)]] for i in range(a.layers)]
    counts, widths = [int(n) for n in a.sessions.split(",")], [int(w) for w in a.widths.split(",")]
    sampler = Sampler()
    target = nn.Module()
    with sampler.phase("build the CodesLinears"):
        target.layers = codes_layers(kinds, generator)
        target.lm_head = CodesLinear("lm_head", ternary("lm_head", (g["vocab_size"], g["hidden_size"]), generator))
        target32 = copy.deepcopy(target).to(torch.float32)
    layer_weights = sum(m.shape[0] * m.shape[1] for layer in target.layers for m in layer.values())
    results, identical = {}, True
    for width in widths:
        with torch.no_grad():
            alone = [call_every_matrix(target32, width, seed) for seed in range(max(counts))]
        for count in counts:
            times = []
            for _ in range(a.repeats):
                record = StepRecord()
                with sampler.phase(f"{count} sessions in step at width {width}"):
                    began = time.perf_counter()
                    calls = [functools.partial(call_every_matrix, target32, width, s) for s in range(count)]
                    outputs = in_step(calls, record)
                    times.append(time.perf_counter() - began)
            seconds = min(times)
            same = all(torch.equal(a_, b_) for s in range(count) for a_, b_ in zip(outputs[s], alone[s], strict=True))
            identical &= same
            results[f"width_{width}_sessions_{count}"] = {
                "seconds": round(seconds, 2), "all_seconds": [round(t, 2) for t in times],
                "seconds_per_call": round(seconds / count, 2),
                "groups": record.groups, "products": record.products, "identical_to_alone": same}
    sampler.stop()
    # a 64-layer call: the time scaled by its weights (64 layers and the head) over the bench's (the matrices are
    # the call's work)
    head_weights = g["vocab_size"] * g["hidden_size"]
    scale = (64 * layer_weights / a.layers + head_weights) / (layer_weights + head_weights)
    per_call_64 = {key: round(row["seconds_per_call"] * scale, 1) for key, row in results.items()}
    record = {"machine": machine("cpu"), "threads": torch.get_num_threads(),
              "layer_types": [k[0].upper() for k in kinds], "layer_weights": layer_weights, "results": results,
              "estimated_call_s_at_64_layers": per_call_64, "identical_to_alone": identical,
              "phases": sampler.phases, "base_gib": round(sampler.base / 2**30, 2)}
    lines = ", ".join(f"{k}: {v} s" for k, v in per_call_64.items())
    sampler.report(f"a target call at 64 layers, per session: {lines}; outputs equal the calls made alone: {identical}",
                   record, a.json)


if __name__ == "__main__":
    main()
