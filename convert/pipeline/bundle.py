"""Atomic publish: a bundle is built in a hidden directory beside its destination and renamed into place.

A failed or interrupted build leaves no directory that looks like a bundle (the staging directory is
hidden and removed on any exception), and a good bundle already at the destination is replaced only
once the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from convert.errors import InputError, field_name, quote
from manifests.identity import file_sha256
from manifests.schema import SCHEMA_VERSION, DrafterManifest, Manifest

MANIFEST = "manifest.json"
COMPILED = "compiled"  # where a bundle's compile steps write their outputs (``CompileStep.outputs``: relative to it)

MANIFEST_BYTES_LIMIT = 64 * 2**20  # a 27B parted target's manifest is well under 1 MB


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
    tmp = output.parent / f".{output.name}.partial-{os.getpid()}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as error:  # a file where a folder must be, no permission, a read-only file system
        blocking = next((p for p in output.parents if p.exists()), None)
        why = f"{blocking} is a file, not a folder" if blocking is not None and not blocking.is_dir() else \
            f"{error.strerror}: {error.filename}"
        raise InputError(f"output {output}: cannot be written there ({why}); choose another --output (nothing was "
                         "built)") from None
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


def file_entry(bundle: Path, path: Path) -> dict:
    """``path`` as a manifest's ``FileEntry``: relative to ``bundle`` ('/'-separated), its sha256 and size."""
    return {"path": path.relative_to(bundle).as_posix(), "sha256": file_sha256(path), "size": path.stat().st_size}


def compiled_files(bundle: Path, outputs: list[str]) -> list[dict]:
    """Every file of a compile step's ``outputs`` (relative to the bundle's ``compiled/``; a folder's files
    recursively) as a ``FileEntry`` relative to ``bundle``, sorted: what ``CompileStep.files`` records."""
    found = set()
    for output in outputs:
        path = bundle / COMPILED / output
        found.update([path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()))
    return [file_entry(bundle, path) for path in sorted(found)]


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_manifest(bundle: Path) -> Manifest | DrafterManifest:
    """A target or drafter bundle's manifest (by its ``kind``), validated against the schema before anything reads
    it; every way it can be damaged (not UTF-8, not JSON, nested past the parser, off the schema) is one InputError
    naming the file and the field."""
    path = bundle / MANIFEST
    try:
        found = path.is_file()
    except OSError as exc:  # a name too long for this file system
        raise InputError(f"{quote(str(bundle), 120)}: not a bundle ({exc.strerror})") from None
    if not found:
        parts = [d.name for d in (bundle / "target", bundle / "drafter") if (d / MANIFEST).is_file()]
        hint = f" (it holds {' and '.join(f'{p}/' for p in parts)}: name one)" if parts else ""
        raise InputError(f"{bundle}: no {MANIFEST}; not a spec-convert bundle{hint}")
    damaged = "the manifest is damaged; rebuild the bundle or copy it again"
    try:
        if path.stat().st_size > MANIFEST_BYTES_LIMIT:
            raise InputError(f"{path}: {path.stat().st_size:,} bytes, over the {MANIFEST_BYTES_LIMIT:,} a manifest "
                             f"takes; {damaged}")
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text)
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}); {damaged}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); {damaged}") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply for a manifest; {damaged}") from None
    except ValueError as exc:  # an int of over 4300 digits
        raise InputError(f"{path}: not JSON ({str(exc).split(':')[0][:120]}); {damaged}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a manifest is a JSON object, this is {quote(data, 60)}; {damaged}")
    model = DrafterManifest if data.get("kind") == "drafter" else Manifest
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        got = "" if err["type"] in ("extra_forbidden", "missing") or isinstance(err.get("input"), dict | list) \
            else f" (got {quote(err.get('input'), 80)})"
        message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise InputError(f"{path}: {field_name(err['loc']) or 'manifest'}: {message}{got} (the manifest does not "
                         f"match schema version {SCHEMA_VERSION}; rebuild the bundle)") from None
