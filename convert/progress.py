"""Stage logging: what runs and how long it took, on stderr (stdout stays for results).

Two forms of the same events. On a terminal: a spinner while a stage runs (a bar with the count done, the time
elapsed and left for a stage of counted units), then one "✓ title (N s)" line; where the build's phases are known
(``phases``, ``convert/pipeline/build.py``) the spinner and the bar say which phase of how many runs. Anywhere else
(stderr to a file or a pipe: CI, nohup, ``> log``) and in worker processes (``live`` False): plain lines, each
stamped with the time elapsed since the command started (``[H:MM:SS]``): a line when a stage starts ("▶ title"), a
line per unit of work (layer, part, window, prompt) with the time elapsed and left, at most one every
``UNIT_SECONDS`` unless each unit is slower, the "✓" line when it ends, and a heartbeat ("still running title")
when no line came for ``HEARTBEAT_SECONDS`` (``$SPEC_CONVERT_HEARTBEAT`` seconds) while a stage runs, so a single
long unit still shows life: a log gets a line at least every 30 s of work.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True, highlight=False)
# a spinner while a stage runs; off in worker processes (convert/pipeline/packaging.py), which print lines only
live = True

HEARTBEAT_ENV = "SPEC_CONVERT_HEARTBEAT"
HEARTBEAT_SECONDS = 20.0  # below the 30 s a log may stay silent, with room for a busy interpreter's late wake-up
UNIT_SECONDS = 10.0  # in a log, a unit line at most this often (every unit when each takes longer)
CLOCK_ENV = "SPEC_CONVERT_LOG_START"  # the command's start (epoch seconds): stamps of spawned workers count from it

_clock = {"start": float(os.environ.get(CLOCK_ENV) or time.time())}
_state = threading.Condition()
_running: list[tuple[str, float]] = []  # the stages and step runs of this process now running: (title, start)
_last_line = [time.time()]
_heartbeat_pid = [0]
_status: list = []  # the spinners of the stages running now (a terminal)
_phases: dict = {"names": [], "at": 0, "since": 0.0, "pid": 0, "estimates": {}}
_counted: dict[str, tuple[float, float, float]] = {}  # a counted run's title -> (start, done, total): its time left


def _forked() -> None:
    """In a forked worker: a lock of its own (the parent's may have been held by a thread the fork did not copy) and
    none of the parent's stages (its heartbeat reports its own)."""
    global _state
    _state = threading.Condition()
    _running.clear()


os.register_at_fork(after_in_child=_forked)


def start_clock() -> None:
    """Stamps count from now (a command's start); processes this one spawns count from the same moment."""
    _clock["start"] = time.time()
    os.environ[CLOCK_ENV] = repr(_clock["start"])


def lines() -> bool:
    """Whether events print as plain stamped lines (a log, a worker process) rather than a live display."""
    return not (live and console.is_terminal)


def clock(seconds: float) -> str:
    """``seconds`` as H:MM:SS."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def span(seconds: float) -> str:
    """A duration for people: 42 s, 3 min 05 s, 2 h 07 min."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def heartbeat_seconds() -> float:
    try:
        return max(0.05, float(os.environ.get(HEARTBEAT_ENV) or HEARTBEAT_SECONDS))
    except ValueError:
        return HEARTBEAT_SECONDS


def line(text: str) -> None:
    """One stamped log line (markup allowed in ``text``); it resets the heartbeat's wait."""
    stamp = f"[dim]\\[{clock(time.time() - _clock['start'])}][/dim] "
    try:
        console.print(stamp + text, soft_wrap=True)
    except (ValueError, OSError):  # the stream was closed under a late heartbeat
        pass
    with _state:
        _last_line[0] = time.time()
        _state.notify_all()


def _heartbeat() -> None:
    """While a stage runs, or a build's phase between its stages: "still running" when no line came for
    ``heartbeat_seconds``."""
    while True:
        with _state:
            interval = heartbeat_seconds()
            wait = _last_line[0] + interval - time.time()
            between = _phases["at"] and _phases["pid"] == os.getpid()  # the build's process, not a forked worker
            if wait > 0 or not (_running or between):
                _state.wait(wait if wait > 0 else interval)
                continue
            title, start = _running[-1] if _running else (_where(), _phases["since"])
            left = _left(title)
        line(f"  still running {escape(title)} ({span(time.time() - start)} elapsed; {left})")


def _left(title: str) -> str:
    """The time left as a heartbeat can tell it: from the rate of the counted run ``title`` (units done so far), else
    from the running phase's estimate (the plan's), else that it is not known."""
    now = time.time()
    if title in _counted:
        start, done, total = _counted[title]
        if done:
            return f"about {span((now - start) / done * (total - done))} left in it ({int(done)}/{int(total)} done)"
    estimate = _phases["estimates"].get(_phases["names"][_phases["at"] - 1]) if _phases["at"] else None
    if estimate:
        spent = now - _phases["since"]
        return f"about {span(estimate - spent)} left in this phase by the plan's estimate" if spent < estimate \
            else f"past the plan's estimate of {span(estimate)} for this phase"
    return "time left not known: no counted units"


def _start_heartbeat() -> None:
    _heartbeat_pid[0] = os.getpid()
    threading.Thread(target=_heartbeat, name="spec-convert-heartbeat", daemon=True).start()


def _begin(title: str) -> None:
    if lines() and _heartbeat_pid[0] != os.getpid():  # a forked worker inherits no thread: one of its own
        _start_heartbeat()
    with _state:
        _running.append((title, time.time()))
        _state.notify_all()


def _end(title: str) -> None:
    with _state:
        _counted.pop(title, None)
        for i in range(len(_running) - 1, -1, -1):
            if _running[i][0] == title:
                del _running[i]
                break
        _state.notify_all()


@contextmanager
def phases(names: list[str], estimates: dict[str, float] | None = None) -> Iterator[None]:
    """The phases of a build, in order (``phase`` names the one running): the live display and the stage-start
    lines say "phase k/n name"; ``estimates``: a phase's estimated seconds (the plan's), from which a heartbeat outside
    any counted run says the time left."""
    before = dict(_phases)
    with _state:
        _phases.update(names=list(names), at=0, estimates=dict(estimates or {}))
    try:
        yield
    finally:
        with _state:
            _phases.update(before)


def phase(name: str) -> None:
    """The build's phase ``name`` (one of ``phases``' names) starts; in a log, the heartbeat names it between
    stages."""
    if lines() and _heartbeat_pid[0] != os.getpid():
        _start_heartbeat()
    if name in _phases["names"]:
        _phases.update(at=_phases["names"].index(name) + 1, since=time.time(), pid=os.getpid())


def _where() -> str:
    names, at = _phases["names"], _phases["at"]
    return f"phase {at}/{len(names)} {names[at - 1]}" if names and at else ""


def _overall() -> str:
    """A terminal's overall ETA: the phase count and the time left of the running phase and the ones after it by the
    plan's estimates (``phases``), where there are any."""
    names, at, estimates = _phases["names"], _phases["at"], _phases["estimates"]
    if not (names and at and estimates):
        return _where()
    current = estimates.get(names[at - 1], 0.0)
    left = max(0.0, current - (time.time() - _phases["since"])) + sum(estimates.get(n, 0.0) for n in names[at:])
    return _where() + (f", about {span(left)} left by the plan's estimate" if left >= 1 else "")


@contextmanager
def stage(title: str) -> Iterator[None]:
    start = time.perf_counter()
    where = _where()
    _begin(title)
    try:
        if not lines():
            overall = _overall()
            with console.status(f"[dim]\\[{overall}][/dim] {title} ..." if overall else f"{title} ...") as status:
                _status.append(status)
                try:
                    yield
                finally:
                    _status.remove(status)
        else:
            line(f"\u25b6 {escape(title)}" + (f" [dim]({where})[/dim]" if where else ""))
            yield
    finally:
        _end(title)
    _done(title, start)


def _done(title: str, start: float) -> None:
    text = f"[green]\u2713[/green] {title} [dim]({time.perf_counter() - start:.1f} s)[/dim]"
    if lines():
        line(text)
    else:
        console.print(text)


class _Lines:
    """``bar``'s stand-in in a log: ``add_task`` prints the start line, ``advance`` a unit line at most every
    ``UNIT_SECONDS`` (every unit when each takes longer) with the count, the time elapsed and the time left."""

    def __init__(self):
        self.tasks: list[dict] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for task in self.tasks:
            _end(task["title"])
        self.tasks.clear()

    def add_task(self, description: str, total: float | None = None, what: str = "", **_) -> int:
        title = f"{description}: {int(total)} {what}".rstrip() if total is not None else description
        _begin(title)
        where = _where()
        line(f"\u25b6 {escape(title)}" + (f" [dim]({where})[/dim]" if where else ""))
        self.tasks.append({"title": title, "description": description, "total": total, "done": 0,
                           "what": what, "start": time.time()})
        return len(self.tasks) - 1

    def advance(self, task_id: int, advance: float = 1) -> None:
        task = self.tasks[task_id]
        task["done"] += advance
        _unit(task["description"], task["done"], task["total"], task["what"], task["start"], key=task["title"])


def _unit(title: str, done: float, total: float | None, what: str, start: float, key: str | None = None) -> None:
    """A unit line in a log: the count done, the time elapsed and left; none within ``UNIT_SECONDS`` of the last line,
    none for the last unit (the end line follows). The count is kept for the heartbeat's time left, under ``key`` (the
    running title; default ``title``)."""
    now = time.time()
    if total is not None:
        with _state:
            _counted[key or title] = (start, done, total)
    if total is None or done >= total or now - _last_line[0] < UNIT_SECONDS:
        return
    elapsed = now - start
    left = elapsed / done * (total - done) if done else 0.0
    line(f"  {escape(title)}: {int(done)}/{int(total)} {what}, {span(elapsed)} elapsed, about {span(left)} left")


def units(total: int, what: str) -> Callable[[], None]:
    """``advance()`` for the units of work (prompts, calls, parts) of the stage running now: in a log a unit line
    (``_unit``), on a terminal the count on the stage's spinner."""
    title = _running[-1][0] if _running else what
    start, done = time.time(), [0]

    def advance() -> None:
        done[0] += 1
        if lines():
            _unit(title, done[0], total, what, start)
        elif _status:
            overall = _overall()
            _status[-1].update((f"[dim]\\[{overall}][/dim] " if overall else "") + f"{title} ... {done[0]}/{total} "
                               f"{what}")

    return advance


def bar(enabled: bool = True):
    """A progress bar with the count done, the time elapsed and the time left (transient: the stage line stays); in a
    log (``lines``) a start line and unit lines instead (``_Lines``)."""
    if enabled and lines():
        return _Lines()
    overall = _overall()
    description = f"[dim]\\[{overall}][/dim] " + "{task.description}" if overall else "{task.description}"
    return Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), console=console, transient=True,
                    disable=not (enabled and live))


@contextmanager
def steps(title: str, total: int, what: str = "steps") -> Iterator[Callable[[], None]]:
    """A stage of ``total`` steps with a bar (count, elapsed, time left); yields ``advance()``. Ends with the stage
    line, as ``stage`` does. In a log: a start line, unit lines (``_Lines``), the end line."""
    start = time.perf_counter()
    with bar() as progress:
        if isinstance(progress, _Lines):
            task = progress.add_task(title, total=total, what=what)
        else:
            task = progress.add_task(title, total=total)
            _begin(title)
        try:
            yield lambda: progress.advance(task)
        finally:
            _end(title)
    _done(f"{title}: {total} {what}", start)
