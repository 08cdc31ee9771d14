"""Stage logging: what runs and how long it took, on stderr (stdout stays for results)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

console = Console(stderr=True, highlight=False)
live = True  # a spinner while a stage runs; off in worker processes (convert/packaging.py), which print lines only


@contextmanager
def stage(title: str) -> Iterator[None]:
    start = time.perf_counter()
    if live:
        with console.status(f"{title} ..."):
            yield
    else:
        yield
    console.print(f"[green]\u2713[/green] {title} [dim]({time.perf_counter() - start:.1f} s)[/dim]")
