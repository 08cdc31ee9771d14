"""The manifest's records of a build: package entries, copied files (config, tokenizer, licence), the drafter
interface file, quantization and toolchain records, and the target manifest itself. The drafter build writes its
manifest with the same pieces (``convert/pipeline/drafter_build.py``)."""

from __future__ import annotations

import os
import platform
import shutil
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from convert import backends
from convert.export.quantized import embedding_rows
from convert.export.spec import SHIP_DTYPE, FunctionSpec
from convert.inputs.sources import (
    file_records,
    license_files,
)
from convert.models import family_of
from convert.pipeline.bundle import compiled_files
from convert.pipeline.plan import Plan
from convert.verify.placement import PLACEMENT
from convert.verify.report import GateReport
from convert.weights.quantize import QuantizeResult, summary
from convert.weights.target import TargetModules
from manifests import identity
from manifests.schema import Manifest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


COPIED_CONFIG_FILES = ("config.json", "generation_config.json")


TOOLCHAIN_PACKAGES = ("torch", "coreai-core", "coreai-torch", "coremltools", "transformers", "safetensors", "numpy")


def write_drafter_interface(plan: Plan, modules: TargetModules, out: Path) -> dict:
    """lm_head.safetensors and embeddings.safetensors: the lm_head's weight as the target stores it, and the
    embedding rows as its lookups return them (``export.quantized.embedding_rows``: for an exact pack's rotated
    table, the rows after the rotation).

    Written for every target that can feed a drafter (a drafter in the recipe, taps or the hidden output): a
    runtime reads anchor embeddings from them, and a drafter's manifest binds to their hashes; and for every ane
    target, whose host looks the rows of each call's ids up in embeddings.safetensors."""
    from safetensors.torch import save_file

    files = {}
    for key, filename, tensor in (("lm_head_file", identity.LM_HEAD_FILE, modules.core.lm_head.weight),
                                  ("embeddings_file", identity.EMBEDDINGS_FILE,
                                   embedding_rows(modules.core.embed_tokens))):
        path = out / filename
        save_file({"weight": tensor.detach().to(SHIP_DTYPE).contiguous()}, str(path))
        files[key] = {"path": filename, "sha256": identity.file_sha256(path), "size": path.stat().st_size}
    return {**files, "hidden_output": plan.recipe.target.hidden}


def package_entry(name: str, path: Path, bundle: Path, check: dict, compiled, part: str | None = None) -> dict:
    backend = backends.load(name)
    files = [
        {"path": f"{path.name}/{r.path}", "sha256": r.sha256, "size": r.size} for r in file_records(path)
    ]
    return {
        "format": name,
        "path": path.relative_to(bundle).as_posix(),
        "part": part,
        "files": files,
        "stable_hash": backend.stable_hash(path),
        "stable_hash_scope": backend.STABLE_HASH_SCOPE,
        "check": {k: v for k, v in check.items() if k != PLACEMENT},
        "placement": check.get(PLACEMENT),
        "compile": [{**vars(c), "files": compiled_files(bundle, c.outputs)} for c in compiled],
    }


def copy_extras(source: Path, bundle: Path) -> list[dict]:
    """LICENSE / NOTICE at the top, the tokenizer under tokenizer/, config.json as shipped."""
    copied = []
    for path in license_files(source):
        shutil.copy2(path, bundle / path.name)
        copied.append(bundle / path.name)
    (bundle / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, bundle / "tokenizer" / name)
            copied.append(bundle / "tokenizer" / name)
    for name in COPIED_CONFIG_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, bundle / name)
            copied.append(bundle / name)
    return [
        {"path": p.relative_to(bundle).as_posix(), "sha256": identity.file_sha256(p), "size": p.stat().st_size}
        for p in sorted(copied)
    ]


def _special_ids(source: Path, args) -> dict:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    config = source / "tokenizer_config.json"
    if config.is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(str(source))
    return {
        "bos_id": tok.bos_token_id if tok.bos_token_id is not None else args.bos_token_id,
        "eos_id": tok.eos_token_id if tok.eos_token_id is not None else args.eos_token_id,
        "pad_id": tok.pad_token_id if tok.pad_token_id is not None else args.pad_token_id,
    }


def toolchain_versions() -> dict[str, str]:
    versions = {"spec-convert": metadata.version("spec-convert"), "python": platform.python_version()}
    for name in TOOLCHAIN_PACKAGES:
        versions[name] = metadata.version(name)
    return versions


def quantization_record(quant, result: QuantizeResult, modules: TargetModules) -> dict:
    bits_per_weight, layers = summary(result.items(), modules.core.parameters())
    names = result.names()
    calibration = None
    if result.calibration is not None:
        calibration = {"corpus": result.corpus, **result.calibration.identity()}
    return {
        "method": quant.method,
        "bits": 2 if quant.format == "exact2" else 4,
        "group_size": quant.resolved_group_size,
        "bits_per_weight": bits_per_weight,
        "kept_fp16": sorted(
            n for n, m in modules.core.named_modules()
            if getattr(m, "weight", None) is not None and m.weight.dim() == 2 and n not in names
        ),
        "calibration": calibration,
        "layers": layers,
    }


def target_manifest(plan: Plan, source_files, modules: TargetModules, packages, parts, extra_files, quantization,
                    report: GateReport, drafter_interface: dict | None, records: list[dict]) -> Manifest:
    args, snap, core = plan.args, plan.snapshot, modules.core
    tok_records = [r for r in source_files if r.path in TOKENIZER_FILES]
    data = {
        "name": plan.recipe.name,
        "export_id": "",
        "built_at": built_at(),
        "toolchain": toolchain_versions(),
        "source": {
            "reference": snap.reference,
            "repo": snap.repo,
            "revision": snap.revision,
            "files": [vars(r) for r in source_files],
        },
        "architecture": family_of(args).architecture_record(args, plan.recipe.target),
        "host_contract": modules.contract,
        "taps": {"layers": list(plan.recipe.target.taps), "scale": report.rescale.residual_scale
                 if report.rescale else 1.0} if plan.recipe.target.taps else None,
        "rescale": report.rescale.model_dump() if report.rescale else None,
        "tokenizer": {
            **identity.tokenizer_identity(snap.directory / "tokenizer.json"),
            **_special_ids(snap.directory, args),
            "files": [vars(r) for r in tok_records],
        },
        "weights": {
            "dtype": "float16",
            "embedding_sha256": identity.tensor_sha256(core.embed_tokens.weight),
            "lm_head_sha256": identity.tensor_sha256(core.lm_head.weight),
            "lm_head_tied": args.tie_word_embeddings,
            "parameter_count": sum(p.numel() for p in {id(p): p for p in core.parameters()}.values()),
        },
        "quantization": quantization,
        "gate": report.manifest_entry(),
        "functions": [function_record(spec) for spec in plan.specs],
        "parts": parts,
        "packages": packages,
        "extra_files": extra_files,
        "drafter_interface": drafter_interface,
        "records": records,
    }
    manifest = Manifest.model_validate(data)
    manifest.export_id = identity.export_id(manifest.identity())
    return manifest


def built_at() -> str:
    """Now in UTC, or ``SOURCE_DATE_EPOCH`` when it is set (reproducible builds: the same inputs, the same bytes)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return moment.isoformat(timespec="seconds")


def function_record(spec: FunctionSpec) -> dict:
    return {"name": spec.name, "inputs": [_desc(t) for t in spec.inputs], "outputs": [_desc(t) for t in spec.outputs],
            "states": [_desc(t) for t in spec.states]}


def _desc(t) -> dict:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}
