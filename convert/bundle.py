"""Atomic publish: a bundle is built in a hidden directory beside its destination and renamed into place.

A failed or interrupted build leaves no directory that looks like a bundle (the staging directory is
hidden and removed on any exception), and a good bundle already at the destination is replaced only
once the new one is complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from convert.errors import InputError

MANIFEST = "manifest.json"


def is_bundle(path: Path) -> bool:
    """A target or drafter bundle, or a pair (``target/`` and ``drafter/``)."""
    return (path / MANIFEST).is_file() or (path / "target" / MANIFEST).is_file()


def parts(path: Path) -> list[Path]:
    """The bundles at ``path``: itself, or a pair's ``target/`` and ``drafter/``."""
    if not (path / MANIFEST).is_file() and (path / "target" / MANIFEST).is_file():
        return [d for d in (path / "target", path / "drafter") if (d / MANIFEST).is_file()]
    return [path]


def check_destination(output: Path) -> None:
    """Refuse to replace a directory that is not a bundle (it may hold someone's files)."""
    if output.exists() and not is_bundle(output) and (not output.is_dir() or any(output.iterdir())):
        raise InputError(f"output {output}: exists and is not a spec-convert bundle; choose another --output")


@contextmanager
def staging(output: Path) -> Iterator[Path]:
    output = output.resolve()
    check_destination(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, output)


def publish(tmp: Path, output: Path) -> None:
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    if output.exists():
        os.rename(output, old)
    os.rename(tmp, output)
    shutil.rmtree(old, ignore_errors=True)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
