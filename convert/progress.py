"""Stage logging: what runs and how long it took, on stderr (stdout stays for results)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

console = Console(stderr=True, highlight=False)


@contextmanager
def stage(title: str) -> Iterator[None]:
    start = time.perf_counter()
    with console.status(f"{title} ..."):
        yield
    console.print(f"[green]\u2713[/green] {title} [dim]({time.perf_counter() - start:.1f} s)[/dim]")
