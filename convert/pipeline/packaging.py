"""Package, check and compile one part in every format of the recipe.

Each format's work (convert, read back and check, compile) is independent of the other's and single-threaded
Python for the most part (torch.export / coreai-torch, torch.jit.trace / coremltools), so with more than one core
the formats run side by side: Core AI in this process, every other format in a forked worker process (one torch
thread). Core AI stays here because its check runs the package on the Core AI runtime, whose native threads and
locks do not survive a fork: a worker forked from a process that had used the runtime hung loading it. The workers
inherit the export modules from the fork (copy-on-write) instead of receiving a pickled copy, and return only the
check results and compile records; an error in a worker is raised here. The bundle is the same either way.

Packages are cached (``convert/cache.py``, stage ``package``) under a key of the modules' content (every parameter
and buffer), the function specs, the calls their check replays (a drafter's, a target part's), the format, the
toolchain and the packaging code: a resumed build restores a finished format's package, its check results and its
compiled outputs instead of converting again.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from convert import backends, progress
from convert import cache as build_cache
from convert.backends.base import CompileRecord
from convert.export.quantized import dense_weight_names
from convert.pipeline.bundle import COMPILED
from convert.processes import die_with_parent
from convert.progress import stage
from convert.verify import checks


@dataclass
class Packaged:
    format: str
    path: Path
    check: dict
    compiled: list[CompileRecord]
    check_seconds: float


_WORK: dict = {}  # what the forked workers read: set before the pool starts, never pickled


IN_PROCESS = ("coreai",)  # formats whose check runs a native runtime: never in a forked worker
CACHE_STAGE = "package"
CODE = ("convert.pipeline.packaging", "convert.verify.checks", "convert.export.quantized",
        "convert.export.functions", "convert.pipeline.partition", "convert.backends.base")
TOOLCHAIN = ("spec-convert", "torch", "coreai-core", "coreai-torch", "coremltools", "numpy")


def package_formats(formats: list[str], modules, out: Path, stem: str, calls: list | None = None,
                    cache: build_cache.BuildCache | None = None, every_function: bool | None = None,
                    side_by_side: bool = True) -> list[Packaged]:
    """``stem`` + each format's suffix under ``out``, packaged, checked (``checks.check_package``: a drafter or a
    target's part passes the ``calls`` recorded for its check to replay) and compiled into ``out/compiled``, in the
    order of ``formats``; ``side_by_side`` False: one format after the other, in this process (each format's
    packaging memory in turn, not together). With a ``cache``, finished formats are restored from it (the key holds
    the calls)."""
    cache = cache if cache is not None else build_cache.BuildCache(enabled=False)
    weights = weights_digest(modules) if cache.enabled else ""  # once: it reads every tensor of the modules
    recorded = calls_digest(calls) if cache.enabled else ""
    keys = {name: package_key(name, modules, stem, weights, recorded, every_function) for name in formats} \
        if cache.enabled else {}
    restored = {}
    for name in formats:
        entry = cache.get(CACHE_STAGE, keys[name]) if cache.enabled else None
        if entry is not None:
            with progress.stage(f"package {name}: {stem}{backends.SUFFIXES[name]} restored from the cache"):
                restored[name] = _restore(entry, out)

    def store(packaged: Packaged) -> None:  # as soon as a format is done: a later kill keeps it
        if cache.enabled:
            cache.put(CACHE_STAGE, keys[packaged.format], lambda d: _store(d, packaged, out))

    missing = [name for name in formats if name not in restored]
    built = {p.format: p for p in _package_all(missing, modules, out, stem, calls, every_function, store,
                                               side_by_side)} \
        if missing else {}
    return [restored.get(name) or built[name] for name in formats]


def calls_digest(calls: list | None) -> str:
    """sha256 of recorded calls (function names, inputs and expected outputs: names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for function, *arrays in calls or []:
        digest.update(function.encode())
        for named in arrays:
            for name, value in sorted(named.items()):
                value = np.ascontiguousarray(value)
                digest.update(f"{name}:{value.dtype}:{list(value.shape)}".encode() + value.tobytes())
    return digest.hexdigest()


def weights_digest(modules) -> str:
    """sha256 of every parameter and buffer of the modules' core (a quantized linear's codes and tables, not its
    dense weight, which they determine and which a part's packaging releases): names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    core = modules.core
    dense = dense_weight_names(core)
    tensors = {**dict(core.named_parameters(remove_duplicate=False)), **dict(core.named_buffers())}
    for tensor_name, tensor in sorted(tensors.items()):
        if tensor_name in dense:
            continue
        digest.update(f"{tensor_name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def package_key(name: str, modules, stem: str, weights: str, calls: str = "",
                every_function: bool | None = None) -> str:
    """The cache key of format ``name``'s package of ``modules`` (``weights``: their ``weights_digest``; ``calls``:
    the ``calls_digest`` of what its check replays): their content, specs, toolchain and code."""
    specs = [repr(spec) for _, spec in modules.functions.values()]
    code = CODE + (f"convert.backends.{name}", type(modules.core).__module__)  # the architecture file of the core
    return build_cache.key({"stage": CACHE_STAGE, "format": name, "stem": stem, "weights": weights,
                            "specs": specs, "contract": modules.contract, "calls": calls,
                            "every_function": every_function, "toolchain": build_cache.versions(TOOLCHAIN),
                            "code": build_cache.code_fingerprint(code)})


def _store(directory: Path, packaged: Packaged, out: Path) -> dict:
    shutil.copytree(packaged.path, directory / "package" / packaged.path.name)
    for record in packaged.compiled:
        for output in record.outputs:
            source = out / COMPILED / output
            target = directory / "compiled" / output
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)
    return {"format": packaged.format, "name": packaged.path.name, "check": packaged.check,
            "check_seconds": packaged.check_seconds, "compiled": [vars(c) for c in packaged.compiled]}


def _restore(entry: build_cache.Entry, out: Path) -> Packaged:
    meta = entry.meta
    path = out / meta["name"]
    shutil.copytree(entry.path("package") / meta["name"], path)
    if entry.path("compiled").is_dir():
        shutil.copytree(entry.path("compiled"), out / COMPILED, dirs_exist_ok=True)
    compiled = [CompileRecord(**c) for c in meta["compiled"]]
    return Packaged(meta["format"], path, meta["check"], compiled, meta["check_seconds"])


def _package_all(formats: list[str], modules, out: Path, stem: str, calls: list | None, every_function: bool | None,
                 finished: Callable[[Packaged], None], side_by_side: bool) -> list[Packaged]:
    """Package every format (side by side where it can); ``finished`` sees each one as it completes."""
    jobs = [(name, out / f"{stem}{backends.SUFFIXES[name]}") for name in formats]
    forked = [(name, path) for name, path in jobs if name not in IN_PROCESS]
    parallel = side_by_side and len(jobs) > 1 and forked and (os.cpu_count() or 1) > 1 and \
        "fork" in multiprocessing.get_all_start_methods()

    def record(packaged: Packaged) -> Packaged:
        finished(packaged)
        return packaged

    if not parallel:
        return [record(_package(name, path, modules, out, calls, every_function)) for name, path in jobs]
    _WORK.update(modules=modules, out=out, calls=calls, every_function=every_function)
    live, progress.live = progress.live, False  # several processes print: plain stage lines, no spinners
    try:
        with ProcessPoolExecutor(len(forked), mp_context=multiprocessing.get_context("fork"),
                                 initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
            futures = {name: pool.submit(_worker, name, path) for name, path in forked}
            for future in futures.values():  # stored the moment a worker is done, while this process packages on
                future.add_done_callback(lambda f: f.exception() is None and finished(f.result()))
            done = {name: record(_package(name, path, modules, out, calls, every_function)) for name, path in jobs
                    if name not in futures}
            done.update({name: future.result() for name, future in futures.items()})
    finally:
        _WORK.clear()
        progress.live = live
    return [done[name] for name, _ in jobs]


def _worker(name: str, path: Path) -> Packaged:
    import torch

    torch.set_num_threads(1)  # one core per format; and no OpenMP team inherited across the fork
    return _package(name, path, _WORK["modules"], _WORK["out"], _WORK["calls"], _WORK["every_function"])


def _package(name: str, path: Path, modules, out: Path, calls: list | None, every_function: bool | None) -> Packaged:
    backend = backends.load(name)
    with stage(f"package {name}: {path.name} ({', '.join(modules.functions)})"):
        backend.package(modules.functions, path)
    what = "read back" if name != "coreai" else "read back and run on the Core AI runtime" if calls is None else \
        "read back and replay the recorded calls on the Core AI runtime"
    start = time.perf_counter()
    with stage(f"check {name}: {what}"):
        check = checks.check_package(name, path, modules, calls, every_function)
    seconds = time.perf_counter() - start
    with stage(f"compile {name}"):
        compiled = backend.compile(path, out / COMPILED)
    return Packaged(name, path, check, compiled, seconds)
