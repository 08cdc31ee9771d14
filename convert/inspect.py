"""Read a bundle's manifest and print it for a person."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from convert.bundle import MANIFEST
from convert.errors import InputError
from manifests.schema import Manifest


def read_manifest(bundle: Path) -> Manifest:
    path = bundle / MANIFEST
    if not path.is_file():
        raise InputError(f"{bundle}: no {MANIFEST}; not a spec-convert bundle")
    try:
        return Manifest.model_validate_json(path.read_text())
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise InputError(f"{path}: {field}: {err['msg']} (manifest does not match schema version 1)") from None


def print_manifest(m: Manifest) -> None:
    out = Console(highlight=False)
    a = m.architecture
    out.print(f"[bold]{m.name}[/bold]  export id {m.export_id}")
    out.print(f"  built {m.built_at} with spec-convert {m.toolchain.get('spec-convert')}")
    out.print(f"  source {m.source.reference} ({len(m.source.files)} files)")
    out.print(
        f"  {a.family}: {a.num_layers} layers, hidden {a.hidden_size}, heads {a.num_heads}/{a.num_kv_heads} "
        f"(head_dim {a.head_dim}), vocab {a.vocab_size}, context {a.context}, rope {a.rope_type} theta {a.rope_theta:g}"
    )
    out.print(f"  weights {m.weights.dtype}, {m.weights.parameter_count:,} parameters")
    out.print(f"  lm_head {m.weights.lm_head_sha256[:16]}{' (tied)' if m.weights.lm_head_tied else ''}"
              f"  embedding {m.weights.embedding_sha256[:16]}")
    t = m.tokenizer
    out.print(f"  tokenizer {t.tokenizer_json_sha256[:16]} probe {t.probe_ids_sha256[:16]} vocab {t.vocab_size} "
              f"bos {t.bos_id} eos {t.eos_id} pad {t.pad_id}")
    if m.taps:
        out.print(f"  taps {m.taps.layers}: {m.taps.convention}")
    table = Table("function", "inputs", "outputs", "states")
    for f in m.functions:
        fmt = "\n".join
        table.add_row(
            f.name,
            fmt(f"{t.name} {t.shape} {t.dtype}" for t in f.inputs),
            fmt(f"{t.name} {t.shape} {t.dtype}" for t in f.outputs),
            fmt(f"{t.name} {t.shape} {t.dtype}" for t in f.states),
        )
    out.print(table)
    packages = Table("package", "size", "stable hash", "check", "compile")
    for p in m.packages:
        size = sum(f.size for f in p.files)
        check = ", ".join(f"{k}={v}" for k, v in p.check.items())
        compiled = "\n".join(f"{c.kind}: {c.status}" + (f" ({c.reason})" if c.reason else "") for c in p.compile)
        packages.add_row(p.path, f"{size / 2**20:.1f} MiB", p.stable_hash[:16], check, compiled)
    out.print(packages)
