"""Benchmark: one part of the Bonsai release recipe packaged as its build packages it (issue #23).

A target above ``build.CHAINED_RUN_PARAMETERS`` is packaged part by part, each part in a process of its own
(``build._package_part``): loaded, its calls of the short schedule recorded from the previous part's rows, its
quantized linears' dense weights released, then packaged and checked in each format (Core ML: the constants read
back; Core AI: the calls replayed on the Core AI runtime, whose fp16 is emulated on Linux). This plans
``recipes/bonsai2_27b_dflash2.yaml`` unchanged against ``bench.release_rehearsal``'s cache (``--write-only`` first),
takes the exact pack's weights (``build.quantize_stage``), runs the parts before ``--part`` through torch for their
rows, and packages part ``--part`` as the build's part process does, in this process. Records the wall time of each
step (the build's own stage lines print beside them), the process's peak resident memory (``ru_maxrss``) and the
packages' bytes: what the whole build's packaging stage costs, part by part.

    PYTHONPATH=. python3 -m bench.archive.part_package --workdir DIR [--part 0] [--json out.json]
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import time
from pathlib import Path

import torch

from bench.common import arguments, write_json
from bench.release_rehearsal import RECIPE, du


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--workdir", type=Path, required=True, help="bench.release_rehearsal's work directory")
    parser.add_argument("--part", type=int, default=0, help="which part of the plan (its index)")
    options = parser.parse_args()
    work = options.workdir.resolve()
    os.environ.update(HF_HUB_CACHE=str(work / "hf-cache"), HF_HUB_OFFLINE="1", SPEC_CONVERT_CACHE=str(work / "cache"))

    from convert.cache import BuildCache
    from convert.pipeline import build
    from convert.pipeline.plan import make_plan
    from convert.verify.checks import part_calls
    from convert.weights.shipped import PartLoader

    seconds: dict[str, float] = {}
    began = time.perf_counter()
    plan = make_plan(RECIPE)
    seconds["plan"] = time.perf_counter() - began
    if plan.parameter_count <= build.CHAINED_RUN_PARAMETERS:
        raise SystemExit(f"{RECIPE.name}: {plan.parameter_count:,} parameters; its parts are packaged chained, "
                         "not one at a time")
    part = plan.parts[options.part]
    began = time.perf_counter()
    result = build.quantize_stage(plan, BuildCache(work / "cache"), None)
    seconds["quantize_stage"] = time.perf_counter() - began

    began = time.perf_counter()
    loader = PartLoader(plan, result)
    schedule = build.short_schedule_inputs(loader, plan.args.vocab_size)
    rows = [None] * len(schedule)
    for earlier in plan.parts[:options.part]:  # the rows this part's calls take
        _, rows = part_calls(loader.load([earlier])[0], schedule, rows)
    seconds["earlier_parts_rows"] = time.perf_counter() - began

    out = work / "part-package"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    began = time.perf_counter()
    entries, record, _, _ = build._package_part(plan, result, options.part, out, BuildCache(work / "cache"),
                                                schedule, rows)
    seconds["package_part"] = time.perf_counter() - began
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "recipe": RECIPE.name, "parts": len(plan.parts), "part": part.name, "part_index": options.part,
        "layers": list(part.layers), "embedding": part.embedding, "head": part.head,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "packages": {e["path"]: sum(f["size"] for f in e["files"]) for e in entries},
        "output_bytes": du(out), "functions": [f["name"] for f in record["functions"]],
    }
    print(json.dumps(report, indent=1))
    write_json(options.json, report)


if __name__ == "__main__":
    main()
