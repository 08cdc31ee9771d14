"""Manifests to mutate, without a build: a real target manifest and a drafter manifest bound to it.

``data/tiny_target_manifest.json`` is the manifest of a real build: tests/test_pair.py's target recipe (hidden 64, 4
layers, taps [0, 2, 3], context 128) with ``backends: [coreai]``. When the schema changes, rebuild it that way and
copy the bundle's manifest.json over it (``test_the_samples_match_the_schema`` fails until then).
"""

import copy
import json
import os
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
TARGET_MANIFEST = DATA / "tiny_target_manifest.json"


def target_manifest() -> dict:
    return json.loads(TARGET_MANIFEST.read_text())


def drafter_manifest(target: dict, mask_row_sha256: str | None = None) -> dict:
    """A drafter manifest bound to ``target`` (its records copied whole, as a drafter build binds them), with no
    package: what check-pair, inspect and the kind checks read."""
    binding = {key: copy.deepcopy(target[key]) for key in ("export_id", "architecture", "host_contract", "tokenizer",
                                                           "weights", "drafter_interface", "taps")}
    binding.update(mask_token_id=3 if mask_row_sha256 else None, mask_row_sha256=mask_row_sha256,
                   hidden_convention=None)
    arch = target["architecture"]
    return {
        "schema_version": target["schema_version"], "kind": "drafter", "name": "dflash2_fp16", "export_id": "0" * 64,
        "built_at": target["built_at"], "toolchain": target["toolchain"],
        "source": {"reference": "path:drafter", "repo": None, "revision": None, "files": []},
        "architecture": {"kind": "dflash2", "architectures": ["DFlash2DraftModel"], "layout": "dflash2",
                         "hidden_size": arch["hidden_size"], "num_layers": 2, "num_heads": arch["num_heads"],
                         "num_kv_heads": arch["num_kv_heads"], "head_dim": arch["head_dim"],
                         "intermediate_size": arch["intermediate_size"], "vocab_size": arch["vocab_size"],
                         "rope_theta": arch["rope_theta"], "rms_norm_eps": arch["rms_norm_eps"],
                         "parameter_count": 1000, "runtime": {"block_size": 8}},
        "target": binding, "quantization": None,
        "acceptance": {"tokens_per_round": 1.5, "lossless": True, "rounds": 4},
        "ab": None, "functions": [], "packages": [], "extra_files": [],
    }


def recorded_paths(manifest: dict) -> list[tuple[str, int]]:
    """(path relative to the bundle, size) of every file a manifest records
    (``convert.commands.inspect.recorded_files``)."""
    files = [(f["path"], f["size"]) for f in manifest.get("extra_files", [])]
    for package in manifest.get("packages", []):
        base = os.path.dirname(package["path"])
        files += [(os.path.join(base, f["path"]), f["size"]) for f in package["files"]]
    interface = manifest.get("drafter_interface")
    if interface:
        files += [(interface[k]["path"], interface[k]["size"]) for k in ("lm_head_file", "embeddings_file")]
    return files


def write_bundle(folder: Path, manifest: dict | str | bytes, files: dict | None = None) -> Path:
    """``folder`` with ``manifest`` as its manifest.json (a dict as JSON, text or bytes as they are) and, for each file
    ``files`` records (default: the manifest's own), a sparse file of the recorded size: what ``inspect`` checks."""
    folder.mkdir(parents=True, exist_ok=True)
    data = manifest if isinstance(manifest, bytes) else (
        manifest if isinstance(manifest, str) else json.dumps(manifest)).encode("utf-8", "surrogatepass")
    (folder / "manifest.json").write_bytes(data)
    for path, size in recorded_paths(files if files is not None else manifest if isinstance(manifest, dict) else {}):
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as f:
            f.truncate(size)
    return folder
