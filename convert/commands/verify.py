"""`spec-convert verify`: every file of a bundle hashed against its manifest, the manifest against its schema and its
export id, files the manifest does not record, and a pair's drafter binding against its target.

Unlike the commands that open a bundle to run it (``inspect.check_files``: sizes, and hashes of small files and of the
packages they run), nothing is skipped here: every recorded file is hashed, a 27B bundle's many GB included, and
besides the files ``check_files`` reads, the compile outputs under ``compiled/`` (``CompileStep.files``) and the files
whose bytes vary from run to run, outside the export id (``records``: a target's ``gate_report.json``). A bundle holds
no file but its manifest that the manifest does not hash.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from convert import progress
from convert.commands.inspect import check_aimodel, recorded_files
from convert.errors import GateError, InputError, one_line
from convert.pipeline.bundle import COMPILED, MANIFEST, parts, read_manifest
from manifests import identity
from manifests.identity import file_sha256
from manifests.schema import DrafterManifest, FileEntry, Manifest

AGAIN = "copy the bundle again or rebuild it"
SHOWN_HASH = 12  # hex digits of a sha256 a difference shows
LARGE_FILE = 256 * 2**20  # when stderr is not a terminal, a line is printed before hashing a file this large


@dataclass
class PartReport:
    """One bundle of ``verify``: its name (target / drafter), what was hashed and every difference found."""

    name: str
    folder: Path
    manifest: Manifest | DrafterManifest | None = None
    files: int = 0
    hashed_bytes: int = 0
    differences: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"ok: {self.name} ({self.files} files, {self.hashed_bytes / 1e6:,.1f} MB hashed)"


def verify_bundle(bundle: Path) -> list[PartReport]:
    """Check each part of ``bundle`` (a target, a drafter, or a pair's both); return their reports, whose
    ``differences`` name each file or field relative to ``bundle``. Raises InputError (exit 2) when ``bundle`` is not
    a bundle at all; a damaged one is reported, not raised."""
    try:
        found = bundle.is_dir()
    except OSError:
        found = False
    if not found:
        raise InputError(f"{bundle}: not a folder; verify takes a bundle (a folder holding {MANIFEST}, or a pair's "
                         "target/ and drafter/)")
    halves = [bundle / name for name in ("target", "drafter")]
    pair = not (bundle / MANIFEST).is_file() and any((half / MANIFEST).is_file() for half in halves)
    if not pair and not (bundle / MANIFEST).is_file():
        read_manifest(bundle)  # not a bundle: its InputError (exit 2) says so
    # a pair's halves whether or not their manifests are there (one missing is a difference); ``parts`` otherwise
    folders = [half for half in halves if half.is_dir()] if pair else parts(bundle)
    reports = [PartReport(folder.name if pair else "", folder) for folder in folders]
    for report in reports:
        _read(bundle, report)
    recorded: dict[Path, list] = {r.folder: every_recorded_file(r.folder, r.manifest) for r in reports if r.manifest}
    extra = {r.folder: _extra_files(bundle, r, {p for p, *_ in recorded[r.folder]}) for r in reports if r.manifest}
    if pair:  # besides target/ and drafter/, a pair holds nothing
        root = PartReport("bundle", bundle)
        for entry in sorted(bundle.iterdir()):
            if entry.name not in ("target", "drafter") or not entry.is_dir() or entry.is_symlink():
                root.differences += [f"{_shown(bundle, path)}: in the bundle, not in a part of the pair (a pair holds "
                                     "target/ and drafter/ only); remove it or rebuild the bundle"
                                     for path in ([entry] if not entry.is_dir() or entry.is_symlink() else
                                                  _walk(entry))]
        reports.append(root)
    _hash_all(bundle, reports, recorded)  # a recorded file that differs is named before a file not recorded
    for report in reports:
        report.differences += extra.get(report.folder, [])
    if pair:
        _check_pair(bundle, reports)
    return reports


def first_difference(reports: list[PartReport]) -> str | None:
    return next((d for r in reports for d in r.differences), None)


def _read(bundle: Path, report: PartReport) -> None:
    """The part's manifest through the schema and its export id; a damaged one is a difference (exit 1)."""
    path = report.folder / MANIFEST
    if not path.is_file():
        report.differences.append(f"{_shown(bundle, path)}: missing; the pair's {report.name}/ has no manifest: "
                                  f"{AGAIN}")
        return
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: cannot be read (no permission); verify needs to read every file of the bundle")
    try:
        manifest = read_manifest(report.folder)
    except InputError as exc:
        report.differences.append(one_line(str(exc)).replace(str(path), _shown(bundle, path), 1))
        return
    report.manifest = manifest
    report.name = report.name or manifest.kind
    recomputed = identity.export_id(manifest.identity())
    if recomputed != manifest.export_id:
        report.differences.append(
            f"{_shown(bundle, path)}: export_id: it records {manifest.export_id[:SHOWN_HASH]}, its content hashes to "
            f"{recomputed[:SHOWN_HASH]} (the manifest was edited after the build); {AGAIN}")


def every_recorded_file(folder: Path, manifest: Manifest | DrafterManifest) -> list[tuple[Path, FileEntry, str, str]]:
    """``inspect.recorded_files`` (what a command opening the bundle checks), then every file of the compile steps'
    outputs and the manifest's ``records``: (path, record, the manifest field, the package format or '')."""
    files = recorded_files(folder, manifest)
    for i, package in enumerate(manifest.packages):
        files += [(folder / f.path, f, f"packages[{i}].compile[{k}].files[{j}]", "")
                  for k, step in enumerate(package.compile) for j, f in enumerate(step.files)]
    return files + [(folder / f.path, f, f"records[{j}]", "") for j, f in enumerate(manifest.records)]


def _walk(folder: Path) -> list[Path]:
    """Every file under ``folder`` (links and other non-folders included), sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        found += [Path(root) / name for name in sorted(files)]
        found += [Path(root) / name for name in dirs if (Path(root) / name).is_symlink()]  # not walked into
    return found


def _extra_files(bundle: Path, report: PartReport, recorded: set[Path]) -> list[str]:
    """The files in a part that its manifest does not hash, besides the manifest itself; a compile output that a step
    names without hashing it (a bundle built before ``CompileStep.files``) is one too."""
    manifest = report.manifest
    known = {report.folder / MANIFEST, *recorded}
    compiled = [report.folder / COMPILED / out for p in manifest.packages for step in p.compile for out in step.outputs]
    extra = []
    for path in _walk(report.folder):
        if path in known:
            continue
        if any(path == c or c in path.parents for c in compiled):
            extra.append(f"{_shown(bundle, path)}: a compile output its manifest names without a hash "
                         f"({_size(path)}; built before compile outputs were hashed); rebuild the bundle")
            continue
        extra.append(f"{_shown(bundle, path)}: in the bundle, not in its manifest ({_size(path)}); remove it or "
                     "rebuild the bundle")
    return extra


def _size(path: Path) -> str:
    try:
        return "a link" if path.is_symlink() else f"{path.stat().st_size:,} bytes"
    except OSError:
        return "unreadable"


def _hash_all(bundle: Path, reports: list[PartReport], recorded: dict[Path, list]) -> None:
    """Each recorded file's presence and size, then its sha256 (with progress over the bytes to hash), then each Core
    AI program against the digest just computed."""
    todo = [entry for report in reports for entry in _sized(bundle, report, recorded.get(report.folder, []))]
    digests = _hashed(bundle, todo)
    for report in reports:
        manifest = report.manifest
        for package in manifest.packages if manifest is not None else ():
            if package.format == "coreai" and not report.differences:
                try:
                    aimodel = report.folder / package.path
                    check_aimodel(aimodel, digests.get(aimodel / "main.mlirb"))
                except (InputError, GateError) as exc:
                    report.differences.append(str(exc).replace(str(bundle) + os.sep, "", 1))


def _sized(bundle: Path, report: PartReport, files: list) -> list[tuple]:
    """The files of ``report``'s folder whose presence and size are as recorded, to hash; the others' differences
    noted on the report."""
    todo = []
    for path, record, where, _format in files:
        report.files += 1
        shown = _shown(bundle, path)
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError as exc:
            report.differences.append(f"{shown}: the manifest's {where} records it, it cannot be read "
                                      f"({exc.strerror}); {AGAIN}")
            continue
        if size is None:
            report.differences.append(f"{shown}: missing; the manifest's {where} records it ({record.size:,} "
                                      f"bytes); {AGAIN}")
        elif size != record.size:
            report.differences.append(f"{shown}: {size:,} bytes, the manifest's {where} records {record.size:,} "
                                      f"(truncated or changed after the build); {AGAIN}")
        else:
            todo.append((report, path, record, where))
    return todo


def _hashed(bundle: Path, todo: list[tuple]) -> dict[Path, str | None]:
    """Each file's sha256 against its record (differences noted on its report), with progress over the bytes: what
    each hashed to (None: it could not be read)."""
    digests = {}
    total = sum(record.size for _, _, record, _ in todo)
    terminal = progress.console.is_terminal  # a bar there; in a log, progress lines and a line per large file
    with progress.bar() as bar:
        task = bar.add_task(f"verify: hashing {len(todo)} files", total=max(total / 1e6, 1e-6), what="MB")
        for report, path, record, where in todo:
            if not terminal and record.size >= LARGE_FILE:
                progress.console.print(f"hashing {_shown(bundle, path)} ({record.size / 1e9:,.2f} GB)", markup=False,
                                       soft_wrap=True)
            try:
                digest = file_sha256(path, lambda n: bar.advance(task, n / 1e6))
            except OSError:
                digest = None
            digests[path] = digest
            report.hashed_bytes += record.size
            if digest is None:
                report.differences.append(f"{_shown(bundle, path)}: cannot be read; {AGAIN}")
            elif digest != record.sha256:
                report.differences.append(
                    f"{_shown(bundle, path)}: sha256 {digest[:SHOWN_HASH]}, the manifest's {where} records "
                    f"{record.sha256[:SHOWN_HASH]} (changed after the build); {AGAIN}")
    return digests


def _check_pair(bundle: Path, reports: list[PartReport]) -> None:
    """A pair's drafter against its target (``manifests.identity.pair_mismatches``, as ``check-pair``)."""
    by_name = {r.name: r for r in reports}
    target, drafter = by_name.get("target"), by_name.get("drafter")
    if drafter is None or drafter.manifest is None or target is None or target.manifest is None:
        return
    if not isinstance(target.manifest, Manifest) or not isinstance(drafter.manifest, DrafterManifest):
        drafter.differences.append(f"{bundle}: target/ holds a {target.manifest.kind} bundle and drafter/ a "
                                   f"{drafter.manifest.kind} one; {AGAIN}")
        return
    drafter.differences += [f"drafter/{MANIFEST}: not built for target/: {problem}" for problem in
                            identity.pair_mismatches(drafter.manifest, target.manifest, target.folder)]


def _shown(bundle: Path, path: Path) -> str:
    """``path`` relative to the bundle, '/'-separated; a long one cut."""
    try:
        text = path.relative_to(bundle).as_posix()
    except ValueError:
        text = str(path)
    return text if len(text) <= 200 else f"{text[:200]}..."


def verify(bundle: Path, echo) -> None:
    """The ``verify`` command: a line per part (``echo``) when the bundle is whole; else each difference on stderr and
    a GateError naming the first."""
    reports = verify_bundle(bundle)
    first = first_difference(reports)
    if first is None:
        for report in reports:
            if report.manifest is not None:
                paired = report.name == "drafter" and reports[-1].name == "bundle"
                echo(report.line() + ("; built for target/ (check-pair)" if paired else ""))
        return
    count = sum(len(r.differences) for r in reports)
    for report in reports:
        for difference in report.differences:
            echo(f"difference: {difference}", err=True)
    raise GateError(f"verify {bundle}: {count} difference{'s' if count > 1 else ''}, the first: {first}")
