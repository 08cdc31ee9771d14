"""Calls for a pool of spawned processes (tests/test_processes.py): a module of few imports, which each process
imports again."""

import os
import time
from pathlib import Path

from convert.errors import InputError


def slept(seconds: float, value: int) -> tuple[int, int, float, float]:
    start = time.time()
    time.sleep(seconds)
    return value, os.getpid(), start, time.time()


def refuse_or_mark(name: str, marker: str) -> None:
    if name == "head":
        raise InputError(f"{name}: refused")
    Path(marker, name).write_text(name)


def held(seconds: float, folder: str, name: str) -> None:
    """Sleeps holding ``folder/name`` (a temporary of its own, removed as a ``with`` block would on the way out)."""
    temporary = Path(folder, name)
    temporary.mkdir()
    try:
        time.sleep(seconds)
    finally:
        temporary.rmdir()
