"""Stage logging: what runs and how long it took, on stderr (stdout stays for results)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True, highlight=False)
# a spinner while a stage runs; off in worker processes (convert/pipeline/packaging.py), which print lines only
live = True


@contextmanager
def stage(title: str) -> Iterator[None]:
    start = time.perf_counter()
    if live:
        with console.status(f"{title} ..."):
            yield
    else:
        yield
    _done(title, start)


def _done(title: str, start: float) -> None:
    console.print(f"[green]\u2713[/green] {title} [dim]({time.perf_counter() - start:.1f} s)[/dim]")


def bar(enabled: bool = True) -> Progress:
    """A progress bar with the count done, the time elapsed and the time left (transient: the stage line stays)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), console=console, transient=True,
                    disable=not (enabled and live))


@contextmanager
def steps(title: str, total: int, what: str = "steps") -> Iterator:
    """A stage of ``total`` steps with a bar (count, elapsed, time left); yields ``advance()``. Ends with the stage
    line, as ``stage`` does."""
    start = time.perf_counter()
    with bar() as progress:
        task = progress.add_task(title, total=total)
        yield lambda: progress.advance(task)
    _done(f"{title}: {total} {what}", start)
