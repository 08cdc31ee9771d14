"""Bad input: each case exits 2 with one line naming the file or field, no traceback, and no bundle."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main

GOOD = """\
name: t
target:
  source: path:ckpt
  graphs: {prefill: 16, decode: 1, verify: 8}
  context: 64
  gate: {data: {samples: 2, length: 32}, greedy_tokens: 4}
backends: [coreai]
output: out/bundle
"""


@pytest.fixture
def workdir(tmp_path, tiny_checkpoint, monkeypatch):
    shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_dry(workdir: Path, recipe_text: str):
    (workdir / "r.yaml").write_text(recipe_text)
    result = CliRunner().invoke(main, ["build", "r.yaml", "--dry-run"])
    return result


def assert_refused(result, *needles: str):
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "mutate, needles",
    [
        (lambda t: t.replace("name: t\n", "name: t\n  bad: [\n"), ["r.yaml", "malformed YAML", "line 2"]),
        (lambda t: t.replace("context: 64", "context: 64\n  colour: blue"), ["target.colour", "unknown field"]),
        (lambda t: t.replace("prefill: 16", "prefill: 0"), ["target.graphs.prefill", "greater than 0"]),
        (lambda t: t.replace("verify: 8", "verify: eight"), ["target.graphs.verify", "integer"]),
        (lambda t: t.replace("context: 64", "context: 8"), ["target", "context 8 is smaller"]),
        (lambda t: t.replace("context: 64", "context: 64\n  taps: [1, 1]"), ["target.taps", "duplicated"]),
        (lambda t: t.replace("context: 64", "context: 64\n  taps: [0, 3]"), ["target.taps", "layer 3 is out of range"]),
        (lambda t: t.replace("[coreai]", "[coreai, tflite]"), ["backends.1", "coreai"]),
        (lambda t: t.replace("name: t\n", ""), ["name", "required field is missing"]),
        (lambda t: t.replace("path:ckpt", "path:nowhere"), ["target.source", "does not exist"]),
        (lambda t: t.replace("path:ckpt", "hf://org/model@main"), ["not a commit hash"]),
        (lambda t: t.replace("length: 32}", "length: 80}"), ["target.gate.data.length", "exceeds the context"]),
    ],
    ids=["malformed-yaml", "unknown-field", "zero-width", "wrong-type", "small-context", "dup-taps", "tap-range",
         "backend", "missing-name", "missing-dir", "unpinned", "gate-window"],
)
def test_bad_recipe(workdir, mutate, needles):
    assert_refused(run_dry(workdir, mutate(GOOD)), *needles)


def test_good_recipe_dry_run_plans_without_weights(workdir):
    os.remove(workdir / "ckpt" / "model.safetensors")
    (workdir / "ckpt" / "model.safetensors").write_bytes(b"")  # only headers are read: an empty file is refused
    assert_refused(run_dry(workdir, GOOD), "model.safetensors", "truncated")


def test_dry_run_prints_plan(workdir):
    result = run_dry(workdir, GOOD)
    assert result.exit_code == 0, result.output
    for needle in ["prefill", "decode", "verify", "[1, 16]", "[3, 2, 64, 24]", "parameters:", "peak host memory"]:
        assert needle in result.output
    assert not (workdir / "out").exists()


def _truncate(ckpt: Path):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) - 100])


def _pickle_only(ckpt: Path):
    os.remove(ckpt / "model.safetensors")
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really")


def _missing_shard(ckpt: Path):
    os.remove(ckpt / "model.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def _missing_config(ckpt: Path):
    os.remove(ckpt / "config.json")


def _missing_tensor(ckpt: Path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "damage, needles",
    [
        (_truncate, ["model.safetensors", "truncated"]),
        (_pickle_only, ["pytorch_model.bin", "never unpickles"]),
        (_missing_shard, ["model-00001-of-00002.safetensors", "missing"]),
        (_missing_config, ["config.json", "missing"]),
        (_missing_tensor, ["model.layers.1.mlp.up_proj.weight", "missing"]),
    ],
    ids=["truncated", "pickle-only", "missing-shard", "missing-config", "missing-tensor"],
)
def test_bad_checkpoint_leaves_no_bundle(workdir, damage, needles):
    damage(workdir / "ckpt")
    (workdir / "r.yaml").write_text(GOOD)
    result = CliRunner().invoke(main, ["build", "r.yaml"])
    assert_refused(result, *needles)
    assert not (workdir / "out").exists()


def test_unknown_hf_revision_offline(workdir, tiny_checkpoint):
    cache = workdir / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_checkpoint, snapshot)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    (workdir / "r.yaml").write_text(GOOD.replace("path:ckpt", "hf://org/tiny@" + "b" * 40))
    proc = subprocess.run([sys.executable, "-m", "convert", "build", "r.yaml"], cwd=workdir, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "hf://org/tiny@bbbbbbb" in proc.stderr and "not in the Hugging Face cache" in proc.stderr
    assert not (workdir / "out").exists()


def test_hf_reference_resolves_from_cache_by_short_revision(workdir, tiny_checkpoint, monkeypatch):
    cache = workdir / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / ("4cfb6ad" + "0" * 33)
    shutil.copytree(tiny_checkpoint, snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    result = run_dry(workdir, GOOD.replace("path:ckpt", "hf://org/tiny@4cfb6ad"))
    assert result.exit_code == 0, result.output
    assert "hf://org/tiny@4cfb6ad" in result.output
