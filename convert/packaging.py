"""Package, check and compile one part in every format of the recipe.

Each format's work (convert, read back and check, compile) is independent of the other's and single-threaded
Python for the most part (torch.export / coreai-torch, torch.jit.trace / coremltools), so with more than one core
the formats run side by side: Core AI in this process, every other format in a forked worker process (one torch
thread). Core AI stays here because its check runs the package on the Core AI runtime, whose native threads and
locks do not survive a fork: a worker forked from a process that had used the runtime hung loading it. The workers
inherit the export modules from the fork (copy-on-write) instead of receiving a pickled copy, and return only the
check results and compile records; an error in a worker is raised here. The bundle is the same either way.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from convert import backends, checks, progress
from convert.backends.base import CompileRecord
from convert.progress import stage


@dataclass
class Packaged:
    format: str
    path: Path
    check: dict
    compiled: list[CompileRecord]
    check_seconds: float


_WORK: dict = {}  # what the forked workers read: set before the pool starts, never pickled


IN_PROCESS = ("coreai",)  # formats whose check runs a native runtime: never in a forked worker


def package_formats(formats: list[str], modules, out: Path, stem: str, calls: list | None = None) -> list[Packaged]:
    """``stem`` + each format's suffix under ``out``, packaged, checked (``checks.check_package``; a drafter passes
    its recorded ``calls``) and compiled into ``out/compiled``, in the order of ``formats``."""
    jobs = [(name, out / f"{stem}{backends.SUFFIXES[name]}") for name in formats]
    forked = [(name, path) for name, path in jobs if name not in IN_PROCESS]
    parallel = len(jobs) > 1 and forked and (os.cpu_count() or 1) > 1 and \
        "fork" in multiprocessing.get_all_start_methods()
    if not parallel:
        return [_package(name, path, modules, out, calls) for name, path in jobs]
    _WORK.update(modules=modules, out=out, calls=calls)
    live, progress.live = progress.live, False  # several processes print: plain stage lines, no spinners
    try:
        with ProcessPoolExecutor(len(forked), mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {name: pool.submit(_worker, name, path) for name, path in forked}
            done = {name: _package(name, path, modules, out, calls) for name, path in jobs if name not in futures}
            done.update({name: future.result() for name, future in futures.items()})
    finally:
        _WORK.clear()
        progress.live = live
    return [done[name] for name, _ in jobs]


def _worker(name: str, path: Path) -> Packaged:
    import torch

    torch.set_num_threads(1)  # one core per format; and no OpenMP team inherited across the fork
    return _package(name, path, _WORK["modules"], _WORK["out"], _WORK["calls"])


def _package(name: str, path: Path, modules, out: Path, calls: list | None) -> Packaged:
    backend = backends.load(name)
    with stage(f"package {name}: {path.name} ({', '.join(modules.functions)})"):
        backend.package(modules.functions, path)
    what = "read back" if name != "coreai" else \
        "read back and run on the Core AI runtime" if calls is None else "read back and replay a speculative run"
    start = time.perf_counter()
    with stage(f"check {name}: {what}"):
        check = checks.check_package(name, path, modules, calls)
    seconds = time.perf_counter() - start
    with stage(f"compile {name}"):
        compiled = backend.compile(path, out / "compiled")
    return Packaged(name, path, check, compiled, seconds)
