"""Benchmark: the gate's streamed fp32 reference at full size (issue #23), against the release rehearsal's pack.

``bench/release_rehearsal.py --write-only`` writes the seeded Ternary Bonsai 2 27B pack into a Hugging Face cache;
this plans ``recipes/bonsai2_27b_dflash2.yaml`` unchanged against it (the plan's unfolded view of the pack is the
reference's checkpoint, as in the build), takes the recipe's gate data (16 windows of 256 tokens through the pack's
tokenizer) and runs ``convert.verify.reference.streamed_reference`` as the build's gate does: one pass over the
windows, one more for the greedy continuation (teacher-forced on a candidate's continuation). No candidate is built
here, so each window's continuation is seeded ids: a pass's cost does not depend on which ids it reads. Records the
seconds of each pass, the process's peak resident memory (``ru_maxrss``) and the plan's estimate of the gate's
reference term beside it.

    PYTHONPATH=. python3 -m bench.archive.gate_reference --workdir DIR [--json out.json]
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from pathlib import Path

import torch

from bench.common import arguments, write_json
from bench.release_rehearsal import RECIPE


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--workdir", type=Path, required=True, help="bench.release_rehearsal's work directory")
    options = parser.parse_args()
    work = options.workdir.resolve()
    os.environ.update(HF_HUB_CACHE=str(work / "hf-cache"), HF_HUB_OFFLINE="1", SPEC_CONVERT_CACHE=str(work / "cache"))

    from convert.pipeline import partition
    from convert.pipeline.plan import make_plan
    from convert.verify import gates, reference

    start = time.perf_counter()
    plan = make_plan(RECIPE)
    _, data = gates.recipe_gate(plan)
    target = plan.recipe.target
    windows, taps, greedy = data.tokens.tolist(), list(target.taps), target.gate.greedy_tokens
    generator = torch.Generator().manual_seed(0)
    continuations = [torch.randint(0, plan.args.vocab_size, (greedy,), generator=generator).tolist()
                     for _ in windows]
    planned = time.perf_counter() - start

    passes: list[float] = []
    timed_pass = reference._pass

    def timing(*args, **kwargs):
        began = time.perf_counter()
        out = timed_pass(*args, **kwargs)
        passes.append(round(time.perf_counter() - began, 1))
        return out

    reference._pass = timing
    began = time.perf_counter()
    results = reference.streamed_reference(plan.snapshot.directory, windows, taps, continuations)
    seconds = time.perf_counter() - began
    window_bytes = partition.reference_window_bytes(plan.args, target)
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "recipe": str(RECIPE.name), "windows": len(windows), "length": len(windows[0]), "greedy_tokens": greedy,
        "taps": taps, "plan_seconds": round(planned, 1), "reference_seconds": round(seconds, 1),
        "pass_seconds": passes, "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "plan_window_bytes": window_bytes, "plan_windows_gib": round(len(windows) * window_bytes / 2**30, 2),
        "greedy_lengths": sorted({len(r.greedy) for r in results}),
        "logits_finite": all(bool(torch.isfinite(r.logits).all()) for r in results),
    }
    print(json.dumps(report, indent=1))
    write_json(options.json, report)


if __name__ == "__main__":
    main()
