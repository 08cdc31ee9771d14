"""Stages run in a fresh process, so that what one stage leaves in memory does not add to the next.

A build larger than host memory streams every stage, but one process that runs them all keeps gigabytes it no longer
uses between stages (measured over a 28-layer build at the 27B width: 7.6-10.4 GiB resident between parts, none of
them loaded; docs/benchmarks.md "A build larger than memory"). A stage run by ``in_fresh_process`` starts from a
fresh interpreter (``spawn``: nothing of the parent is inherited, the Core AI runtime's threads included) and gives
everything back when it ends; the build process keeps only what the stages return. ``in_fresh_processes`` runs
several such calls at once in a pool of spawned processes (a parted target's (part, format) packaging jobs);
``FreshPool`` is that pool open for more calls while it runs.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, wait
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


def in_fresh_processes(function: Callable[..., T], calls: list[tuple], names: list[str], width: int,
                       setup: Callable[[], None] | None = None, one_each: bool = False) -> list[T]:
    """``function(*args)`` for each ``args`` of ``calls`` in a ``FreshPool`` of up to ``width`` spawned processes;
    the results in the order of ``calls``. The first call to fail stops the rest and is raised here as its own type,
    its message led by its name in ``names`` (``FreshPool.results``)."""
    with FreshPool(width, setup, one_each) as pool:
        return pool.results(pool.add(function, calls, names))


class FreshPool:
    """Up to ``width`` spawned processes that take calls while they run: ``add`` queues calls (each handed to the pool
    only when a process is free for it, in the order added), ``results`` waits for the calls it is given and returns
    their results in that order. What one stage adds while the pool runs another's calls shares the same processes
    and the same admission (not used by the build yet: #43 means the drafter's packaging jobs to join the target's).
    ``setup``: a module-level function each process runs first; ``one_each``: a fresh process for every call, so
    that what one leaves in memory does not add to the next. The first call to fail stops the rest (those not
    started do not start, those running are waited for) and ``results`` raises it as its own type, its message led
    by its name (``named``); leaving the ``with`` on an error starts nothing more and waits for what runs."""

    def __init__(self, width: int, setup: Callable[[], None] | None = None, one_each: bool = False):
        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(width, mp_context=context, initializer=_setup, initargs=(os.getpid(), setup),
                                         max_tasks_per_child=1 if one_each else None)
        self._free = threading.Semaphore(width)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._running: set[Future] = set()
        self._lock = threading.Lock()
        self._failed: tuple[BaseException, str] | None = None
        self._stopped = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="fresh-pool", daemon=True)
        self._dispatcher.start()

    def __enter__(self) -> FreshPool:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:
            self._stopped = True
        self._queue.put(None)
        self._dispatcher.join()
        self._pool.shutdown(wait=True)

    def add(self, function: Callable[..., T], calls: list[tuple], names: list[str]) -> list[Future]:
        """Queue ``function(*args)`` for each ``args`` of ``calls``, named by ``names``; their tickets for
        ``results``."""
        tickets = [Future() for _ in calls]
        for args, name, ticket in zip(calls, names, tickets, strict=True):
            self._queue.put((function, args, name, ticket))
        return tickets

    def results(self, tickets: list[Future]) -> list:
        """The results of ``tickets`` in their order, once each has ended; the pool's first failure (any call's)
        raised named, once the calls running have ended."""
        wait(tickets)
        if self._failed is not None:
            with self._lock:
                running = set(self._running)
            wait(running)
            _raise_named(*self._failed)
        return [ticket.result() for ticket in tickets]

    def _dispatch(self) -> None:
        while (item := self._queue.get()) is not None:
            function, args, name, ticket = item
            self._free.acquire()  # a call is handed over only when a process can start it
            if self._failed is not None or self._stopped:
                self._free.release()
                ticket.set_exception(RuntimeError(f"{name}: not started (an earlier call failed)"))
                continue
            try:
                future = self._pool.submit(function, *args)
            except BrokenProcessPool as broken:
                self._failure(broken, name)
                self._free.release()
                ticket.set_exception(broken)
                continue
            with self._lock:
                self._running.add(future)
            future.add_done_callback(functools.partial(self._ended, name, ticket))

    def _ended(self, name: str, ticket: Future, future: Future) -> None:
        with self._lock:
            self._running.discard(future)
        error = future.exception()
        if error is None:
            ticket.set_result(future.result())
        else:
            self._failure(error, name)
            ticket.set_exception(error)
        self._free.release()

    def _failure(self, error: BaseException, name: str) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = (error, name)


def _raise_named(error: BaseException, name: str):
    if isinstance(error, BrokenProcessPool):
        raise RuntimeError(f"a process of the pool died while {name} or another call ran (killed, or out of memory: "
                           "see the system log); rerun the build, it resumes from the cache") from None
    raise named(error, name) from error


def _setup(parent: int, setup: Callable[[], None] | None) -> None:
    die_with_parent(parent)
    if setup is not None:
        setup()


def named(error: BaseException, name: str) -> BaseException:
    """``error`` again, its message led by ``name`` (the same type, so its exit code stays; a type that cannot be made
    from one message becomes a ``RuntimeError`` naming it)."""
    try:
        return type(error)(f"{name}: {error}")
    except Exception:  # noqa: BLE001 - any constructor that does not take one message
        return RuntimeError(f"{name}: {type(error).__name__}: {error}")


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
