"""Resolve a checkpoint reference to a pinned local snapshot, check it, and stream its tensors.

References: ``path:DIR`` (relative to the recipe file, or absolute) and ``hf://org/name@revision``
(a commit hash, 7 to 40 hex digits: a branch or tag is not a pin). Hub snapshots come from the
Hugging Face cache; a download is tried only when the pinned commit is not cached and
``HF_HUB_OFFLINE`` is not set. Weights are safetensors only (single file or sharded index), read
through memory maps; pickle checkpoints are refused and ``trust_remote_code`` is never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from convert.errors import InputError, SourceUnavailable

HF_PATTERN = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)@(?P<revision>[^@\s]+)$")
PINNED = re.compile(r"^[0-9a-f]{7,40}$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
LICENSE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE", "COPYING")
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class FileRecord:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint directory with the identity of where it came from."""

    reference: str
    directory: Path
    repo: str | None = None
    revision: str | None = None
    packed: Path | None = None  # the pre-quantized pack ``directory`` was unfolded from (convert/prism.py)

    @property
    def source(self) -> Path:
        """The files the reference names (the pack itself when ``directory`` is its unfolded form)."""
        return self.packed or self.directory

    def config(self) -> dict:
        return read_json(self.directory / "config.json")


def resolve(reference: str, recipe_dir: Path, field: str = "target.source") -> Snapshot:
    """The snapshot ``reference`` names; ``SourceUnavailable`` when it is well formed but not on this machine."""
    if reference.startswith("path:"):
        raw = Path(reference[len("path:") :]).expanduser()
        directory = raw if raw.is_absolute() else (recipe_dir / raw)
        directory = directory.resolve()
        if not directory.is_dir():
            raise SourceUnavailable(f"{field}: {reference!r}: directory {directory} does not exist")
        return Snapshot(reference=reference, directory=directory)
    match = HF_PATTERN.match(reference)
    if not match:
        raise InputError(f"{field}: {reference!r} is neither 'path:DIR' nor 'hf://org/name@revision'")
    repo, revision = match["repo"], match["revision"]
    if not PINNED.match(revision):
        raise InputError(f"{field}: {reference!r}: revision {revision!r} is not a commit hash; pin a commit")
    return Snapshot(reference=reference, directory=_hub_snapshot(repo, revision), repo=repo, revision=revision)


def _hub_snapshot(repo: str, revision: str) -> Path:
    from huggingface_hub import snapshot_download

    cache = hub_cache()
    cached = _cached_snapshot(cache, repo, revision)
    if cached is not None:
        return cached
    if hub_offline():
        raise SourceUnavailable(
            f"hf://{repo}@{revision} is not in the Hugging Face cache ({cache}) and "
            "HF_HUB_OFFLINE is set; download it on a machine with network first"
        )
    try:
        patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "LICENSE*", "NOTICE*"]
        path = Path(snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=patterns))
    except Exception as exc:  # network, auth or unknown revision: all are a user's input problem here
        raise SourceUnavailable(
            f"hf://{repo}@{revision} is not in the Hugging Face cache ({cache}) and could not be "
            f"downloaded ({type(exc).__name__}); check the repo and revision or populate the cache"
        ) from None
    if not path.name.startswith(revision):
        raise InputError(f"hf://{repo}@{revision} resolved to commit {path.name}, not the pinned one")
    return path


def _cached_snapshot(cache: Path, repo: str, revision: str) -> Path | None:
    """The cached snapshot whose full commit hash starts with ``revision`` (short hashes are allowed)."""
    snapshots = cache / ("models--" + repo.replace("/", "--")) / "snapshots"
    if not snapshots.is_dir():
        return None
    matches = sorted(p for p in snapshots.iterdir() if p.is_dir() and p.name.startswith(revision))
    if len(matches) > 1:
        raise InputError(f"hf://{repo}@{revision}: the short revision matches {len(matches)} cached commits")
    return matches[0] if matches else None


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise InputError(f"{path}: missing; a Hugging Face checkpoint needs it")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(directory: Path) -> list[FileRecord]:
    """Every file under ``directory`` (links followed, as in the HF cache), sorted by relative path."""
    records = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        records.append(FileRecord(rel, sha256_file(path), path.stat().st_size))
    return records


def license_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.upper().startswith(LICENSE_PREFIXES))


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the index when sharded; refuses pickle-only checkpoints."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise InputError(f"{index}: weight_map is empty")
        files = [directory / s for s in shards]
        for f in files:
            if not f.is_file():
                raise InputError(f"{index}: shard {f.name} is missing; re-download the checkpoint")
        return files
    single = directory / SAFETENSORS_SINGLE
    if single.is_file():
        return [single]
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if others:
        return [directory / n for n in others]
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InputError(
            f"{directory}: only pickle weights ({', '.join(pickles)}); spec-convert never unpickles (it can run "
            "arbitrary code): convert the checkpoint to safetensors first"
        )
    raise InputError(f"{directory}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}; the checkpoint has no weights")


def check_safetensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Validate a safetensors file's header against its size, without reading tensor data.

    Returns tensor name -> shape. A truncated or corrupt file is refused naming the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path}: truncated safetensors file ({size} bytes); re-download it")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise InputError(f"{path}: truncated safetensors header; re-download it")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InputError(f"{path}: corrupt safetensors header; re-download it") from None
    header.pop("__metadata__", None)
    data_end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + header_len + data_end > size:
        raise InputError(
            f"{path}: truncated: the header needs {8 + header_len + data_end} bytes, the file has {size}; "
            "re-download it"
        )
    return {name: tuple(v["shape"]) for name, v in header.items()}


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """All tensor names and shapes of the checkpoint (headers only; no weights are read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(directory):
        for name, shape in check_safetensors(path).items():
            if name in shapes:
                raise InputError(f"{path}: tensor {name!r} also appears in another shard")
            shapes[name] = shape
    return shapes


class CheckpointReader:
    """One tensor at a time from a (sharded) safetensors checkpoint: each read maps its shard, copies the tensor out
    and unmaps it again, so what a streamed stage holds is what it keeps, never the checkpoint's pages."""

    def __init__(self, directory: Path):
        self.files = {name: path for path in weight_files(directory) for name in check_safetensors(path)}

    def get(self, key: str) -> torch.Tensor:
        self._check_key(key)
        with safe_open(str(self.files[key]), framework="pt") as f:
            return f.get_tensor(key)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key``, reading only those."""
        self._check_key(key)
        with safe_open(str(self.files[key]), framework="pt") as f:
            return f.get_slice(key)[start:stop]

    def _check_key(self, key: str) -> None:
        if key not in self.files:
            raise InputError(f"checkpoint: tensor {key!r} is missing; the checkpoint does not match its config")


def load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Read every tensor through safetensors' memory map (no pickle, no copy of the whole file)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_cache() -> Path:
    """The hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"
