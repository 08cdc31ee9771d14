"""End-to-end builds of a seeded tiny Qwen3: bundle contents, weight sharing, reproducibility, identity, atomicity."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from convert.cli import main
from manifests.identity import tensor_sha256
from manifests.schema import SCHEMA_PATH, json_schema

RECIPE = """\
name: tiny
target:
  source: path:{source}
  graphs: {{prefill: 16, decode: 1, verify: 8}}
  context: 64
  taps: [2, 0]
  logits: true
  gate:  # random weights have near-flat logits: fp16 rounding flips a few argmax ids
    data: {{samples: 4, length: 40}}
    greedy_tokens: 8
    thresholds: {{device_top1_min: 0.95, top1_min: 0.95, greedy_match_min: 0.5}}
"""

pytestmark = pytest.mark.slow


def build(tmp: Path, source: Path, out: str, extra: str = "", *options: str) -> tuple[int, str]:
    recipe = tmp / f"{out}.yaml"
    recipe.write_text(RECIPE.format(source=source) + extra)
    result = CliRunner().invoke(main, ["build", str(recipe), "--output", str(tmp / out), *options])
    return result.exit_code, result.output


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_checkpoint):
    tmp = tmp_path_factory.mktemp("builds")
    code, output = build(tmp, tiny_checkpoint, "a")
    assert code == 0, output
    return tmp, tmp / "a"


def test_bundle_contents(built):
    _, bundle = built
    m = manifest(bundle)
    jsonschema.validate(m, json_schema())
    assert (bundle / "LICENSE").read_text() == "Apache-2.0 test license\n"
    assert (bundle / "tokenizer" / "tokenizer.json").is_file()
    assert [f["name"] for f in m["functions"]] == ["prefill", "decode", "verify"]
    assert {p["format"]: p["path"] for p in m["packages"]} == {"coreai": "tiny.aimodel", "coreml": "tiny.mlpackage"}
    verify = next(f for f in m["functions"] if f["name"] == "verify")
    assert verify["outputs"] == [
        {"name": "argmax_ids", "shape": [1, 8], "dtype": "int32"},
        {"name": "taps", "shape": [1, 8, 128], "dtype": "float16"},
        {"name": "logits", "shape": [1, 8, 4096], "dtype": "float16"},
    ]
    assert m["taps"]["layers"] == [2, 0] and "hidden_states[i+1]" in m["taps"]["convention"]
    assert m["tokenizer"]["bos_id"] == 0 and m["tokenizer"]["eos_id"] == 1 and m["tokenizer"]["pad_id"] == 2
    coreai = next(p for p in m["packages"] if p["format"] == "coreai")
    assert coreai["check"]["argmax_compared"] >= 16 and coreai["check"]["max_output_delta"] < 2e-2
    coreml = next(p for p in m["packages"] if p["format"] == "coreml")
    assert coreml["check"]["weights_bit_exact"] is True
    assert {c["kind"]: c["status"] for c in coreml["compile"]} == {"coremlcompiler": "deferred"}


def test_weights_stored_once(built):
    _, bundle = built
    weight_bytes = 2 * manifest(bundle)["weights"]["parameter_count"]
    mlirb = (bundle / "tiny.aimodel" / "main.mlirb").stat().st_size
    weight_bin = (bundle / "tiny.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").stat().st_size
    assert mlirb < 1.2 * weight_bytes, (mlirb, weight_bytes)
    assert weight_bin < 1.2 * weight_bytes, (weight_bin, weight_bytes)


def test_schema_file_is_current():
    assert json.loads(SCHEMA_PATH.read_text()) == json_schema(), "run `python -m manifests.schema`"


def test_rebuild_is_identical(built, tiny_checkpoint):
    tmp, first = built
    code, output = build(tmp, tiny_checkpoint, "b")
    assert code == 0, output
    # the same target, data and thresholds: the gate's report comes from the build cache, not a second run
    assert output.count("\u2713 numeric gate: restored from the cache") == 1  # its end line (a log has a start line)
    a, b = manifest(first), manifest(tmp / "b")
    assert a["built_at"] and b["built_at"]
    a.pop("built_at"), b.pop("built_at")
    assert a == b
    for package in a["packages"]:
        for f in package["files"]:
            assert (first / f["path"]).read_bytes() == (tmp / "b" / f["path"]).read_bytes(), f["path"]


def _leaves(data, prefix="") -> dict:
    if isinstance(data, dict):
        return {k: v for key, val in data.items() for k, v in _leaves(val, f"{prefix}{key}.").items()}
    if isinstance(data, list):
        return {k: v for i, val in enumerate(data) for k, v in _leaves(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): data}


def test_lm_head_hash_tracks_one_value(built, tiny_checkpoint):
    tmp, first = built
    source = tmp / "ckpt-edited"
    shutil.copytree(tiny_checkpoint, source)
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"][7, 3] += 0.5
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    code, output = build(tmp, source, "c")
    assert code == 0, output
    a, c = _leaves(manifest(first)), _leaves(manifest(tmp / "c"))
    changed = {k for k in a if a[k] != c.get(k)} - {"built_at", "source.reference"}
    model_file = next(i for i, f in enumerate(manifest(first)["source"]["files"]) if f["path"] == "model.safetensors")
    assert "weights.lm_head_sha256" in changed and "export_id" in changed
    assert f"source.files.{model_file}.sha256" in changed
    # package bytes and hashes, checks and gate (its device pass too) of the new head
    allowed_prefixes = ("packages.", "gate.metrics.", "gate.device.metrics.", "gate.device.range.",
                        "rescale.tightest.",  # the peaks of the new head are measured too
                        "records.")  # the gate report's hash
    unexpected = {k for k in changed if not k.startswith(allowed_prefixes)} - {
        "weights.lm_head_sha256", "export_id", f"source.files.{model_file}.sha256",
        "drafter_interface.lm_head_file.sha256"}  # a target with taps ships lm_head.safetensors for its drafter
    assert unexpected == set()
    assert "drafter_interface.lm_head_file.sha256" in changed
    assert a["weights.embedding_sha256"] == c["weights.embedding_sha256"]
    assert a["drafter_interface.embeddings_file.sha256"] == c["drafter_interface.embeddings_file.sha256"]
    assert {k for k in changed if k.endswith("stable_hash")} == {"packages.0.stable_hash", "packages.1.stable_hash"}


def test_failed_build_keeps_the_good_bundle(built, tiny_checkpoint, monkeypatch):
    tmp, _ = built
    code, output = build(tmp, tiny_checkpoint, "d", "backends: [coreml]\n")
    assert code == 0, output
    before = (tmp / "d" / "manifest.json").read_bytes()

    from convert.errors import PackageError
    from convert.verify import checks

    def broken(*args, **kwargs):
        raise PackageError("tiny.mlpackage: function decode: weight x is not stored bit for bit")

    monkeypatch.setattr(checks, "check_package", broken)  # not in the cache key: package again, without it
    code, output = build(tmp, tiny_checkpoint, "d", "backends: [coreml]\n", "--no-cache")
    assert code == 1 and "not stored bit for bit" in output
    assert (tmp / "d" / "manifest.json").read_bytes() == before
    assert not [p for p in tmp.iterdir() if p.name.startswith(".d.")]


def test_inspect_and_compile(built):
    _, bundle = built
    result = CliRunner().invoke(main, ["inspect", str(bundle)])
    assert result.exit_code == 0, result.output
    assert "tiny" in result.output and "verify" in result.output
    export_id = manifest(bundle)["export_id"]
    result = CliRunner().invoke(main, ["compile", str(bundle)])
    assert result.exit_code == 0, result.output
    assert "deferred" in result.output
    assert manifest(bundle)["export_id"] == export_id


def test_tied_head_hashes_the_shared_tensor(tmp_path):
    from tests.helpers.checkpoints import write_checkpoint

    write_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    code, output = build(tmp_path, tmp_path / "tied", "t", "backends: [coreml]\n")
    assert code == 0, output
    w = manifest(tmp_path / "t")["weights"]
    assert w["lm_head_tied"] is True and w["lm_head_sha256"] == w["embedding_sha256"]
    shipped = load_file(tmp_path / "tied" / "model.safetensors")["model.embed_tokens.weight"].to(torch.float16)
    assert w["embedding_sha256"] == tensor_sha256(shipped)


def test_failing_gate_publishes_nothing(tmp_path, tiny_checkpoint):
    code, output = build(tmp_path, tiny_checkpoint, "g")
    assert code == 0, output
    recipe = (tmp_path / "g.yaml").read_text()
    (tmp_path / "g.yaml").write_text(recipe.replace("greedy_match_min: 0.5}", "greedy_match_min: 0.5, mean_kl_max: 0}"))
    before = (tmp_path / "g" / "manifest.json").read_bytes()
    result = CliRunner().invoke(main, ["build", str(tmp_path / "g.yaml"), "--output", str(tmp_path / "g")])
    assert result.exit_code == 1, result.output
    assert "restored from the cache" not in result.output  # other thresholds: the gate runs again
    assert "numeric gate failed: kl_mean" in result.output and "FAIL" in result.output
    report = json.loads((tmp_path / "g.gate_report.json").read_text())
    assert report["passed"] is False
    assert next(m for m in report["metrics"] if m["name"] == "kl_mean")["passed"] is False
    assert (tmp_path / "g" / "manifest.json").read_bytes() == before  # the good bundle stays, nothing new
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".g.")]


def test_gate_command_on_a_bundle(built, tmp_path, monkeypatch):
    tmp, bundle = built
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["gate", str(tmp / "a.yaml")])  # no --report: the table, no file anywhere
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "gate passed" and "kl_mean" in result.output
    assert list(tmp_path.iterdir()) == []  # no gate_report.json in the current directory
    report = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["gate", str(tmp / "a.yaml"), "--bundle", str(bundle), "--report", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["passed"] is True and data["artifact"]["passed"] is True and data["artifact"]["argmax_compared"] > 0
    assert data["data"]["corpus"] == "fixture:eval" and data["data"]["n"] == 4
    assert manifest(bundle)["gate"]["metrics"]["kl_mean"] == pytest.approx(
        next(m["value"] for m in data["metrics"] if m["name"] == "kl_mean"))
    bad = (tmp / "a.yaml").read_text().replace(" top1_min: 0.95", " top1_minimum: 0.95")
    (tmp_path / "bad.yaml").write_text(bad)
    result = CliRunner().invoke(main, ["gate", str(tmp_path / "bad.yaml")])
    assert result.exit_code == 2 and "target.gate.thresholds.top1_minimum: unknown metric" in result.output


@pytest.mark.parametrize("runtime", ["coreai", "torch"])
def test_generate_on_a_dense_bundle(built, tiny_checkpoint, runtime):
    """`spec-convert generate` drives a dense bundle too: the same ids as transformers' greedy generation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, bundle = built
    prompt = "def add(a, b):\n    return"
    ids = AutoTokenizer.from_pretrained(str(tiny_checkpoint)).encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids) :].tolist()
    args = ["generate", str(bundle), "--prompt", prompt, "-n", "6", "--runtime", runtime, "--json"]
    result = CliRunner().invoke(main, args + (["--recipe", str(tmp / "a.yaml")] if runtime == "torch" else []))
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["prompt_ids"] == ids and out["generated_ids"] == want


def test_an_ane_layout_bundle(built, tiny_checkpoint):
    """``layout: ane``: both formats build and check with no states (the host's history in, each call's rows out), no
    lookup and no argmax (the host's), so the placement lint finds nothing (``--strict`` passes), with a ladder entry
    at 32 rows beside the 64-row functions, and the bundle generates the stateful bundle's ids on the Core AI runtime
    and in torch."""
    tmp, stateful = built
    code, output = build(tmp, tiny_checkpoint, "ane", "  layout: ane\n  ladder: [32]\n", "--strict")
    assert code == 0, output
    assert "key_history [3, 2, 64, 24] float16: 18.00 KiB" in output and "host buffers: 0.0 MiB in all" in output
    bundle = tmp / "ane"
    m = manifest(bundle)
    jsonschema.validate(m, json_schema())
    assert set(m["host_contract"]["buffers"]) == {"key_history", "value_history"}
    verify = next(f for f in m["functions"] if f["name"] == "verify")
    assert [f["name"] for f in m["functions"]] == ["prefill", "decode", "verify", "prefill_32", "decode_32",
                                                   "verify_32"]  # the ladder's entries: 32 rows of history
    assert m["host_contract"]["ladder"] == [32]
    rung = next(f for f in m["functions"] if f["name"] == "verify_32")
    assert {"name": "key_history", "shape": [3, 2, 32, 24], "dtype": "float16"} in rung["inputs"]
    assert [t["name"] for t in verify["inputs"]] == ["hidden_states", "rope_cos", "rope_sin", "history_mask",
                                                     "key_history", "value_history"]
    assert [t["name"] for t in verify["outputs"]] == ["taps", "logits", "key_rows", "value_rows"]
    assert m["host_contract"]["embedding"] == {"input": "hidden_states", "file": "embeddings.safetensors"}
    assert m["host_contract"]["argmax"] == "host" and (bundle / "embeddings.safetensors").is_file()
    a = m["architecture"]
    assert m["host_contract"]["positions"] == {"rope_theta": a["rope_theta"], "rotary_dim": a["head_dim"],
                                               "first_row": 0}
    assert {"name": "key_rows", "shape": [3, 2, 8, 24], "dtype": "float16"} in verify["outputs"]
    coreai = next(p for p in m["packages"] if p["format"] == "coreai")
    assert coreai["check"]["argmax_compared"] >= 16 and coreai["check"]["max_output_delta"] < 2e-2
    assert next(p for p in m["packages"] if p["format"] == "coreml")["check"]["weights_bit_exact"] is True
    from convert import backends

    for fmt, package in (("coreai", "tiny.aimodel"), ("coreml", "tiny.mlpackage")):
        specs = backends.load(fmt).read_back(bundle / package)
        assert all(spec.states == () for spec in specs.values()), fmt
    # the placement lint: the stateful packages keep states and scatter into them, look rows up and take the argmax;
    # the ane ones hold none of it (docs/layouts.md)
    for package in manifest(stateful)["packages"]:
        assert any("keeps 2 states" in f for f in package["placement"]), package["format"]
    assert [package["placement"] for package in m["packages"]] == [[], []]
    shown = " ".join(CliRunner().invoke(main, ["inspect", str(bundle), "--details"]).output.split())  # rich wraps
    assert "host buffer key_history: the host writes each call's key_rows into it along axis 2" in shown
    assert "placement lint tiny.aimodel: no finding" in shown
    code, output = build(tmp, tiny_checkpoint, "a-strict", "", "--strict")
    assert code == 1 and "--strict: the placement lint found" in output and not (tmp / "a-strict").exists()
    prompt = "def add(a, b):\n    return"
    generated = {}
    runs = (("a", stateful, "coreai"), ("ane", bundle, "coreai"), ("ane", bundle, "torch"))
    for name, folder, runtime in runs:
        args = ["generate", str(folder), "--prompt", prompt, "-n", "6", "--runtime", runtime, "--json"]
        recipe = ["--recipe", str(tmp / f"{name}.yaml")] if runtime == "torch" else []
        result = CliRunner().invoke(main, args + recipe)
        assert result.exit_code == 0, result.output
        generated[name, runtime] = json.loads(result.output.strip().splitlines()[-1])["generated_ids"]
    assert generated["ane", "coreai"] == generated["ane", "torch"] == generated["a", "coreai"]
    # parted: the part with layers takes their history and the host's embedding rows (there is no embedding part);
    # gated one piece at a time, chained on the runtime (tests/test_parts.py splits the layers and the head in torch)
    code, output = build(tmp, tiny_checkpoint, "ane-parted", "  layout: ane\n  max_part_mb: 0.6\n")
    assert code == 0, output
    parts = manifest(tmp / "ane-parted")["parts"]
    assert [(p["name"], p["embedding_rows"]) for p in parts] == [("layers-0-2", [0, 4096]), ("head", None)]
    assert f"artifact gate: {len(parts)} parts chained on the Core AI runtime" in output
    assert all(("key_history" in {t["name"] for t in f["inputs"]}) == (p["layers"][1] > p["layers"][0])
               for p in parts for f in p["functions"])
    result = CliRunner().invoke(main, ["generate", str(tmp / "ane-parted"), "--prompt", prompt, "-n", "6", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["generated_ids"] == generated["a", "coreai"]


# `spec-convert generate` with the threads that hand results to the event loop (the Core AI runtime's) held up to 3 s
# after they wake it (the self-pipe write), as the OS deschedules them on a loaded machine; they take the GIL back every
# millisecond, so one still held when the interpreter shuts down meets the shutdown, as in issue #21.
HELD_BACK = """\
import asyncio.selector_events, sys, threading, time
from convert.cli import main
write = asyncio.selector_events.BaseSelectorEventLoop._write_to_self
def held_back(loop):
    write(loop)
    end = time.monotonic() + 3
    while threading.get_ident() != threading.main_thread().ident and time.monotonic() < end:
        time.sleep(0.001)
asyncio.selector_events.BaseSelectorEventLoop._write_to_self = held_back
main(sys.argv[1:], prog_name="spec-convert")
"""


def test_generate_exits_0_every_time(built, tiny_checkpoint):
    """Issue #21: `generate` printed its text, then aborted (exit 134, the Swift runtime's "C++ exception handling
    detected ...") in 3 runs of 14 (as reported): a runtime thread handing the last result back met the
    interpreter's shutdown. Fresh processes, as a user runs it; the runs with the runtime's threads held back aborted
    every time before the fix (``convert/backends/coreai.py``'s ``_RuntimeLoop``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, bundle = built
    prompt = "def add(a, b):\n    return"
    ids = AutoTokenizer.from_pretrained(str(tiny_checkpoint)).encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids) :].tolist()
    args = ["generate", str(bundle), "--prompt", prompt, "-n", "3", "--json"]
    plain = [str(Path(sys.executable).with_name("spec-convert"))]
    held = [sys.executable, "-P", "-c", HELD_BACK]
    for command in (plain, held, held):  # the held-back runs aborted every time before the fix
        result = subprocess.run(command + args, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, (command[-1][:40], result.returncode, result.stderr[-2000:])
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out["prompt_ids"] == ids and out["generated_ids"] == want
