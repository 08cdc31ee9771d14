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
