"""Benchmark: a whole build of a model larger than this machine's memory, with its peak resident memory per stage.

A synthetic checkpoint at the Qwen3.8-27B width (``bench/scale.py``'s geometry: hidden 5120, intermediate 17408,
vocab 248320, untied) with ``--layers`` decoder layers in the hybrid pattern [L L L F] (seeded bf16, sharded), built
by ``spec-convert build`` in a child process from a recipe written beside it: affine4 by default, parts under
``--max-part-mb``, the gate on ``--gate-samples`` x ``--gate-length`` tokens with ``--greedy`` greedy tokens,
``--backends`` (Core ML by default: the Linux Core AI runtime emulates fp16, and its per-part replays at this width
would take hours; see docs/benchmarks.md). The model's random weights make the gate's values meaningless, so the
recipe's thresholds are set so that any finite value passes: the bench measures time and memory, and prints the
values. The build runs stages in processes of their own (convert/processes.py), so memory is measured over the
build's process tree: every second the resident memory of the build and all its descendants is summed (``VmRSS``,
split into ``RssAnon`` and ``RssFile``); each stage's peak is the largest sum between its start and end lines. The
peak of the tree is the largest sum sampled, and ``peak_bound_gib`` bounds it from above whatever the sampling missed:
the build process's own peak (``VmHWM``) plus the largest peak of any one descendant (one stage process runs at a
time with one format).

    PYTHONPATH=. python3 -m bench.scale_build [--layers 28] [--method affine4] [--max-part-mb MB]
                                              [--workdir DIR] [--json out.json] [--log build.log]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import arguments, machine, write_json
from bench.scale import _corpus, write_checkpoint

STAGE_LINE = re.compile(r"\u2713 (?P<title>.+?) \((?P<seconds>[0-9.]+) s\)\s*$")


def recipe_text(checkpoint: Path, method: str, max_part_mb: float | None, samples: int, length: int, greedy: int,
                backends: list[str]) -> str:
    """The bench's recipe; ``max_part_mb`` None keeps the recipe's default (parts also sized from
    ``target.max_host_memory_gb``, default 16)."""
    permissive = {"mean_kl_max": 1e9, "p99_kl_max": 1e9, "max_kl_max": 1e9, "top1_min": 0, "cosine_min": -1,
                  "greedy_match_min": 0, "tap_cosine_min": -1, "block_chain_real_flips_max": 1_000_000}
    return json.dumps({
        "name": "scale-build",
        "target": {"source": f"path:{checkpoint}", "graphs": {"prefill": 32, "decode": 1, "verify": 8},
                   "context": 256, **({"max_part_mb": max_part_mb} if max_part_mb else {}),
                   "quantization": {"method": method},
                   "gate": {"data": {"corpus": "path:corpus.txt", "samples": samples, "length": length},
                            "greedy_tokens": greedy, "thresholds": permissive}},
        "backends": backends,
    }, indent=1)


def _status(pid: int) -> dict[str, int]:
    """The memory fields of a process's /proc status in bytes (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    except (OSError, ValueError):
        return {}


def _descendants(root: int) -> list[int]:
    """Every living descendant of ``root`` (from each process's parent id in /proc/*/stat)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def run_build(recipe: Path, output: Path, log: Path, cached: bool = False, options: tuple[str, ...] = (),
              launcher: tuple[str, ...] = ("-m", "convert")) -> dict:
    """Run the build in a child process (``cached``: with the build cache, so that a second run resumes; else
    ``--no-cache``; ``options``: more of the build's options; ``launcher``: the interpreter's arguments that run the
    CLI); its stages (from the stage lines) with seconds and the peak resident memory of its process tree (and each
    descendant's own peak, largest first)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    command = [sys.executable, *launcher, "build", str(recipe), "-o", str(output),
               *([] if cached else ["--no-cache"]), *options]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    samples: list[tuple[float, int, int, int]] = []  # (seconds, tree VmRSS, tree RssAnon, tree RssFile)
    hwm: dict[int, int] = {}  # the largest VmHWM read of each process of the tree
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            tree = [(pid, _status(pid)) for pid in [child.pid, *_descendants(child.pid)]]
            for pid, status in tree:
                hwm[pid] = max(hwm.get(pid, 0), status.get("VmHWM", 0))
            samples.append((time.perf_counter() - start, *(sum(s.get(k, 0) for _, s in tree)
                                                          for k in ("VmRSS", "RssAnon", "RssFile"))))
            time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stages, last = [], 0.0
    with log.open("w") as out:
        for line in child.stdout:
            out.write(line)
            out.flush()
            sys.stdout.write(line)
            match = STAGE_LINE.search(line)
            if match:
                now = time.perf_counter() - start
                window = [s for s in samples if last - 1 <= s[0] <= now + 1]
                stages.append({"stage": match["title"], "seconds": float(match["seconds"]),
                               "peak_rss_gib": round(max((s[1] for s in window), default=0) / 2**30, 2),
                               "peak_anon_gib": round(max((s[2] for s in window), default=0) / 2**30, 2)})
                last = now
    code = child.wait()
    done.set()
    sampler.join()
    build_hwm = hwm.pop(child.pid, 0)
    largest_child = max(hwm.values(), default=0)

    def gib(value: int) -> float:
        return round(value / 2**30, 2)

    return {"exit_code": code, "seconds": round(time.perf_counter() - start, 1), "stages": stages,
            "processes": len(hwm) + 1, "peak_rss_gib": gib(max(s[1] for s in samples)),
            "peak_anon_gib": gib(max(s[2] for s in samples)), "peak_file_gib": gib(max(s[3] for s in samples)),
            "build_process_hwm_gib": gib(build_hwm), "largest_descendant_hwm_gib": gib(largest_child),
            "peak_bound_gib": gib(build_hwm + largest_child),
            "descendants_hwm_gib": [gib(v) for v in sorted(hwm.values(), reverse=True)]}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--method", default="affine4")
    parser.add_argument("--max-part-mb", type=float, help="target.max_part_mb (default: the recipe's)")
    parser.add_argument("--gate-samples", type=int, default=2)
    parser.add_argument("--gate-length", type=int, default=64)
    parser.add_argument("--greedy", type=int, default=4)
    parser.add_argument("--backends", default="coreml")
    parser.add_argument("--workdir", type=Path, help="where the checkpoint and the bundle go (default: a temp dir)")
    parser.add_argument("--log", type=Path, help="the build's output (default: build.log in the work dir)")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=options.workdir) as tmp:
        root = Path(tmp)
        checkpoint = root / "qwen3.8-27b-width"
        kinds = [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(options.layers)]
        start = time.perf_counter()
        write_checkpoint(checkpoint, kinds, "cpu")
        size = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
        written = time.perf_counter() - start
        print(f"synthetic checkpoint: {options.layers} layers, {size / 2**30:.2f} GiB in bf16 (as much in fp16), "
              f"written in {written:.0f} s", flush=True)
        (root / "corpus.txt").write_text(_corpus())
        recipe = root / "scale-build.yaml"
        recipe.write_text(recipe_text(checkpoint, options.method, options.max_part_mb, options.gate_samples,
                                      options.gate_length, options.greedy, options.backends.split(",")))
        log = options.log or root / "build.log"
        result = run_build(recipe, root / "bundle", log)
        bundle = root / "bundle"
        files = [p for p in bundle.rglob("*") if p.is_file()] if bundle.exists() else []
        report = {"machine": machine("cpu"), "memory_gib": round(os.sysconf("SC_PHYS_PAGES") *
                                                                  os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
                  "layers": options.layers, "checkpoint_gib": round(size / 2**30, 2),
                  "checkpoint_seconds": round(written, 1), "method": options.method,
                  "max_part_mb": options.max_part_mb, "backends": options.backends.split(","),
                  "bundle_gib": round(sum(p.stat().st_size for p in files) / 2**30, 2), **result}
        manifest = bundle / "manifest.json"
        if manifest.is_file():
            data = json.loads(manifest.read_text())
            report["parts"] = [p["name"] for p in data.get("parts") or []]
            report["gate"] = data["gate"]["metrics"]
            report["largest_package_mb"] = round(max(sum(f["size"] for f in p["files"]) for p in data["packages"])
                                                  / 1e6, 1)
    print(json.dumps({k: v for k, v in report.items() if k != "stages"}, indent=1))
    for s in report["stages"]:
        print(f"  {s['seconds']:8.1f} s  peak {s['peak_rss_gib']:6.2f} GiB (anonymous {s['peak_anon_gib']:6.2f})  "
              f"{s['stage']}")
    write_json(options.json, report)


if __name__ == "__main__":
    main()
