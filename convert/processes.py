"""Stages run in a fresh process, so that what one stage leaves in memory does not add to the next.

A build larger than host memory streams every stage, but one process that runs them all keeps gigabytes it no longer
uses between stages (measured over a 28-layer build at the 27B width: 7.6-10.4 GiB resident between parts, none of
them loaded; docs/benchmarks.md "A build larger than memory"). A stage run by ``in_fresh_process`` starts from a
fresh interpreter (``spawn``: nothing of the parent is inherited, the Core AI runtime's threads included) and gives
everything back when it ends; the build process keeps only what the stages return. ``in_fresh_processes`` runs
several such calls at once in a pool of spawned processes (a parted target's (part, format) packaging jobs);
``InBackground`` drives such a pool from a thread while this one goes on (the drafter stage on an accelerator).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
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


STOP_POLL_SECONDS = 1.0
"""How often a pool that can be stopped (``in_fresh_processes``' ``stop``) looks at its event."""

STOP_GRACE_SECONDS = 20.0
"""How long a stopped pool's running calls have to unwind (their temporary folders removed) before they are killed."""


class Stopped(RuntimeError):
    """A pool stopped by its ``stop`` event (``InBackground.stop``): its running calls were ended."""


def in_fresh_processes(function: Callable[..., T], calls: list[tuple], names: list[str], width: int,
                       setup: Callable[[], None] | None = None, one_each: bool = False,
                       stop: threading.Event | None = None) -> list[T]:
    """``function(*args)`` for each ``args`` of ``calls`` in up to ``width`` spawned processes at once, started in the
    order of ``calls`` (each handed to the pool only when a process is free for it); the results in that order.
    ``setup``: a module-level function each process runs first; ``one_each``: a fresh process for every call, so that
    what one leaves in memory does not add to the next. The first call to fail stops the rest (those not started do
    not start, those running are waited for) and is raised here as its own type, its message led by its name in
    ``names`` (``named``). ``stop``: once set, no call starts, the running ones are ended (``_end``) and ``Stopped``
    is raised (looked at every ``STOP_POLL_SECONDS``)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(width, mp_context=context, initializer=_setup, initargs=(os.getpid(), setup),
                             max_tasks_per_child=1 if one_each else None) as pool:
        futures: list = []
        running: set = set()
        while len(futures) < len(calls) or running:
            if stop is not None and stop.is_set():
                _end(pool, running)
                raise Stopped(f"stopped with {len(calls) - len(futures) + len(running)} of {len(calls)} calls not done")
            while len(futures) < len(calls) and len(running) < width:  # a call is handed over only when one can start
                futures.append(pool.submit(function, *calls[len(futures)]))
                running.add(futures[-1])
            finished, running = wait(running, None if stop is None else STOP_POLL_SECONDS, FIRST_COMPLETED)
            failed = next((f for f in futures if f in finished and f.exception() is not None), None)
            if failed is not None:
                wait(running)
                _raise_named(failed.exception(), names[futures.index(failed)])
        return [future.result() for future in futures]


def _end(pool: ProcessPoolExecutor, running: set) -> None:
    """End a pool's running calls: each process is asked to stop (SIGTERM, which its ``_setup`` made a
    ``SystemExit`` in the call, so that its ``with`` blocks remove their temporary folders), and those still running
    after ``STOP_GRACE_SECONDS`` (in a converter's native code, say) are killed. The executor has no public way to
    reach its processes before Python 3.14's ``terminate_workers``."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.terminate()
    wait(running, STOP_GRACE_SECONDS)
    for process in processes:
        if process.is_alive():
            process.kill()


class InBackground:
    """``function(*args, stop=event)`` (``in_fresh_processes`` underneath, which honours ``stop``) in a thread beside
    this one: ``result`` waits for it and returns its value or raises its error; ``stop`` sets its event and waits for
    the thread to end (its pool's running calls ended, ``_end``; no error of its own raised); a no-op once ended."""

    def __init__(self, function: Callable[..., T], *args):
        self._stop, self._value, self._error = threading.Event(), None, None
        self._thread = threading.Thread(target=self._run, args=(function, args), daemon=True)
        self._thread.start()

    def _run(self, function, args) -> None:
        try:
            self._value = function(*args, stop=self._stop)
        except BaseException as error:  # noqa: BLE001 - raised in the waiting thread by ``result``
            self._error = error

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _raise_named(error: BaseException, name: str):
    if isinstance(error, BrokenProcessPool):
        raise RuntimeError(f"a process of the pool died while {name} or another call ran (killed, or out of memory: "
                           "see the system log); rerun the build, it resumes from the cache") from None
    raise named(error, name) from error


def _setup(parent: int, setup: Callable[[], None] | None) -> None:
    import signal

    die_with_parent(parent)
    signal.signal(signal.SIGTERM, _stopped)
    if setup is not None:
        setup()


def _stopped(signum, _frame) -> None:
    """A pool process asked to stop (``_end``): the call unwinds as on an exit."""
    raise SystemExit(128 + signum)


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
