"""What the benchmarks share: the machine line each record carries (``machine``), a sampler of this process's resident
memory phase by phase (``Sampler``), the argument parser a script starts from (``arguments``: its docstring's first
line, ``--json PATH``) and the JSON record it writes there (``write_json``)."""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch


def machine(device: str = "cpu") -> str:
    """The processor (or the CUDA device), torch's and python's versions."""
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return f"{name}, torch {torch.__version__}, python {platform.python_version()}"


def arguments(doc: str | None, json_help: str = "also write the results here") -> argparse.ArgumentParser:
    """A script's parser: described by the first line of its docstring ``doc``, with ``--json PATH``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--json", type=Path, default=None, help=json_help)
    return parser


def write_json(path: str | Path | None, record, indent: int = 1) -> None:
    """``record`` as JSON to ``path``, with a final newline; nothing where ``path`` is None."""
    if path:
        Path(path).write_text(json.dumps(record, indent=indent) + "\n")


class Sampler:
    """Samples this process's VmRSS; ``phase(name)`` records the peak while the block runs."""

    def __init__(self, period: float = 0.02):
        self.period, self.current, self.peak = period, 0, 0
        self.phases: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.base = self._rss()
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.current = self._rss()
            self.peak = max(self.peak, self.current)
            time.sleep(self.period)

    @contextmanager
    def phase(self, name: str):
        self.peak = start = self._rss()
        began = time.perf_counter()
        try:
            yield
        finally:
            self.peak = max(self.peak, self._rss())
            self.phases.append({"phase": name, "seconds": round(time.perf_counter() - began, 1),
                                "start_gib": round(start / 2**30, 2), "peak_gib": round(self.peak / 2**30, 2),
                                "end_gib": round(self._rss() / 2**30, 2)})

    def report(self, summary: str, record: dict, path: str | Path | None) -> None:
        """Print each phase and ``summary``; write ``record`` as JSON to ``path`` when given."""
        for phase in self.phases:
            print(f"  {phase['seconds']:7.1f} s  peak {phase['peak_gib']:6.2f} GiB  end {phase['end_gib']:6.2f} GiB  "
                  f"{phase['phase']}")
        print(summary)
        write_json(path, record, indent=2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
