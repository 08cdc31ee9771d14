"""Read a bundle's manifest and print it for a person."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from convert.errors import GateError, InputError
from convert.pipeline.bundle import read_manifest
from convert.verify.placement import layout_of, meaning
from manifests.identity import file_sha256
from manifests.schema import DrafterManifest, FileEntry, Manifest


def print_summary(m: Manifest | DrafterManifest) -> None:
    """A part's manifest in a few lines: what it is, its gate's metrics (a drafter's acceptance), its quantization and
    each package's placement lint as a count with what it means for the layout; ``print_manifest`` has the rest."""
    out = Console(highlight=False, markup=False)  # a manifest's strings are printed as they are, never as markup
    for line in summary_lines(m):
        out.print(line, soft_wrap=True)


def summary_lines(m: Manifest | DrafterManifest) -> list[str]:
    layout = layout_of(m.functions)
    functions = ", ".join(f.name for f in m.functions) or "none"
    if isinstance(m, DrafterManifest):
        a, t = m.architecture, m.target
        lines = [f"{m.name}  drafter export id {m.export_id}",
                 f"  drafter {a.kind}: {a.num_layers} layers, hidden {a.hidden_size}, {a.parameter_count:,} "
                 f"parameters; {layout} layout; functions {functions}; built for target export {t.export_id[:16]} "
                 f"({t.architecture.family})",
                 *_acceptance_lines(m.acceptance)]
        lines.append(_quantization(m.quantization, ", borrowed lm_head excluded"))
        if m.ab:
            lines.append(f"  A/B vs fp16: sign test p {m.ab.get('sign_test_p')}, accepted {m.ab.get('accepted_other')} "
                         f"vs {m.ab.get('accepted_base')}")
    else:
        a, g = m.architecture, m.gate
        parts = f"; {len(m.parts)} parts" if m.parts else ""
        lines = [f"{m.name}  export id {m.export_id}",
                 f"  target {a.family}: {a.num_layers} layers, hidden {a.hidden_size}, vocab {a.vocab_size}, context "
                 f"{a.context}; {layout} layout; functions {functions}{parts}"]
        windows = f" on {_windows(g.data['n'])} of {g.data.get('length')} tokens" if "n" in g.data else ""
        lines.append(f"  gate {'passed' if g.passed else 'FAILED'}: {_metrics(g.metrics, g.thresholds)}{windows}")
        if g.device is not None:
            d = g.device
            lines.append(f"  device pass ({d.device} arithmetic) {'passed' if d.passed else 'FAILED'}: "
                         f"{_metrics(d.metrics, g.thresholds, 'device_', DEVICE_SUMMARY_METRICS)} on "
                         f"{_windows(d.windows)}")
        else:
            lines.append("  device pass: not recorded (a bundle built before it)")
        if g.artifact:
            art = g.artifact
            lines.append(f"  artifact: {art.get('package')} on the Core AI runtime "
                         f"{'passed' if art.get('passed') else 'FAILED'} ({art.get('runtime_calls')} calls)")
        lines.append(_quantization(m.quantization))
    for p in m.packages:
        size = sum(f.size for f in p.files) / 2**20
        if p.placement is None:
            lint = "not linted"
        else:
            count = f"{len(p.placement)} findings" if p.placement else "no finding"
            lint = f"{count}, {meaning(layout, len(p.placement))}"
        lines.append(f"  package {p.path} ({p.format}, {size:.1f} MiB): placement lint {lint}")
    return lines


def _windows(n) -> str:
    return f"{n} window{'' if n == 1 else 's'}"


def _quantization(q, note: str = "") -> str:
    if q is None:
        return "  quantization none (fp16 weights)"
    return (f"  quantization {q.method}, {q.bits} bits, group {q.group_size} ({q.bits_per_weight:.2f} bits per "
            f"weight{note})")


SUMMARY_METRICS = (("mean KL", "kl_mean", "mean_kl_max", "max"), ("top-1", "top1", "top1_min", "min"),
                   ("greedy", "greedy_match", "greedy_match_min", "min"))
# the device pass gates its top-1 beyond near ties (verify/gates.py ``_device_result``); a bundle built before has none
DEVICE_SUMMARY_METRICS = (SUMMARY_METRICS[0], ("top-1", "top1", None, None),
                          ("top-1 beyond near ties", "top1_beyond_near_ties", "top1_min", "min"), SUMMARY_METRICS[2])


def _metrics(metrics: dict[str, float], thresholds: dict[str, float], prefix: str = "",
             rows=SUMMARY_METRICS) -> str:
    """The summary's metrics (``rows``), each with its bar when the gate recorded one."""
    shown = []
    for label, key, bar, side in rows:
        if key in metrics:
            limit = thresholds.get(prefix + bar) if bar else None
            shown.append(f"{label} {metrics[key]:.4g}" + (f" ({side} {limit:g})" if limit is not None else ""))
    return ", ".join(shown) or "no metric recorded"


def _acceptance_lines(acc: dict) -> list[str]:
    """A drafter's acceptance (its gate): tokens per round, lossless, the device pass and the predicted speedup.
    ``acceptance`` is a free-form record past its checked numbers: anything else is shown only when it is a number."""
    def number(value, fmt: str) -> str | None:
        return format(value, fmt) if isinstance(value, int | float) and not isinstance(value, bool) else None

    tokens = number(acc.get("tokens_per_round"), ".3f")
    lines = [f"  acceptance: {f'{tokens} tokens per round' if tokens else 'not measured'}, lossless "
             f"{acc.get('lossless')}"]
    device = acc.get("device")
    if isinstance(device, dict) and number(device.get("tokens_per_round"), ".3f"):
        lines.append(f"  device pass ({str(device.get('device'))[:40]} arithmetic): "
                     f"{number(device.get('tokens_per_round'), '.3f')} tokens per round, lossless "
                     f"{device.get('lossless')}")
    economics, ngram = acc.get("economics"), acc.get("ngram")
    speedup = number(economics.get("predicted_speedup"), ".2f") if isinstance(economics, dict) else None
    baseline = number(ngram.get("tokens_per_round"), ".3f") if isinstance(ngram, dict) else None
    if speedup or baseline:
        lines.append("  " + "; ".join(x for x in (speedup and f"predicted speedup {speedup}x",
                                                  baseline and f"n-gram baseline {baseline} tokens per round") if x))
    return lines


def manifests_json(manifests: dict[str, Manifest | DrafterManifest]) -> str:
    """``inspect --json``: one bundle's manifest, or a pair's as {"target": ..., "drafter": ...}."""
    data = {name: m.model_dump(mode="json") for name, m in manifests.items()}
    return json.dumps(next(iter(data.values())) if len(data) == 1 else data, indent=2, ensure_ascii=False)


def print_manifest(m: Manifest | DrafterManifest) -> None:
    if isinstance(m, DrafterManifest):
        _print_drafter(m)
        return
    out = Console(highlight=False, markup=False)  # a manifest's strings are printed as they are, never as markup
    a = m.architecture
    out.print(Text.assemble((m.name, "bold"), f"  export id {m.export_id}"))
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
    _print_contract(out, m.host_contract)
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
    _print_placement(out, m.packages)


def _print_contract(out: Console, c) -> None:
    """A host contract's name, rollback and the buffers the host owns (``manifests.schema.HostContract``)."""
    extra = f", inputs {', '.join(c.inputs)}" if c.inputs else ""
    pending = f", pending rows {c.pending_rows}" if c.pending_rows else ""
    out.print(f"  host contract {c.name} v{c.version}: rollback {c.rollback}{extra}{pending}")
    for name, buffer in c.buffers.items():
        ring = f" (slot = position mod {buffer.ring})" if buffer.ring else ""
        out.print(f"  host buffer {name}: the host writes each call's {buffer.rows} into it along axis "
                  f"{buffer.axis}, row j at position j{ring}")
    if c.logits_parts:
        out.print(f"  logits in {len(c.logits_parts)} parts, which the host puts side by side: " + ", ".join(
            f"{name} rows {first}..{end - 1}" for name, (first, end) in c.logits_parts.items()))


def _print_placement(out: Console, packages) -> None:
    for p in packages:
        if p.placement is not None:
            count = f"{len(p.placement)} findings" if p.placement else "no finding"
            out.print(f"  placement lint {p.path}: {count}" + "".join(
                f"\n    {finding}" for finding in p.placement))


def _print_drafter(m: DrafterManifest) -> None:
    out = Console(highlight=False, markup=False)
    a, t = m.architecture, m.target
    out.print(Text.assemble((m.name, "bold"), f"  drafter export id {m.export_id}"))
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
    if m.host_contract:
        _print_contract(out, m.host_contract)
    for p in m.packages:
        out.print(f"  package {p.path}: {sum(f.size for f in p.files) / 2**20:.1f} MiB, "
                  + ", ".join(f"{k}={v}" for k, v in p.check.items()))
    _print_placement(out, m.packages)


# Opening a bundle for a command: its manifest through the schema, the kind the command takes, then its files
# against the manifest's records, so that a damaged bundle is refused by name before anything parses or runs it (the
# Core AI runtime aborts the process on a truncated main.mlirb, with no message).
HASHED_BYTES = 64 * 2**20  # recorded files up to this size are hashed whenever a bundle is opened; larger ones are
#                            checked by size, and hashed when the command runs them (``run_formats``)


def open_target(folder: Path, command: str, run_formats: tuple[str, ...] = ()) -> Manifest:
    """A target bundle's manifest, after its kind and its files (``check_files``) are checked."""
    manifest = read_manifest(folder)
    if not isinstance(manifest, Manifest):
        raise InputError(f"{folder}: a drafter bundle; {command} takes a target bundle (a pair's target/)")
    check_files(folder, manifest, run_formats)
    return manifest


def open_drafter(folder: Path, command: str, run_formats: tuple[str, ...] = ()) -> DrafterManifest:
    """A drafter bundle's manifest, after its kind and its files (``check_files``) are checked."""
    manifest = read_manifest(folder)
    if not isinstance(manifest, DrafterManifest):
        raise InputError(f"{folder}: a target bundle; {command} takes a drafter bundle (a pair's drafter/)")
    check_files(folder, manifest, run_formats)
    return manifest


def recorded_files(folder: Path, manifest: Manifest | DrafterManifest) -> list[tuple[Path, FileEntry, str, str]]:
    """Every file of the bundle its manifest records: (path, record, the manifest field, the package format or '')."""
    files = [(folder / f.path, f, f"extra_files[{i}]", "") for i, f in enumerate(manifest.extra_files)]
    for i, package in enumerate(manifest.packages):
        base = (folder / package.path).parent
        files += [(base / f.path, f, f"packages[{i}].files[{j}]", package.format) for j, f in enumerate(package.files)]
    interface = getattr(manifest, "drafter_interface", None)
    if interface is not None:
        files += [(folder / interface.lm_head_file.path, interface.lm_head_file, "drafter_interface.lm_head_file", ""),
                  (folder / interface.embeddings_file.path, interface.embeddings_file,
                   "drafter_interface.embeddings_file", "")]
    return files


def check_files(folder: Path, manifest: Manifest | DrafterManifest, run_formats: tuple[str, ...] = (),
                hashed_bytes: int = HASHED_BYTES) -> None:
    """Refuse a bundle whose recorded files are missing (exit 2: incomplete) or differ from their records in size or,
    for files up to ``hashed_bytes`` and those of the packages a command runs (``run_formats``), in sha256 (exit 1:
    the integrity check failed). A Core AI package's ``main.hash`` is checked against its ``main.mlirb`` too."""
    again = "copy the bundle again or rebuild it"
    for path, record, field, package_format in recorded_files(folder, manifest):
        shown = str(path)  # a long recorded path is named, not echoed whole
        shown = shown if len(record.path) <= 120 else f"{shown[: len(shown) - len(record.path) + 120]}..."
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError as exc:  # a name too long for this file system
            raise InputError(f"{shown}: the manifest's {field} records it, it cannot be read ({exc.strerror}); "
                             f"{again}") from None
        if size is None:
            raise InputError(f"{shown}: missing, the manifest's {field} records it; the bundle is incomplete: {again}")
        if size != record.size:
            raise GateError(f"{shown}: {size:,} bytes, the manifest's {field} records {record.size:,} (truncated or "
                            f"changed after the build); {again}")
        if (size <= hashed_bytes or package_format in run_formats) and file_sha256(path) != record.sha256:
            raise GateError(f"{shown}: its sha256 differs from the manifest's {field}.sha256 (changed after the "
                            f"build); {again}")
    for package in manifest.packages:
        if package.format == "coreai" and package.format in run_formats:
            check_aimodel(folder / package.path)


def check_aimodel(package: Path, program_sha256: str | None = None) -> None:
    """A Core AI package's ``main.mlirb`` against the sha256 its ``main.hash`` holds (the runtime aborts the process
    on a damaged program instead of raising): a package damaged after the build, or one not from a spec-convert
    bundle manifest's records, is refused before the runtime opens it. ``program_sha256``: the program's, when the
    caller has just hashed it (``verify``), not read again."""
    program, recorded = package / "main.mlirb", package / "main.hash"
    for path in (program, recorded):
        if not path.is_file():
            raise InputError(f"{path}: missing; not a complete Core AI package: copy the bundle again or rebuild it")
    digest = recorded.read_bytes()[:100]  # the 32 bytes of the digest (coreai-core 1.0 writes them raw)
    if (program_sha256 or file_sha256(program)) not in (digest.hex(), digest.decode("latin-1").strip().lower()):
        raise GateError(f"{program}: its sha256 is not the one {recorded.name} records (truncated or changed after "
                        "the build); copy the bundle again or rebuild it")
