"""A parted target's packages as (part, format) jobs run side by side in a pool of fresh processes.

Every part's check calls are recorded first (``convert/pipeline/build.py``: the chained torch pass stays one part after
the other); then each job loads its part alone (``PartLoader``), releases its quantized linears' dense weights and
packages, checks and compiles one format (``package_formats``: cached per job, so a killed build resumes job by job)
in a spawned process (``convert.processes.in_fresh_processes``: nothing of the build process is inherited, the Core
AI runtime's threads included, which do not survive a fork). The pool is as wide as the cores and the host memory
allow (``pool_width``): each job's estimated peak is a process's base and its part's packaging memory (the plan's
measured costs, ``partition.packaging_bytes``), and the jobs running at once stay within ``target.max_host_memory_gb``
beside the build process; the longest jobs start first (``jobs_of``). The results come back in part order, so the
bundle and the manifest are the sequential build's byte for byte; a job that fails fails the build naming its part
and format, before anything is published.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from convert import progress
from convert.cache import BuildCache
from convert.export.quantized import release_dense_weights
from convert.pipeline.packaging import Packaged, package_formats
from convert.pipeline.partition import BASE_BYTES, GB, packaging_bytes
from convert.pipeline.record import function_record
from convert.processes import in_fresh_processes
from convert.progress import stage
from convert.weights import rescale
from convert.weights.quantize import QuantizeResult
from convert.weights.shipped import PartLoader


@dataclass(frozen=True)
class Job:
    index: int  # the part's, in ``plan.parts``
    part: str
    format: str

    @property
    def name(self) -> str:
        return f"part {self.part}, {self.format} package"


@dataclass
class Done:
    """A job's package (its check and compile records) and its part's function records (the manifest's)."""

    packaged: Packaged
    functions: list[dict]


def job_bytes(plan, index: int) -> int:
    """A job's estimated peak host memory: a process's base and packaging its part (``partition.packaging_bytes``,
    measured per format in turn: one format's job takes at most that)."""
    return BASE_BYTES + packaging_bytes(plan.parts[index], plan.sizes)


def pool_width(plan, requested: int | None = None, cores: int | None = None, beside: int = 0) -> tuple[int, str]:
    """How many jobs run at once, and why: ``requested`` (``build --jobs``; default the cores), no more than the jobs,
    and no more than ``target.max_host_memory_gb`` holds beside the build process's base (and ``beside`` bytes more
    it holds while the pool runs: the drafter stage's, ``plan.drafter_stage_bytes``) at the largest job's peak (at
    least one)."""
    jobs = len(plan.parts) * len(plan.recipe.backends)
    cores = cores or os.cpu_count() or 1
    room = plan.recipe.target.max_host_memory_gb * GB - BASE_BYTES - beside
    peak = max(job_bytes(plan, i) for i in range(len(plan.parts)))
    memory = max(1, int(room // peak))
    width = max(1, min(requested or cores, jobs, memory))
    asked = f"--jobs {requested}" if requested else f"{cores} cores"
    held = f" and the drafter stage's {beside / GB:.1f} GB" if beside else ""
    return width, (f"{asked}; host memory: {memory} of the largest job's {peak / GB:.1f} GB within "
                   f"target.max_host_memory_gb {plan.recipe.target.max_host_memory_gb:g} beside the build process"
                   f"{held}")


def jobs_of(plan) -> list[Job]:
    """Every (part, format) job, the longest first as far as known: the parts with the most decoder layers, then the
    largest packaging memory (a layer's ops take the converters far longer than a table's rows: at the 27B width a
    7-layer chunk 1,034 s, a head part 127 s, both formats; on the hybrid fixture a 2-layer part 10-27 s a format, the
    embedding or the head 1-4 s), each part's formats in the recipe's order."""
    order = sorted(range(len(plan.parts)), key=lambda i: (-len(plan.parts[i].layer_indices), -job_bytes(plan, i)))
    return [Job(i, plan.parts[i].name, name) for i in order for name in plan.recipe.backends]


def package_jobs(plan, result: QuantizeResult | None, scales: rescale.Scales, out: Path, cache: BuildCache,
                 calls: list[list], width: int, why: str, fresh_each: bool = True,
                 stop: threading.Event | None = None) -> dict[tuple[int, str], Done]:
    """Every job (``jobs_of``) in a pool ``width`` wide, each part's check replaying its ``calls``; by (part index,
    format). ``fresh_each``: a fresh process for every job (what one leaves in memory does not add to the next; a
    large target's), else each pool process runs jobs one after the other (its imports once). ``stop``: see
    ``in_fresh_processes`` (the pool run beside the drafter stage, ``processes.InBackground``)."""
    jobs = jobs_of(plan)
    arguments = [(plan, result, scales, job, out, cache, calls[job.index], len(jobs)) for job in jobs]
    live, progress.live = progress.live, False  # several processes print: plain stage lines, no spinners
    try:
        with stage(f"package {len(jobs)} jobs ({len(plan.parts)} parts x {len(plan.recipe.backends)} formats), "
                   f"{width} at once ({why})"):
            done = in_fresh_processes(package_job, arguments, [job.name for job in jobs], width,
                                      _ThreadsEach(max(1, (os.cpu_count() or 1) // width)), one_each=fresh_each,
                                      stop=stop)
    finally:
        progress.live = live
    return {(job.index, job.format): d for job, d in zip(jobs, done, strict=True)}


@dataclass(frozen=True)
class _ThreadsEach:
    """A pool process's setup: plain stage lines, and its share of the cores as torch threads (two processes of all
    the cores' threads each spin-wait for each other)."""

    threads: int

    def __call__(self) -> None:
        import torch

        progress.live = False
        torch.set_num_threads(self.threads)


def package_job(plan, result: QuantizeResult | None, scales: rescale.Scales, job: Job, out: Path, cache: BuildCache,
                calls: list, total: int) -> Done:
    """One job, in a pool process: its part loaded alone, its dense weights released, one format packaged."""
    part = plan.parts[job.index]
    with stage(f"package job: part {part.name}, {job.format} ({total} jobs)"):
        piece = PartLoader(plan, result, scales).load([part])[0]
        release_dense_weights(piece.core)  # packaged from codes and tables: 2 bytes a quantized weight less
        (packaged,) = package_formats([job.format], piece, out, f"{plan.recipe.name}.{part.name}", calls, cache,
                                      every_function=True, side_by_side=False)
    return Done(packaged, [function_record(spec) for _, spec in piece.functions.values()])
