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
    """sha256 over dtype, shape and the raw bytes of the tensor exactly as stored."""
    t = tensor.detach().contiguous().cpu()
    header = f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:".encode()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return sha256_bytes(header + raw)


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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def embedding_row_sha256(embeddings_file: Path, row: int) -> str:
    """sha256 (as ``tensor_sha256``) of one row of the ``weight`` in an embeddings.safetensors."""
    from safetensors import safe_open

    with safe_open(str(embeddings_file), framework="pt") as f:
        return tensor_sha256(f.get_slice("weight")[row : row + 1])


def pair_mismatches(drafter, target, target_dir: Path) -> list[str]:
    """Every way a drafter manifest and a target bundle disagree, most specific first; [] when they match.

    The target's borrowed files (lm_head.safetensors, embeddings.safetensors, tokenizer/tokenizer.json) are
    hashed from the bundle itself, so a file changed after the build is caught even when the manifest was not.
    """
    expect = drafter.target
    interface = target.drafter_interface
    if interface is None:
        return [f"target bundle {target_dir} has no drafter interface ({LM_HEAD_FILE}, {EMBEDDINGS_FILE}): build the "
                "target from a recipe with a drafter"]
    # the most telling fields first: a mask row that differs also changes the embedding hash and the export id
    found: dict[str, object] = {
        "hidden_size": target.architecture.hidden_size,
        "vocab_size": target.architecture.vocab_size,
        "taps": target.taps.model_dump() if target.taps else None,
        "tokenizer_json_sha256": target.tokenizer.tokenizer_json_sha256,
        "probe_ids_sha256": target.tokenizer.probe_ids_sha256,
        "mask_row_sha256": None,
        "lm_head_sha256": target.weights.lm_head_sha256,
        "lm_head_file_sha256": _hash_or_missing(target_dir / LM_HEAD_FILE),
        "embedding_sha256": target.weights.embedding_sha256,
        "embeddings_file_sha256": _hash_or_missing(target_dir / EMBEDDINGS_FILE),
    }
    shipped_tokenizer = target_dir / "tokenizer" / "tokenizer.json"
    if shipped_tokenizer.is_file():
        shipped = tokenizer_identity(shipped_tokenizer)
        for key in ("tokenizer_json_sha256", "probe_ids_sha256"):
            if shipped[key] != found[key]:
                found[key] = f"{shipped[key]} (tokenizer/tokenizer.json; its manifest says {found[key]})"
    for key, record in (("lm_head_file_sha256", interface.lm_head_file), ("embeddings_file_sha256",
                                                                            interface.embeddings_file)):
        if found[key] != record.sha256:
            found[key] = f"{found[key]} ({record.path}; its manifest says {record.sha256})"
    embeddings = target_dir / EMBEDDINGS_FILE
    if expect.mask_token_id is not None:
        found["mask_row_sha256"] = embedding_row_sha256(embeddings, expect.mask_token_id) if embeddings.is_file() \
            else "missing"
    if expect.hidden_convention is not None:
        found["hidden_convention"] = expect.hidden_convention if interface.hidden_output else "no hidden output"
    found["export_id"] = target.export_id
    wanted = expect.model_dump(mode="json")
    problems = []
    for key, value in found.items():
        if wanted.get(key) != value:
            problems.append(f"target.{key}: the drafter was built for {wanted.get(key)}, the target bundle has {value}")
    return problems


def _hash_or_missing(path: Path) -> str:
    return file_sha256(path) if path.is_file() else "missing"
