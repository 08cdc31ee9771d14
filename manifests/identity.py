"""Content hashes that make identity checkable: tensors as shipped, tokenizers, export ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

# Covers code, whitespace runs, digits, emoji and CJK: a tokenizer that splits any of them
# differently gives a different probe hash (the idea of llama.cpp's chkhsh).
PROBE_TEXT = (
    "def f(x):\n\treturn x  *  2   # comment\n\n\n    if a != b: pass\r\n"
    "3.14159 1234567890 0x1F 1e-9 -42\n"
    "Hello, World! \u00e9\u00e8\u00ea \u00df \u00f1\n"
    "\U0001f600\U0001f680\u2764\ufe0f \U0001f468\u200d\U0001f469\u200d\U0001f467\n"
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4\n"
    "   \n\n\t\t  end"
)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(data) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes of the tensor exactly as stored; the bytes are hashed where they
    lie (a 248320 x 5120 fp16 table's two copies, ``tobytes`` and the concatenation, were 5 GB)."""
    t = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:".encode())
    if t.numel():
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def tokenizer_identity(tokenizer_json: Path) -> dict:
    """Canonical tokenizer.json hash plus the hash of the ids the probe text encodes to."""
    canonical = canonical_json(json.loads(tokenizer_json.read_text(encoding="utf-8")))
    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = np.asarray(tok.encode(PROBE_TEXT, add_special_tokens=False).ids, dtype="<i4")
    return {
        "tokenizer_json_sha256": sha256_bytes(canonical),
        "probe_ids_sha256": sha256_bytes(ids.tobytes()),
        "probe_text_sha256": sha256_bytes(PROBE_TEXT.encode()),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
    }


def export_id(identity: dict) -> str:
    return sha256_bytes(canonical_json(identity))


LM_HEAD_FILE = "lm_head.safetensors"
EMBEDDINGS_FILE = "embeddings.safetensors"
REPORT_FILE = "gate_report.json"  # the numeric gate's report: a target bundle's, hashed in its manifest's records


def file_sha256(path: Path, advance=None) -> str:
    """The file's sha256, read a MiB at a time; ``advance(n)`` after each chunk of n bytes when given (a progress
    bar)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            if advance is not None:
                advance(len(chunk))
    return digest.hexdigest()


def embedding_row_sha256(embeddings_file: Path, row: int) -> str:
    """sha256 (as ``tensor_sha256``) of one row of the ``weight`` in an embeddings.safetensors."""
    from safetensors import safe_open

    with safe_open(str(embeddings_file), framework="pt") as f:
        return tensor_sha256(f.get_slice("weight")[row : row + 1])


# The target manifest's records a drafter binds whole, in the order check-pair names differences: the most telling
# first (a mask row that differs also changes the embedding hash and the export id; it is named first).
BOUND_RECORDS = ("architecture", "taps", "tokenizer", "host_contract", "weights", "drafter_interface")


def pair_mismatches(drafter, target, target_dir: Path) -> list[str]:
    """Every way a drafter manifest and a target bundle disagree, most specific first; [] when they match.

    Every field of every record the drafter bound (``BOUND_RECORDS``) is compared; the target's borrowed files
    (lm_head.safetensors, embeddings.safetensors, tokenizer/tokenizer.json) are hashed from the bundle itself, and
    its export id is recomputed from its manifest, so a file or a manifest changed after the build is caught.
    """
    expect = drafter.target
    if target.drafter_interface is None:
        return [f"target bundle {target_dir} has no drafter interface ({LM_HEAD_FILE}, {EMBEDDINGS_FILE}): build the "
                "target from a recipe with a drafter"]
    wanted, found = expect.model_dump(mode="json"), target.model_dump(mode="json")
    problems: list[str] = []
    for record in BOUND_RECORDS[:4]:
        problems += _differences(f"target.{record}", wanted[record], found[record])
    interface = target.drafter_interface
    hashes = {r.path: _hash_or_missing(target_dir / r.path)
              for r in (interface.lm_head_file, interface.embeddings_file)}
    if expect.mask_token_id is not None:
        embeddings = target_dir / EMBEDDINGS_FILE
        digest = hashes[EMBEDDINGS_FILE] if EMBEDDINGS_FILE in hashes else _hash_or_missing(embeddings)
        if digest == "missing":
            problems += _differences("target.mask_row_sha256", expect.mask_row_sha256, "missing")
        elif digest == interface.embeddings_file.sha256:  # else the file is not its manifest's, named below: not parsed
            problems += _differences("target.mask_row_sha256", expect.mask_row_sha256,
                                     embedding_row_sha256(embeddings, expect.mask_token_id))
    for record in BOUND_RECORDS[4:]:
        problems += _differences(f"target.{record}", wanted[record], found[record])
    problems += _shipped_files(target, target_dir, hashes)
    if expect.hidden_convention is not None and not target.drafter_interface.hidden_output:
        problems.append(f"target.drafter_interface.hidden_output: the drafter reads the target's hidden states "
                        f"({expect.hidden_convention}); this target build does not return them")
    problems += _differences("target.export_id", expect.export_id, target.export_id)
    recomputed = export_id(target.identity())
    if recomputed != target.export_id:
        problems.append(f"target.export_id: the target manifest says {target.export_id} but its content hashes to "
                        f"{recomputed}: the manifest was edited after the build")
    return problems


def _differences(where: str, wanted, found) -> list[str]:
    """One line per leaf that differs between two JSON values, named by its dotted path."""
    if isinstance(wanted, dict) and isinstance(found, dict):
        return [line for key in sorted(set(wanted) | set(found))
                for line in _differences(f"{where}.{key}", wanted.get(key), found.get(key))]
    if wanted != found:
        return [f"{where}: the drafter was built for {wanted!r}, the target bundle has {found!r}"]
    return []


def _shipped_files(target, target_dir: Path, hashes: dict[str, str]) -> list[str]:
    """The borrowed files as they are in the bundle now (``hashes``: sha256 by recorded path), against the hashes its
    manifest records."""
    problems = []
    interface = target.drafter_interface
    for where, record in (("lm_head_file", interface.lm_head_file), ("embeddings_file", interface.embeddings_file)):
        actual = hashes[record.path]
        if actual != record.sha256:
            problems.append(f"target.drafter_interface.{where}.sha256: {record.path} in the bundle hashes to "
                            f"{actual}; its manifest says {record.sha256}")
    shipped_tokenizer = target_dir / "tokenizer" / "tokenizer.json"
    if shipped_tokenizer.is_file():
        try:
            shipped = tokenizer_identity(shipped_tokenizer)
        except Exception as exc:  # noqa: BLE001 - any parse failure of a damaged file is the same finding
            first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            return [*problems, f"target.tokenizer: tokenizer/tokenizer.json in the bundle is not a readable "
                    f"tokenizer ({first}); its manifest says {target.tokenizer.tokenizer_json_sha256}"]
        for key, value in shipped.items():
            if value != getattr(target.tokenizer, key):
                problems.append(f"target.tokenizer.{key}: tokenizer/tokenizer.json in the bundle gives {value}; its "
                                f"manifest says {getattr(target.tokenizer, key)}")
    return problems


def _hash_or_missing(path: Path) -> str:
    return file_sha256(path) if path.is_file() else "missing"
