"""Resolve a checkpoint reference to a pinned local snapshot, check it, and stream its tensors.

References: ``path:DIR`` (relative to the recipe file, or absolute) and ``hf://org/name@revision``
(a commit hash, 7 to 40 hex digits: a branch or tag is not a pin). Hub snapshots come from the
Hugging Face cache; a download is tried only when the pinned commit is not cached and
``HF_HUB_OFFLINE`` is not set. Within ``headers_only()`` (``build --dry-run``) nothing is downloaded but
the repo's small files (config, tokenizer, index, licenses) and each safetensors file's header (HTTP range
requests): the weights are stood for by stubs that hold the header alone (``HEADERS_MARKER``). Weights are
safetensors only (single file or sharded index), read through memory maps; pickle checkpoints are refused
and ``trust_remote_code`` is never used.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from convert.errors import InputError, SourceUnavailable, quote
from manifests import identity

HF_PATTERN = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)@(?P<revision>[^@\s]+)$")
PINNED = re.compile(r"^[0-9a-f]{7,40}$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
LICENSE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE", "COPYING")
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
HUB_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "LICENSE*", "NOTICE*")  # what a build downloads
# A headers-only snapshot's record (a dot file: ``file_records`` skips it): each weight file's size on the hub, for
# which its stub (the 8-byte length and the header, the data left out) stands.
HEADERS_MARKER = ".headers-only.json"
_HEADERS_INTO: ContextVar[Path | None] = ContextVar("headers_into", default=None)


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
    packed: Path | None = None  # the pre-quantized pack ``directory`` was unfolded from (convert/inputs/prism.py)

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
        if re.match(r"^hf://[\w.-]+/[\w.-]+$", reference):
            raise InputError(f"{field}: {reference!r} has no revision; append @<commit hash> (the commit to build, "
                             "7 to 40 hex digits, from the repo's history on the hub): a build is pinned to one commit")
        raise InputError(f"{field}: {reference!r} is neither 'path:DIR' nor 'hf://org/name@revision'")
    repo, revision = match["repo"], match["revision"]
    if not PINNED.match(revision):
        raise InputError(f"{field}: {reference!r}: revision {revision!r} is not a commit hash; pin a commit")
    headers_into = _HEADERS_INTO.get()
    directory = _hub_snapshot(repo, revision) if headers_into is None else _hub_headers(repo, revision, headers_into)
    return Snapshot(reference=reference, directory=directory, repo=repo, revision=revision)


@contextmanager
def headers_only() -> Iterator[Path]:
    """Within it ``resolve`` reads an uncached ``hf://`` reference's small files and safetensors headers only, into a
    temporary directory that lives as long as the context (``_hub_headers``): what ``build --dry-run`` plans from.
    A snapshot already in the Hugging Face cache is used as it is."""
    with tempfile.TemporaryDirectory(prefix="spec-convert-headers-") as scratch:
        token = _HEADERS_INTO.set(Path(scratch))
        try:
            yield Path(scratch)
        finally:
            _HEADERS_INTO.reset(token)


def _hub_headers(repo: str, revision: str, root: Path) -> Path:
    """The pinned commit from the Hugging Face cache, else a headers-only snapshot of it in ``root``: the files a build
    would download (``HUB_PATTERNS``) but the weights, and for each ``*.safetensors`` file a stub of its 8-byte length
    and header (read with HTTP range requests, ``parse_safetensors_file_metadata``), its size on the hub recorded in
    ``HEADERS_MARKER``. No weight is downloaded."""
    import huggingface_hub as hub

    cache = hub_cache()
    cached = _cached_snapshot(cache, repo, revision)
    if cached is not None:
        return cached
    directory = root / repo.replace("/", "--") / revision
    if (directory / HEADERS_MARKER).is_file():  # the same reference twice (an MTP head in its target's snapshot)
        return directory
    if hub_offline():
        raise SourceUnavailable(
            f"hf://{repo}@{revision} is not in the Hugging Face cache ({cache}) and "
            "HF_HUB_OFFLINE is set; download it on a machine with network first"
        )
    try:
        info = hub.model_info(repo, revision=revision, files_metadata=True)
        commit = info.sha or ""
        files = {s.rfilename: s.size for s in info.siblings or []
                 if any(fnmatch.fnmatch(s.rfilename, p) for p in HUB_PATTERNS)}
        if commit.startswith(revision):
            for name in sorted(n for n in files if not n.endswith(".safetensors")):
                hub.hf_hub_download(repo, name, revision=commit, local_dir=directory)
            sizes = {name: _write_stub(directory / name, hub.parse_safetensors_file_metadata(
                repo, name, revision=commit), size) for name, size in sorted(files.items())
                if name.endswith(".safetensors")}
    except InputError:
        raise
    except Exception as exc:  # network, auth or unknown revision: all are a user's input problem here
        raise SourceUnavailable(
            f"hf://{repo}@{revision} is not in the Hugging Face cache ({cache}) and its config and safetensors "
            f"headers could not be read from the hub ({type(exc).__name__}); check the repo and revision or populate "
            "the cache"
        ) from None
    if not commit.startswith(revision):
        raise InputError(f"hf://{repo}@{revision} resolved to commit {commit or '?'}, not the pinned one")
    (directory / HEADERS_MARKER).write_text(json.dumps({"repo": repo, "revision": commit, "sizes": sizes}))
    return directory


def _write_stub(path: Path, metadata, size: int | None) -> int:
    """A safetensors file's stub: its 8-byte length and its header (rebuilt from the hub's parse of it, padded with
    spaces to the original's length as the format pads), no data; returns the file's size on the hub."""
    header: dict = {name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
                    for name, t in metadata.tensors.items()}
    if metadata.metadata:
        header = {"__metadata__": dict(metadata.metadata), **header}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    end = max((t.data_offsets[1] for t in metadata.tensors.values()), default=0)
    if size is not None and size - 8 - end >= len(raw):
        raw += b" " * (size - 8 - end - len(raw))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return 8 + len(raw) + end


def headers_record(directory: Path) -> dict | None:
    """A headers-only snapshot's record (``HEADERS_MARKER``), or None for a snapshot with its weights."""
    marker = Path(directory) / HEADERS_MARKER
    return read_json(marker) if marker.is_file() else None


def refuse_headers_only(directory: Path) -> None:
    """Weights are never read from a headers-only snapshot (its stubs hold no data; only a dry run makes one)."""
    if headers_record(directory) is not None:
        raise InputError(f"{directory}: a headers-only snapshot (build --dry-run's); its weights were not downloaded")


def stored_size(path: Path) -> int:
    """A weight file's size: in a headers-only snapshot its stub stands for the file on the hub."""
    record = headers_record(path.parent)
    if record is not None and path.name in record.get("sizes", {}):
        return int(record["sizes"][path.name])
    return path.stat().st_size


def weight_bytes(directory: Path) -> int:
    """The bytes of a checkpoint's ``*.safetensors`` files (a headers-only snapshot's as on the hub)."""
    return sum(stored_size(p) for p in Path(directory).glob("*.safetensors"))


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
    """A JSON object file (config.json, an index, hadamard.json); anything else is refused naming the file."""
    if not path.is_file():
        raise InputError(f"{path}: missing; a Hugging Face checkpoint needs it")
    try:
        value = json.loads(path.read_text())
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to read; re-download or fix the file") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise InputError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: holds a JSON {type(value).__name__}, not an object; re-download or fix the file")
    return value


def file_records(directory: Path) -> list[FileRecord]:
    """Every file under ``directory`` (links followed, as in the HF cache), sorted by relative path."""
    records = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        records.append(FileRecord(rel, identity.file_sha256(path), path.stat().st_size))
    return records


def license_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.upper().startswith(LICENSE_PREFIXES))


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the index when sharded; refuses pickle-only checkpoints."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        files = [_shard_path(directory, index, shard) for shard in sorted(set(_weight_map(index).values()))]
        if not files:
            raise InputError(f"{index}: weight_map is empty; re-download the checkpoint")
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


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise InputError(f"{index}: weight_map is {_value(weight_map)}; expected an object of tensor name -> shard "
                         "file; re-download the checkpoint")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise InputError(f"{index}: weight_map[{_name(name)}] is {_value(shard)}; expected a shard file name; "
                             "re-download the checkpoint")
    return weight_map


def _shard_path(directory: Path, index: Path, shard: str) -> Path:
    """A shard the index names, inside the checkpoint: a relative path without ``..``, in a directory that resolves
    under the checkpoint's (the file itself may be a link, as the Hugging Face cache's are, into its blobs)."""
    parts = shard.replace("\\", "/").split("/")
    inside = shard and not Path(shard).is_absolute() and not shard.startswith(("/", "\\")) and ".." not in parts
    path = directory / shard
    if inside:
        try:
            path.parent.resolve().relative_to(directory.resolve())
        except ValueError:
            inside = False
    if not inside:
        raise InputError(f"{index}: shard {_value(shard)} is outside the checkpoint directory; shard paths must stay "
                         "inside it")
    if not shard.endswith(".safetensors"):
        raise InputError(f"{index}: shard {_value(shard)} is not a .safetensors file; spec-convert reads safetensors "
                         "only")
    return path


# The safetensors format's dtypes and their sizes in bits (safetensors/src/tensor.rs, Dtype::bitsize).
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
                    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses a larger header
USIZE = 2**64  # the format's sizes and offsets are 64-bit
TENSOR_FIELDS = {"dtype", "shape", "data_offsets"}
REDOWNLOAD = "re-download or re-save the checkpoint"
NAME_LIMIT, VALUE_LIMIT = 100, 80  # characters of a quoted tensor name / header value in an error


def _unique_object(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise _DuplicateKey(duplicate)
    return dict(pairs)


class _DuplicateKey(ValueError):
    pass


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def check_safetensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Validate a safetensors file's header fully (the format's rules, as the safetensors library applies them),
    without reading tensor data: the header is a JSON object of unique keys; each tensor has exactly dtype, shape and
    data_offsets, a known dtype, a shape of non-negative integers and offsets that hold exactly its bytes; the
    tensors cover the data from 0 to the end of the file with no gap, overlap or trailing byte; ``__metadata__``
    maps strings to strings. Returns tensor name -> shape; anything else is refused naming the file (and the tensor).
    A headers-only snapshot's stub is checked as the file of the size it stands for (``stored_size``).
    """
    size = stored_size(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path}: truncated safetensors file ({size} bytes); re-download it")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise InputError(f"{path}: truncated safetensors header ({header_len} bytes declared, the file has "
                             f"{size}); re-download it")
        if header_len > MAX_HEADER_BYTES:
            raise InputError(f"{path}: safetensors header of {header_len} bytes, over the format's "
                             f"{MAX_HEADER_BYTES}; {REDOWNLOAD}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_object, parse_constant=_refuse_constant)
    except _DuplicateKey as duplicate:
        raise InputError(f"{path}: corrupt safetensors header: key {_value(duplicate.args[0])} appears twice; "
                         f"{REDOWNLOAD}") from None
    except RecursionError:
        raise InputError(f"{path}: corrupt safetensors header (nested too deeply); {REDOWNLOAD}") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity, an integer of too many digits
        raise InputError(f"{path}: corrupt safetensors header (not valid JSON); {REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object); "
                         f"{REDOWNLOAD}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(v, str) for v in metadata.values())):
        raise InputError(f"{path}: __metadata__ is {_value(metadata)}; the format maps strings to strings; "
                         f"{REDOWNLOAD}")
    data = size - 8 - header_len
    spans = sorted((_tensor_span(path, name, info, data), name) for name, info in header.items())
    end = 0
    for (begin, stop), name in spans:
        if begin != end:
            what = f"start at byte {begin}, but the previous tensor ends at {end}"
            what += " (overlap)" if begin < end else " (a gap)"
            raise InputError(f"{path}: tensor {_name(name)}: data_offsets {what}; {REDOWNLOAD}")
        end = stop
    if end < data:
        raise InputError(f"{path}: {data - end} bytes after the last tensor's data; {REDOWNLOAD}")
    return {name: tuple(info["shape"]) for name, info in header.items()}


def _tensor_span(path: Path, name: str, info, data: int) -> tuple[int, int]:
    """A header entry's (begin, end) data offsets once its fields agree with each other and lie in the ``data``
    bytes after the header."""
    def refuse(what: str) -> InputError:
        return InputError(f"{path}: tensor {_name(name)}: {what}; {REDOWNLOAD}")

    if not isinstance(info, dict) or set(info) != TENSOR_FIELDS:
        fields = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise refuse(f"entry is {_value(fields)}; expected exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
        raise refuse(f"dtype {_value(dtype)} is not a safetensors dtype")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise refuse(f"shape {_value(shape)} is not a list of non-negative 64-bit integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)):
        raise refuse(f"data_offsets {_value(offsets)} are not two non-negative 64-bit integers")
    begin, stop = offsets
    if begin > stop:
        raise refuse(f"data_offsets {_value(offsets)} end before they begin")
    if stop > data:
        raise InputError(f"{path}: tensor {_name(name)}: truncated: data_offsets {_value(offsets)} run past the "
                         f"{data} bytes of data the file holds; re-download it")
    count = 1  # as the format counts: elements, then bits, each within 64 bits
    for dim in shape:
        count *= dim
        if count >= USIZE:
            break
    bits = count * SAFETENSORS_BITS[dtype]
    if bits >= USIZE:
        raise refuse(f"shape {_value(shape)} has more elements than a safetensors file can count")
    if bits % 8 or bits // 8 != stop - begin:
        need = ("a fractional number of bytes" if bits % 8 else f"{bits // 8} bytes" if bits // 8 <= data
                else "more bytes than the file holds")
        raise refuse(f"shape {_value(shape)} of {dtype} needs {need}, data_offsets hold {stop - begin}")
    return begin, stop


def _name(name: str) -> str:
    return quote(name, NAME_LIMIT)


def _value(value) -> str:
    return quote(value, VALUE_LIMIT)


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < USIZE


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """All tensor names and shapes of the checkpoint (headers only; no weights are read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(directory):
        for name, shape in check_safetensors(path).items():
            if name in shapes:
                raise InputError(f"{path}: tensor {_name(name)} also appears in another shard")
            shapes[name] = shape
    return shapes


class CheckpointReader:
    """One tensor at a time from a (sharded) safetensors checkpoint: each read maps its shard, copies the tensor out
    and unmaps it again, so what a streamed stage holds is what it keeps, never the checkpoint's pages."""

    def __init__(self, directory: Path):
        refuse_headers_only(directory)
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
    refuse_headers_only(directory)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        check_safetensors(path)
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
