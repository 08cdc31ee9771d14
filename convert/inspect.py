"""Read a bundle's manifest and print it for a person."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from convert.bundle import MANIFEST
from convert.errors import InputError
from manifests.schema import SCHEMA_VERSION, DrafterManifest, Manifest


def read_manifest(bundle: Path) -> Manifest | DrafterManifest:
    """A target or drafter bundle's manifest (by its ``kind``), validated against the schema."""
    path = bundle / MANIFEST
    if not path.is_file():
        parts = [d.name for d in (bundle / "target", bundle / "drafter") if (d / MANIFEST).is_file()]
        hint = f" (it holds {' and '.join(f'{p}/' for p in parts)}: name one)" if parts else ""
        raise InputError(f"{bundle}: no {MANIFEST}; not a spec-convert bundle{hint}")
    try:
        data = json.loads(path.read_text())
        model = DrafterManifest if isinstance(data, dict) and data.get("kind") == "drafter" else Manifest
        return model.model_validate(data)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise InputError(f"{path}: {field}: {err['msg']} (manifest does not match schema version "
                         f"{SCHEMA_VERSION}; rebuild the bundle)") from None


def print_manifest(m: Manifest | DrafterManifest) -> None:
    if isinstance(m, DrafterManifest):
        _print_drafter(m)
        return
    out = Console(highlight=False)
    a = m.architecture
    out.print(f"[bold]{m.name}[/bold]  export id {m.export_id}")
    out.print(f"  built {m.built_at} with spec-convert {m.toolchain.get('spec-convert')}")
    out.print(f"  source {m.source.reference} ({len(m.source.files)} files)")
    out.print(
        f"  {a.family}: {a.num_layers} layers, hidden {a.hidden_size}, heads {a.num_heads}/{a.num_kv_heads} "
        f"(head_dim {a.head_dim}), vocab {a.vocab_size}, context {a.context}, rope {a.rope_type} theta {a.rope_theta:g}"
    )
    if a.hybrid:
        h = a.hybrid
        pattern = "".join("L" if t == "linear_attention" else "F" for t in h.layer_types)
        out.print(f"  hybrid layers {pattern} (L Gated DeltaNet, F attention, RoPE on {h.rotary_dim} dims); GDN "
                  f"{h.linear_num_key_heads} key / {h.linear_num_value_heads} value heads (dims "
                  f"{h.linear_key_head_dim}/{h.linear_value_head_dim}), conv kernel {h.linear_conv_kernel_dim}")
    c = m.host_contract
    extra = f", inputs {', '.join(c.inputs)}" if c.inputs else ""
    pending = f", pending rows {c.pending_rows}" if c.pending_rows else ""
    out.print(f"  host contract {c.name} v{c.version}: rollback {c.rollback}{extra}{pending}")
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
    for part in m.parts or []:
        held = [f"{what} {rows[0]}..{rows[1] - 1}" for what, rows in (
            ("embedding rows", part.embedding_rows), ("layers", part.layers if part.layers[1] > part.layers[0] else
                                                      None), ("lm_head rows", part.head_rows)) if rows]
        taps = f", taps {part.taps}" if part.taps else ""
        out.print(f"  part {part.name}: {', '.join(held)}{taps}")
    packages = Table("package", "size", "stable hash", "check", "compile")
    for p in m.packages:
        size = sum(f.size for f in p.files)
        check = ", ".join(f"{k}={v}" for k, v in p.check.items())
        compiled = "\n".join(f"{c.kind}: {c.status}" + (f" ({c.reason})" if c.reason else "") for c in p.compile)
        packages.add_row(p.path, f"{size / 2**20:.1f} MiB", p.stable_hash[:16], check, compiled)
    out.print(packages)


def _print_drafter(m: DrafterManifest) -> None:
    out = Console(highlight=False)
    a, t = m.architecture, m.target
    out.print(f"[bold]{m.name}[/bold]  drafter export id {m.export_id}")
    out.print(f"  built {m.built_at} with spec-convert {m.toolchain.get('spec-convert')}")
    out.print(f"  source {m.source.reference} ({len(m.source.files)} files), layout {a.layout}")
    out.print(f"  {a.kind} ({', '.join(a.architectures)}): {a.num_layers} layers, hidden {a.hidden_size}, heads "
              f"{a.num_heads}/{a.num_kv_heads} (head_dim {a.head_dim}), {a.parameter_count:,} parameters")
    out.print("  runtime " + ", ".join(f"{k}={v}" for k, v in a.runtime.items()))
    out.print(f"  bound to target export {t.export_id[:16]} ({t.architecture.family}, host contract "
              f"{t.host_contract.name} v{t.host_contract.version}): lm_head {t.weights.lm_head_sha256[:16]}, embedding "
              f"{t.weights.embedding_sha256[:16]}, tokenizer {t.tokenizer.tokenizer_json_sha256[:16]}, taps "
              f"{t.taps.layers if t.taps else None}, mask row {t.mask_row_sha256[:16] if t.mask_row_sha256 else None}")
    acc = m.acceptance
    out.print(f"  acceptance: {acc.get('tokens_per_round', 0):.3f} tokens per round, lossless {acc.get('lossless')}")
    if m.quantization:
        q = m.quantization
        out.print(f"  quantization {q.method} g{q.group_size}, {q.bits_per_weight:.2f} bits per weight")
    if m.ab:
        out.print(f"  A/B vs fp16: sign test p {m.ab.get('sign_test_p')}, accepted {m.ab.get('accepted_other')} vs "
                  f"{m.ab.get('accepted_base')}")
    for p in m.packages:
        out.print(f"  package {p.path}: {sum(f.size for f in p.files) / 2**20:.1f} MiB, "
                  + ", ".join(f"{k}={v}" for k, v in p.check.items()))
