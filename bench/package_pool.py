"""Benchmark: a parted build's (part, format) packaging jobs one part after the other and in a pool of workers.

The hybrid fixture (``recipes/tiny_qwen3_5.yaml``, 11.8M parameters) under ``--max-part-mb`` (6: the embedding, four
chunks of two layers and the head; both formats: 12 jobs), its gate on 2 windows of 64 tokens, built twice by
``spec-convert build --no-cache`` in a child process (``bench/scale_build.run_build``): ``--jobs 1`` (each part in a
fresh process, one format after the other) and ``--jobs W`` (the pool, ``convert/pipeline/package_pool.py``), with
``CHAINED_RUN_PARAMETERS`` set to 0 (``--chained`` keeps it): each part replayed alone and each job in a fresh process,
as a target above 50M parameters is built. Recorded per run: each job's seconds (the pool: its job line, load
included; one part after the other: its format's package, check and compile lines; each part's load and recording
apart), the packaging phase's wall (from the first part's recording to the artifact gate, from the log's stamps), the
build's wall, and the host peak: the process tree's VmRSS summed every second, and a bound whatever the sampling
missed, the build process's VmHWM plus the W largest of its descendants'. The two bundles' packages must be equal (the
manifests' package hashes); the speedup is the packaging wall's.

    PYTHONPATH=. python3 -m bench.package_pool [--workers 2] [--max-part-mb 6] [--chained] [--workdir DIR]
                                               [--json out.json] [--log-dir DIR]
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from bench.common import arguments, machine, write_json
from bench.scale_build import run_build

ROOT = Path(__file__).resolve().parents[1]
SHORT = ("-c", "import sys; from convert.pipeline import build; build.CHAINED_RUN_PARAMETERS = 0; "
               "from convert.cli import main; main(sys.argv[1:], prog_name='spec-convert')")
POOLED_JOB = re.compile(r"^package job: part (?P<part>\S+), (?P<format>\w+) \(\d+ jobs\)$")
PACKAGED = re.compile(r"^package (?P<format>\w+): \S+?\.(?P<part>[^.]+)\.(aimodel|mlpackage) ")
STEP = re.compile(r"^(check|compile) (?P<format>\w+)\b")
RECORDED = re.compile(r"^load part (?P<part>\S+) \(")
STAMP = re.compile(r"^\[(\d+):(\d\d):(\d\d)\] ")


def recipe_text(max_part_mb: float) -> str:
    text = (ROOT / "recipes" / "tiny_qwen3_5.yaml").read_text()
    return text.replace("path:../fixtures/", f"path:{ROOT}/fixtures/").replace(
        "  context: 512", f"  max_part_mb: {max_part_mb:g}\n  context: 512").replace(
        "data: {samples: 16, length: 256}", "data: {samples: 2, length: 64}")


def job_seconds(stages: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Each job's seconds ("part format") and each part's load-and-record seconds, from the build's stage lines: the
    pool's job lines where there are any, else each format's package, check and compile lines."""
    pooled = any(POOLED_JOB.match(stage["stage"]) for stage in stages)
    jobs: dict[str, float] = {}
    recorded: dict[str, float] = {}
    current: dict[str, str] = {}  # format -> the part it packages now (one part after the other)
    for stage in stages:
        title, seconds = stage["stage"], stage["seconds"]
        match = POOLED_JOB.match(title) if pooled else PACKAGED.match(title)
        if match:
            current[match["format"]] = match["part"]
        elif not pooled and (match := STEP.match(title)) and match["format"] in current:
            match = {"part": current[match["format"]], "format": match["format"]}
        elif recorded_match := RECORDED.match(title):
            recorded[recorded_match["part"]] = seconds
        if match:
            key = f"{match['part']} {match['format']}"
            jobs[key] = jobs.get(key, 0.0) + seconds
    return {k: round(v, 1) for k, v in jobs.items()}, recorded


def packaging_wall(log: Path) -> int:
    """Seconds from the first part's recording to the artifact gate, by the log's stamps."""
    start = end = None
    for line in log.read_text().splitlines():
        stamp = STAMP.match(line)
        if not stamp:
            continue
        at = int(stamp[1]) * 3600 + int(stamp[2]) * 60 + int(stamp[3])
        if start is None and ("▶ load part" in line or "▶ record the calls" in line):
            start = at
        if "▶ artifact gate" in line:
            end = at
            break
    return end - start


def measure(recipe: Path, out: Path, log: Path, jobs: int, chained: bool) -> dict:
    load = os.getloadavg()[0]
    launcher = ("-m", "convert") if chained else SHORT
    result = run_build(recipe, out, log, options=("--jobs", str(jobs)), launcher=launcher)
    if result["exit_code"] != 0:
        raise SystemExit(f"the build with --jobs {jobs} failed (exit {result['exit_code']}): see {log}")
    per_job, recorded = job_seconds(result["stages"])
    hwm = result["descendants_hwm_gib"]
    manifest = json.loads((out / "manifest.json").read_text())
    return {"jobs": jobs, "build_seconds": result["seconds"], "packaging_wall_seconds": packaging_wall(log),
            "job_seconds": dict(sorted(per_job.items())), "job_seconds_sum": round(sum(per_job.values()), 1),
            "part_record_seconds": recorded, "peak_tree_rss_gib": result["peak_rss_gib"],
            "build_process_hwm_gib": result["build_process_hwm_gib"], "processes": result["processes"],
            "peak_bound_gib": round(result["build_process_hwm_gib"] + sum(hwm[:jobs]), 2),
            "largest_descendants_hwm_gib": hwm[:jobs], "load_average_before": round(load, 2),
            "load_average_after": round(os.getloadavg()[0], 2),
            "packages": {p["path"]: p["stable_hash"] for p in manifest["packages"]}}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--workers", type=int, default=2, help="the pool's width (build --jobs)")
    parser.add_argument("--max-part-mb", type=float, default=6)
    parser.add_argument("--chained", action="store_true", help="keep CHAINED_RUN_PARAMETERS (the fixture's parts "
                        "chained on the runtime, the pool's processes reused)")
    parser.add_argument("--workdir", type=Path, help="where the bundles go (default: a temp dir)")
    parser.add_argument("--log-dir", type=Path, help="keep the two builds' logs here (default: the work dir)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=options.workdir) as tmp:
        root = Path(tmp)
        logs = options.log_dir or root
        logs.mkdir(parents=True, exist_ok=True)
        recipe = root / "pool.yaml"
        recipe.write_text(recipe_text(options.max_part_mb))
        runs = [measure(recipe, root / f"jobs-{jobs}", logs / f"package-pool-jobs-{jobs}.log", jobs, options.chained)
                for jobs in (1, options.workers)]
    sequential, pooled = runs
    report = {"machine": machine("cpu"), "cores": os.cpu_count(), "recipe": "tiny_qwen3_5",
              "max_part_mb": options.max_part_mb, "chained": options.chained, "runs": runs,
              "packages_equal": sequential.pop("packages") == pooled.pop("packages"),
              "speedup_packaging": round(sequential["packaging_wall_seconds"] / pooled["packaging_wall_seconds"], 2),
              "speedup_build": round(sequential["build_seconds"] / pooled["build_seconds"], 2)}
    print(json.dumps(report, indent=1))
    write_json(options.json, report)


if __name__ == "__main__":
    main()
