"""Stages run in a fresh process, so that what one stage leaves in memory does not add to the next.

A build larger than host memory streams every stage, but one process that runs them all keeps gigabytes it no longer
uses between stages (measured over a 28-layer build at the 27B width: 7.6-10.4 GiB resident between parts, none of
them loaded; docs/benchmarks.md "A build larger than memory"). A stage run by ``in_fresh_process`` starts from a
fresh interpreter (``spawn``: nothing of the parent is inherited, the Core AI runtime's threads included) and gives
everything back when it ends; the build process keeps only what the stages return.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

T = TypeVar("T")


def in_fresh_process(function: Callable[..., T], *args) -> T:
    """``function(*args)`` in a new spawned process (a module-level function; arguments and result picklable); its
    exception is raised here. The process is killed with this one (``die_with_parent``)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        try:
            return pool.submit(function, *args).result()
        except BrokenProcessPool:
            raise RuntimeError(f"the process running {function.__qualname__} died (killed, or out of memory: see "
                               "the system log); rerun the build, it resumes from the cache") from None


def in_this_process(function: Callable[..., T], *args) -> T:
    """``function(*args)`` here: the stand-in for ``in_fresh_process`` where a stage is small."""
    return function(*args)


def die_with_parent(parent: int) -> None:
    """A worker ends with its build: on Linux the kernel kills it (SIGKILL) when the build process dies, so a build
    that is killed leaves no orphan working on (measured: orphans of SIGKILLed builds hung for 40 minutes)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker ends when it next talks to the gone parent
        return
    if os.getppid() != parent:  # the build died before the request took effect
        os._exit(1)
