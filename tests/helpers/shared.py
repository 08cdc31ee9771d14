"""Bundles built once per test session and read by every module that needs the same one.

Under pytest-xdist each worker is its own process with its own session, so a session fixture alone would build a
shared bundle once per worker. ``built_once`` builds it in the directory the workers share, under a file lock: the
first worker to ask builds it, the others wait for it and read it. Tests copy a shared bundle before changing it."""

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

DONE = ".built"


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's base temporary directory; under xdist, the one the workers' own directories sit in."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, key: str, make: Callable[[Path], None]) -> Path:
    """``shared_root / key``, filled by ``make(folder)`` the first time any worker asks for it. ``make`` runs with
    ``SPEC_CONVERT_CACHE`` set to ``folder / "cache"``, so a test may rebuild on the same build cache from any
    worker. A ``make`` that raises leaves no marker: every worker that asks fails the same way."""
    root = shared_root(tmp_path_factory)
    folder = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (folder / DONE).exists():
                folder.mkdir(exist_ok=True)
                with pytest.MonkeyPatch.context() as patch:
                    patch.setenv("SPEC_CONVERT_CACHE", str(folder / "cache"))
                    make(folder)
                (folder / DONE).write_text("")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder
