"""The build cache: the results of expensive stages (a layer's quantized weights, a converted package) kept on disk
under a key of everything they were computed from, so an interrupted build resumes and an unchanged one is reused.

A key is the sha256 of a JSON record of the stage's inputs: content hashes of the source files, the recipe fields
that matter, the calibration identity, the device kind, the toolchain's versions and the sha256 of the code that
computes the stage (``code_fingerprint``: a cache entry never outlives the quantizer that wrote it). Keys chain
where results depend on earlier ones (layer ``i``'s GPTQ inputs come from layers ``0..i-1``), so a key names the
whole history.

An entry is a directory ``<stage>/<key[:2]>/<key>/`` with the payload files and ``entry.json`` (the sha256 and
size of every payload file plus the stage's metadata), written last, through a temporary directory renamed into
place: a build killed while writing leaves at most a hidden temporary directory (removed when that entry is next
written), never an entry. Reading checks every payload file against ``entry.json``; a mismatch is reported, the
entry removed, and the stage recomputed.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from convert.paths import default_cache
from convert.progress import console
from manifests import identity

ENTRY = "entry.json"
OBJECT_FILE = "object.pt"  # the payload of an entry ``BuildCache.put_object`` stores
PROJECT_PACKAGES = ("convert", "quant", "manifests")



def key(record: dict) -> str:
    """The sha256 of a JSON record (sorted keys: the same inputs give the same key on every machine)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def code_fingerprint(modules: Iterable[str]) -> str:
    """sha256 over the source of the named Python modules and of every project module they import
    (``project_imports``): a key that includes it changes with any code its stage runs, not only the named files."""
    digest = hashlib.sha256()
    for name in project_imports(modules):
        digest.update(name.encode())
        digest.update(module_source(name).encode())
    return digest.hexdigest()


def module_source(name: str) -> str:
    """The source text of module ``name`` (its file, read without importing it)."""
    return Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8")


def project_imports(roots: Iterable[str]) -> list[str]:
    """``roots`` and every module of this project (``PROJECT_PACKAGES``) they import, transitively, sorted: import
    statements anywhere in a module (function bodies too), and the packages whose ``__init__`` an import runs."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages' __init__
        spec = importlib.util.find_spec(name)
        package = name if spec.submodule_search_locations is not None else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(module_source(name))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
                found = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            todo += [m for m in found if m.split(".")[0] in PROJECT_PACKAGES and _is_module(m)]
    return sorted(seen)


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module (``from convert.x import f`` names ``convert.x.f``, which is not)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def versions(packages: Iterable[str]) -> dict[str, str]:
    """The installed version of each distribution (``absent`` when it is not installed: run from a source tree)."""
    from importlib import metadata

    found = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


@dataclass
class Entry:
    directory: Path
    meta: dict

    def path(self, name: str) -> Path:
        return self.directory / name


class BuildCache:
    """Entries by stage and key under ``root``; ``enabled=False`` (``--no-cache``) reads and writes nothing.

    ``hits`` / ``misses`` / ``corrupt`` count lookups by stage (the resume tests and the build log read them)."""

    def __init__(self, root: Path | None = None, enabled: bool = True):
        self.root = Path(root) if root is not None else default_cache()
        self.enabled = enabled
        self.hits: dict[str, int] = {}
        self.misses: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}

    def _directory(self, stage: str, entry_key: str) -> Path:
        return self.root / stage / entry_key[:2] / entry_key

    def get(self, stage: str, entry_key: str) -> Entry | None:
        """The verified entry, or None (absent, disabled, or corrupt: then removed and counted)."""
        if not self.enabled:
            return None
        directory = self._directory(stage, entry_key)
        record = directory / ENTRY
        if not record.is_file():
            self.misses[stage] = self.misses.get(stage, 0) + 1
            return None
        problem = _verify(directory, record)
        if problem:
            console.print(f"[yellow]cache:[/yellow] {stage} entry {entry_key[:12]} is corrupt ({problem}); "
                          "recomputing it")
            shutil.rmtree(directory, ignore_errors=True)
            self.corrupt[stage] = self.corrupt.get(stage, 0) + 1
            self.misses[stage] = self.misses.get(stage, 0) + 1
            return None
        self.hits[stage] = self.hits.get(stage, 0) + 1
        return Entry(directory, json.loads(record.read_text())["meta"])

    def put(self, stage: str, entry_key: str, write: Callable[[Path], dict]) -> Entry | None:
        """Store what ``write(directory)`` writes there (it returns the entry's metadata); atomic. Returns the entry
        (None when disabled)."""
        if not self.enabled:
            return None
        final = self._directory(stage, entry_key)
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(f".{entry_key}.tmp-*"):  # left by a build killed while writing this entry
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".{entry_key}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            meta = write(tmp)
            files = {p.relative_to(tmp).as_posix(): _file_record(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
            (tmp / ENTRY).write_text(json.dumps({"files": files, "meta": meta}, indent=1))  # meta in its order
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Entry(final, meta)

    def put_object(self, stage: str, entry_key: str, value, meta: dict) -> None:
        """Store ``value`` (tensors, numpy arrays, plain containers: pickled by ``torch.save``) as an entry's one
        payload, with ``meta``; atomic, as ``put``."""
        import torch

        def write(directory: Path) -> dict:
            torch.save(value, directory / OBJECT_FILE)
            return meta

        self.put(stage, entry_key, write)

    def get_object(self, stage: str, entry_key: str, mmap: bool = False):
        """What ``put_object`` stored under the key, or None; with ``mmap`` its tensors are mapped from the entry's
        file rather than read into memory."""
        import torch

        entry = self.get(stage, entry_key)
        return None if entry is None else torch.load(entry.path(OBJECT_FILE), mmap=mmap, weights_only=False)

    def remove(self, stage: str, entry_key: str) -> None:
        """Drop an entry that is no longer needed (absent: nothing to do)."""
        if self.enabled:
            shutil.rmtree(self._directory(stage, entry_key), ignore_errors=True)

    def summary(self) -> str:
        stages = sorted(set(self.hits) | set(self.misses))
        parts = [f"{s}: {self.hits.get(s, 0)} reused, {self.misses.get(s, 0)} computed"
                 + (f" ({self.corrupt[s]} corrupt entries recomputed)" if self.corrupt.get(s) else "")
                 for s in stages]
        return f"cache {self.root}: " + "; ".join(parts) if parts else f"cache {self.root}: nothing looked up"


def _file_record(path: Path) -> dict:
    return {"sha256": identity.file_sha256(path), "size": path.stat().st_size}


def _verify(directory: Path, record: Path) -> str | None:
    try:
        files = json.loads(record.read_text())["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
        return f"{ENTRY} unreadable"
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} - {ENTRY}
    if present != set(files):
        return f"files {sorted(present ^ set(files))[:3]} differ from {ENTRY}"
    for name, expected in files.items():
        if _file_record(directory / name) != expected:
            return f"{name} does not match its recorded sha256"
    return None
