"""Two builds' bundles compared file by file (tests/test_package_pool.py, tests/test_exact_build.py): what differs run
to run is set apart."""

import hashlib
import json
from pathlib import Path

# what differs run to run in any two builds (bench/bundle_hashes.py's RUN_TO_RUN): the gate report (its timings) and
# the Core AI runtime's ODIX lowering (one .aimodel lowered twice gave two .odix files)
RUN_TO_RUN_FILE = "gate_report.json"
RUN_TO_RUN_SUFFIX = ".odix"


def files(bundle: Path) -> dict[str, str]:
    """sha256 of every file of the bundle by its path; "varies" for the run-to-run files and the manifests (compared
    apart), a pair's halves' too."""
    found = {}
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        name = path.relative_to(bundle).as_posix()
        varies = path.name in (RUN_TO_RUN_FILE, "manifest.json") or name.endswith(RUN_TO_RUN_SUFFIX)
        found[name] = "varies" if varies else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def comparable_manifest(bundle: Path) -> dict:
    """The manifest less the hashes of the run-to-run files (its ``records``: the gate report; the .odix files)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest.pop("records", None)  # a drafter's manifest has none
    for package in manifest["packages"]:
        for step in package["compile"]:
            for file in step.get("files") or []:
                if file["path"].endswith(RUN_TO_RUN_SUFFIX):
                    file["sha256"] = "run to run"
    return manifest
