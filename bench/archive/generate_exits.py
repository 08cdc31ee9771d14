"""Exit codes of repeated ``spec-convert generate`` runs on one bundle (issue #21).

Each run is a fresh process of the installed ``spec-convert`` (the one beside this Python), so the runtime's
threads meet the interpreter's shutdown as a user's run does. Prints one line per run (exit code, seconds, whether
stdout is the first run's and whether stderr holds the Swift runtime's abort), then the count of every exit code
(-6: SIGABRT, which a shell shows as 134). Results in docs/benchmarks.md.

    .venv/bin/spec-convert build recipes/tiny_qwen3.yaml -o bundles/gen
    .venv/bin/python -m bench.archive.generate_exits bundles/gen [--runs 50] [--prompt 'def f(x):'] [-n 4]
        [--held-back S]

``--held-back S`` runs the same command with every thread but the main one held up to S seconds after it wakes the
event loop (``_write_to_self``: the runtime's hand-back of a result), as the OS deschedules the runtime's threads on a
loaded machine, taking the GIL back every millisecond: one still held when the interpreter shuts down meets the
shutdown, the race of issue #21 made certain.

A ``PYTHONPATH`` in the environment reaches the runs (to measure another checkout of ``convert``).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HELD_BACK = """\
import asyncio.selector_events, sys, threading, time
from convert.cli import main
write = asyncio.selector_events.BaseSelectorEventLoop._write_to_self
def held_back(loop):
    write(loop)
    end = time.monotonic() + {seconds}
    while threading.get_ident() != threading.main_thread().ident and time.monotonic() < end:
        time.sleep(0.001)
asyncio.selector_events.BaseSelectorEventLoop._write_to_self = held_back
main(sys.argv[1:], prog_name="spec-convert")
"""
SWIFT_ABORT = "C++ exception handling detected but the Swift runtime was compiled with exceptions disabled"


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor())
    fp16 = "avx512_fp16" if "avx512_fp16" in cpuinfo.split() else "no avx512_fp16"
    return f"{model}, {os.cpu_count()} cores, {fp16}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--prompt", default="def f(x):")
    parser.add_argument("-n", "--tokens", type=int, default=4)
    parser.add_argument("--held-back", type=float, metavar="S", help="hold the loop's other threads S seconds")
    args = parser.parse_args()
    program = [str(Path(sys.executable).with_name("spec-convert"))] if args.held_back is None else \
        [sys.executable, "-P", "-c", HELD_BACK.format(seconds=args.held_back)]
    command = [*program, "generate", str(args.bundle), "--prompt", args.prompt, "-n", str(args.tokens)]
    where = subprocess.run([sys.executable, "-P", "-c", "import convert; print(convert.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    print(f"machine: {machine()}")
    print(f"convert: {where}")
    print(f"command: {' '.join(command) if args.held_back is None else 'held back: ' + ' '.join(command[4:])}")
    print(f"load average at start: {os.getloadavg()}", flush=True)
    codes, first, start = Counter(), None, time.perf_counter()
    for run in range(1, args.runs + 1):
        began = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        first = result.stdout if first is None else first
        codes[result.returncode] += 1
        print(f"run {run:3d}: exit {result.returncode:3d}  {time.perf_counter() - began:6.1f} s  "
              f"stdout {'same' if result.stdout == first else 'DIFFERENT'} {result.stdout.strip()!r}"
              f"{'  swift abort' if SWIFT_ABORT in result.stderr else ''}", flush=True)
    print(f"load average at end: {os.getloadavg()}; {time.perf_counter() - start:.0f} s in all")
    print("exit codes: " + ", ".join(f"{code}: {count}" for code, count in sorted(codes.items())))
    print(f"{codes[0]} of {args.runs} exit 0")


if __name__ == "__main__":
    main()
