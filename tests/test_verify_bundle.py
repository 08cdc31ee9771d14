"""`spec-convert verify` on a real pair bundle (a quantized tiny Qwen3 target and a random DFlash2 drafter, both
formats), every file of it damaged in turn; `inspect`'s summary, `--details` and `--json` on the same bundle.

The bundle is the session's shared dense pair (tests/helpers/pairs.py: one build for this module and
tests/test_pair.py); each check runs in-process on a copy."""

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main
from convert.commands import verify as verify_command
from manifests.identity import REPORT_FILE
from tests.helpers.manifest_samples import recorded_paths
from tests.helpers.pairs import dense_pair

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The session's shared dense pair bundle (tests/helpers/pairs.py); read only."""
    return dense_pair(tmp_path_factory) / "pair"


@pytest.fixture
def bundle(built, tmp_path) -> Path:
    shutil.copytree(built, tmp_path / "pair")
    return tmp_path / "pair"


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def hashed_paths(m: dict) -> list[tuple[str, int]]:
    """(path relative to the part, size) of every file a manifest hashes: those ``recorded_paths`` gives (what a
    command opening the bundle checks), the compile steps' output files and the records (the gate report)."""
    compiled = [(f["path"], f["size"]) for p in m["packages"] for step in p["compile"] for f in step["files"]]
    return recorded_paths(m) + compiled + [(f["path"], f["size"]) for f in m["records"]]


def files_of(bundle: Path) -> list[str]:
    return sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())


def flip(path: Path, at: int | None = None) -> bytes:
    """One byte of ``path`` inverted (the middle one by default); returns the bytes as they were."""
    before = path.read_bytes()
    data = bytearray(before)
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))
    return before


def refused(result, *needles: str) -> str:
    """A failed check: exit 1, the last line of stderr one ``error:`` line naming what differs, no traceback."""
    assert result.exit_code == 1, (result.exit_code, result.output)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: verify ") and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def test_a_whole_pair_verifies_part_by_part(built):
    result = run("verify", built)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2, lines
    for line, part in zip(lines, ("target", "drafter"), strict=True):
        recorded = hashed_paths(manifest(built / part))
        megabytes = sum(size for _, size in recorded) / 1e6
        assert line.startswith(f"ok: {part} ({len(recorded)} files, {megabytes:,.1f} MB hashed)"), line
    assert lines[1].endswith("built for target/ (check-pair)")
    for part in ("target", "drafter"):  # a part alone is a bundle
        result = run("verify", built / part)
        assert result.exit_code == 0 and result.stdout.startswith(f"ok: {part} ("), result.output


def test_a_log_names_each_large_file(built, monkeypatch):
    """stderr not a terminal (a CI log): a line before each file from LARGE_FILE bytes, stdout as it was."""
    monkeypatch.setattr(verify_command, "LARGE_FILE", 100_000)
    result = run("verify", built)
    assert result.exit_code == 0, result.output
    large = sorted(f"{part}/{path}" for part in ("target", "drafter")
                   for path, size in hashed_paths(manifest(built / part)) if size >= 100_000)
    shown = sorted(re.findall(r"hashing (\S+) \([0-9.]+ GB\)", result.stderr))
    assert shown == large and len(large) >= 4, result.stderr
    assert len(result.stdout.splitlines()) == 2


def test_every_file_with_a_flipped_byte_is_named(built, tmp_path):
    """Each file of the bundle with one byte inverted, in turn (then restored): exit 1 naming it, every file but the
    manifests by its sha256 (the manifest's prefix shown), the compile outputs under compiled/ and the gate report
    included; a manifest as damaged. No file of the bundle is exempt."""
    bundle = tmp_path / "pair"
    shutil.copytree(built, bundle)
    hashes = {f"{part}/{path}": sha256 for part in ("target", "drafter") for path, sha256 in _hashes(bundle / part)}
    files = files_of(bundle)
    assert len(files) == len(hashes) + 2, sorted(set(files) ^ set(hashes))  # + the 2 manifests
    # + the gate report, 2 compiled/ a part, the drafter's LICENSE
    assert f"target/{REPORT_FILE}" in hashes and len(hashes) == 22 + 1 + 4 + 1, sorted(hashes)
    assert all(any(name.startswith(f"{part}/compiled/") for name in hashes) for part in ("target", "drafter"))
    checked = []
    for name in files:
        path = bundle / name
        before = flip(path)
        try:
            result = run("verify", bundle)
            if name.endswith("/manifest.json"):
                refused(result, f": {name}: not UTF-8 text")
            else:
                last = refused(result, f": {name}: sha256 ", "changed after the build")
                assert f"records {hashes[name][:12]}" in last, last
            checked.append(name)
        finally:
            path.write_bytes(before)
    assert checked == files
    assert run("verify", bundle).exit_code == 0


def _hashes(folder: Path) -> list[tuple[str, str]]:
    """(path relative to the part, sha256) of each file its manifest hashes."""
    m = manifest(folder)
    found = [(f["path"], f["sha256"]) for f in m["extra_files"] + m["records"]]
    for package in m["packages"]:
        base = package["path"].rpartition("/")[0]
        found += [((f"{base}/" if base else "") + f["path"], f["sha256"]) for f in package["files"]]
        found += [(f["path"], f["sha256"]) for step in package["compile"] for f in step["files"]]
    if m.get("drafter_interface"):
        found += [(m["drafter_interface"][k]["path"], m["drafter_interface"][k]["sha256"])
                  for k in ("lm_head_file", "embeddings_file")]
    return found


def test_the_hashes_outside_the_export_id(built):
    """The gate report (in ``records``) and the compile outputs (``compile[].files``) are hashed where the export id
    does not reach: a manifest without them keeps its export id, and verify names each file as unhashed."""
    from manifests.identity import export_id
    from manifests.schema import Manifest

    m = manifest(built / "target")
    assert m["records"] == [next({"path": p, "sha256": h, "size": (built / "target" / p).stat().st_size}
                                 for p, h in _hashes(built / "target") if p == REPORT_FILE)]
    stripped = json.loads(json.dumps(m))
    stripped["records"] = []
    for package in stripped["packages"]:
        for step in package["compile"]:
            step["files"] = []
    assert export_id(Manifest.model_validate(stripped).identity()) == m["export_id"]


def test_a_bundle_whose_manifest_hashes_neither(bundle):
    """A target manifest as built before the records and the compile outputs' hashes (its export id unchanged): its
    gate report and compile outputs are differences, each named."""
    m = manifest(bundle / "target")
    m["records"] = []
    for package in m["packages"]:
        for step in package["compile"]:
            step["files"] = []
    (bundle / "target" / "manifest.json").write_text(json.dumps(m))
    result = run("verify", bundle)
    refused(result, f"target/{REPORT_FILE}: in the bundle, not in its manifest")
    compiled = [line for line in result.stderr.splitlines() if line.startswith("difference: target/compiled/")]
    assert len(compiled) == 2 and all("a compile output its manifest names without a hash" in line
                                      for line in compiled), result.stderr


def test_compile_rehashes_its_outputs(bundle):
    """``spec-convert compile`` writes the ODIX lowering again (its bytes differ run to run) and records the new
    hashes: the bundle verifies after it, its export id unchanged."""
    before = {part: manifest(bundle / part) for part in ("target", "drafter")}
    result = run("compile", bundle)
    assert result.exit_code == 0, result.output
    for part, m in before.items():
        after = manifest(bundle / part)
        assert after["export_id"] == m["export_id"] and after["records"] == m["records"]
        assert [[f["path"] for s in p["compile"] for f in s["files"]] for p in after["packages"]] == \
            [[f["path"] for s in p["compile"] for f in s["files"]] for p in m["packages"]]
    result = run("verify", bundle)
    assert result.exit_code == 0, result.output


def test_every_difference_is_listed_and_the_first_named(bundle):
    """Two files damaged: both listed on stderr, the error names the first, a truncated one by its sizes."""
    weights = bundle / "target" / "pair.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 1)
    flip(bundle / "drafter" / "selector.safetensors")
    files = manifest(bundle / "target")["packages"][1]["files"]
    j = next(j for j, f in enumerate(files) if f["path"].endswith("weights/weight.bin"))
    result = run("verify", bundle)
    last = refused(result, "2 differences, the first: target/pair.mlpackage/Data/com.apple.CoreML/weights/weight.bin: "
                   f"{size - 1:,} bytes, the manifest's packages[1].files[{j}] records {size:,}")
    differences = [line for line in result.stderr.splitlines() if line.startswith("difference: ")]
    assert len(differences) == 2 and "drafter/selector.safetensors: sha256" in differences[1], result.stderr
    assert last.endswith("copy the bundle again or rebuild it")


def test_a_missing_file(bundle):
    (bundle / "target" / "lm_head.safetensors").unlink()
    refused(run("verify", bundle), "target/lm_head.safetensors: missing; the manifest's drafter_interface.lm_head_file "
            "records it")


def test_extra_files_are_differences(bundle):
    (bundle / "target" / "pair.aimodel" / "notes.txt").write_text("hello")
    refused(run("verify", bundle), "target/pair.aimodel/notes.txt: in the bundle, not in its manifest (5 bytes)")
    (bundle / "target" / "pair.aimodel" / "notes.txt").unlink()
    (bundle / "README").write_text("x")
    refused(run("verify", bundle), "README: in the bundle, not in a part of the pair")
    (bundle / "README").unlink()
    assert run("verify", bundle).exit_code == 0


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["architecture"].update(num_layers=0), "target/manifest.json: architecture.num_layers: Input should "
                                                       "be greater than or equal to 1"),
    (lambda m: m["extra_files"][0].update(path="../x"), "target/manifest.json: extra_files.0.path: a relative path"),
    (lambda m: m["gate"]["metrics"].update(kl_mean=0.0), "target/manifest.json: export_id: it records "),
    (lambda m: m["packages"][0]["files"][0].update(sha256="0" * 64), "target/manifest.json: export_id: it records "),
], ids=["off-schema", "path-outside", "edited-metric", "edited-hash"])
def test_a_damaged_manifest_is_a_failed_check(bundle, edit, needle):
    """Off its schema (named by field) or edited after the build (its export id): exit 1, not 2 (bad input)."""
    m = manifest(bundle / "target")
    edit(m)
    (bundle / "target" / "manifest.json").write_text(json.dumps(m))
    refused(run("verify", bundle), needle)


def test_a_drafter_bound_to_another_target(bundle):
    """The drafter's binding differs from its target's manifest (rewritten with a matching export id): the pair check
    names the field."""
    from manifests.identity import export_id
    from manifests.schema import DrafterManifest

    m = manifest(bundle / "drafter")
    m["target"]["taps"]["layers"] = [0, 1, 3]
    m["export_id"] = export_id(DrafterManifest.model_validate(m).identity())
    (bundle / "drafter" / "manifest.json").write_text(json.dumps(m))
    refused(run("verify", bundle), "drafter/manifest.json: not built for target/: target.taps.layers")


def test_a_pair_without_its_drafter_manifest(bundle):
    (bundle / "drafter" / "manifest.json").unlink()
    refused(run("verify", bundle), "drafter/manifest.json: missing")


def test_not_a_bundle_is_bad_input(tmp_path):
    for path in (tmp_path, tmp_path / "nothing-here"):
        result = run("verify", path)
        assert result.exit_code == 2 and result.stderr.startswith(f"error: {path}"), result.output
        assert "not a" in result.stderr and "Traceback" not in result.output


# --- inspect -------------------------------------------------------------------------------------------------------


def numbers(line: str, label: str) -> float:
    match = re.search(rf"{re.escape(label)} ([-+0-9.e]+)", line)
    assert match, (label, line)
    return float(match.group(1))


def test_inspect_summarises_the_gate_quantization_and_lint(built):
    result = run("inspect", built)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    target, drafter = manifest(built / "target"), manifest(built / "drafter")
    gate = next(line for line in lines if line.startswith("  gate passed: "))
    for label, key in (("mean KL", "kl_mean"), ("top-1", "top1"), ("greedy", "greedy_match")):
        assert numbers(gate, label) == pytest.approx(target["gate"]["metrics"][key], rel=1e-3), (label, gate)
    device = next(line for line in lines if line.startswith("  device pass (gpu arithmetic) passed: "))
    for label, key in (("mean KL", "kl_mean"), ("top-1", "top1")):
        assert numbers(device, label) == pytest.approx(target["gate"]["device"]["metrics"][key], rel=1e-3)
    assert any(line.startswith("  quantization affine4, 4 bits, group 32 (") for line in lines)
    assert any(line.startswith("  quantization lut4, 4 bits, group 16 (") for line in lines)
    assert f"  acceptance: {drafter['acceptance']['tokens_per_round']:.3f} tokens per round, lossless True" in lines
    lint = [line for line in lines if line.startswith("  package ")]
    packages = target["packages"] + drafter["packages"]
    assert len(lint) == 4 and all(p["placement"] for p in packages)
    for line, package in zip(lint, packages, strict=True):  # stateful: findings expected, counted
        assert line.startswith(f"  package {package['path']} ({package['format']}, ")
        assert f"placement lint {len(package['placement'])} findings, expected for the stateful layout (the GPU " \
               "runs its programs" in line
    assert not any(finding in result.stdout for finding in packages[0]["placement"])  # behind --details
    assert len(lines) < 25


def test_the_build_says_the_lint_counts_are_expected_for_the_stateful_layout(built):
    from convert.verify.placement import REFERENCE

    shown = " ".join((built.parent / "build-output.txt").read_text().split())  # rich wraps its lines
    for part in ("target", "drafter"):
        for package in manifest(built / part)["packages"]:
            assert (f"placement lint ({package['format']} {package['path']}): {len(package['placement'])} findings "
                    f"against {REFERENCE}; expected for the stateful layout (the GPU runs its programs; the lint "
                    "measures against the ANE)") in shown, package["path"]


def test_inspect_details_lists_every_finding(built):
    result = run("inspect", built / "target", "--details")
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())  # rich wraps the details
    for finding in manifest(built / "target")["packages"][0]["placement"]:
        assert " ".join(finding.split()) in shown


def test_inspect_json_is_the_manifest(built):
    result = run("inspect", built, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"target": manifest(built / "target"), "drafter": manifest(built / "drafter")}
    result = run("inspect", built / "drafter", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == manifest(built / "drafter")


def test_inspect_states_what_the_lint_means_in_the_ane_layout(tmp_path):
    """A sample manifest edited to the ane layout (no states) with one finding: it matters, not expected."""
    from tests.helpers.manifest_samples import target_manifest, write_bundle

    m = target_manifest()
    for function in m["functions"]:
        function["states"] = []
    m["packages"][0]["placement"] = ["decode: op gather: not in forge's graphs"]
    result = run("inspect", write_bundle(tmp_path / "b", m))
    assert result.exit_code == 0, result.output
    assert "ane layout" in result.stdout
    assert "placement lint 1 findings, these matter in the ane layout" in result.stdout
    assert "device pass: not recorded" in result.stdout and "quantization none (fp16 weights)" in result.stdout
