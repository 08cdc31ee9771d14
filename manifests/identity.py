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
