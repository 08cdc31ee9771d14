"""A build SIGKILLed in the middle of quantization, and again in the middle of packaging, resumes from the build cache
and publishes the same bundle as a build that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.checkpoints import TOKENIZER_TEXT, write_checkpoint
from tests.helpers.recipes import recipe, tiny_target

pytestmark = pytest.mark.heavy

CORPUS = "path:corpus.txt"
# the seeded random checkpoint in 4 bits is far from its fp32 self: what is tested here is the resume, so every bar
# that compares it with fp32 (the device pass's, the artifact check's near-tie margin too) lets it through
BARS = {"mean_kl_max": 1.0, "p99_kl_max": 5.0, "max_kl_max": 20.0, "top1_min": 0.0, "cosine_min": 0.0,
        "greedy_match_min": 0.0, "block_chain_real_flips_max": 1000, "device_mean_kl_max": 10.0,
        "device_top1_min": 0.0, "device_greedy_match_min": 0.0, "near_tie_margin": 1000.0}
CALIBRATION = {"corpus": CORPUS, "samples": 4, "length": 32}
TARGET = tiny_target("ckpt", graphs={"prefill": 16, "decode": 1, "verify": 4}, context=64,
                     quantization={"method": "lut4-gptq", "calibration": CALIBRATION},
                     gate={"data": {"corpus": CORPUS, "samples": 2, "length": 32}, "greedy_tokens": 4,
                           "thresholds": BARS})
ROOT = Path(__file__).resolve().parent.parent
UNSTABLE = ".odix"  # coreai-core's ODIX lowering orders a table differently run to run (docs/bundle.md)


def start(tmp: Path, output: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "SPEC_CONVERT_CACHE": str(cache), "SOURCE_DATE_EPOCH": "1700000000"}
    log = open(tmp / f"{output}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "convert", "build", str(tmp / "r.yaml"), "--output",
                             str(tmp / output)], cwd=ROOT, env=env, stdout=log, stderr=log)


def kill_when(process: subprocess.Popen, ready, timeout: float = 600) -> None:
    """SIGKILL the build once ``ready()``; its forked packaging worker must die with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if ready():
            children = _children(process.pid)
            process.send_signal(signal.SIGKILL)
            process.wait()
            end = time.monotonic() + 10
            while any(_alive(pid) for pid in children) and time.monotonic() < end:
                time.sleep(0.1)
            assert not [pid for pid in children if _alive(pid)], "a worker outlived its build"
            return
        time.sleep(0.01)
    raise AssertionError(f"the build ended (exit {process.poll()}) before it could be killed where the test wanted")


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    found = []
    for task in tasks.iterdir() if tasks.is_dir() else ():
        children = task / "children"
        if children.is_file():
            found += [int(c) for c in children.read_text().split()]
    return found


def _alive(pid: int) -> bool:
    """Running (a killed child waiting to be reaped by init is a zombie, not alive)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def entries(cache: Path, stage: str) -> int:
    """The stage's finished entries (an entry is written into a hidden ``.KEY.tmp-PID`` folder, then renamed: one
    being written is not counted, or a kill there would count an entry the resumed build cannot reuse)."""
    return sum(not p.parent.name.startswith(".") for p in (cache / stage).glob("*/*/entry.json"))


def comparable(bundle: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        rel = path.relative_to(bundle).as_posix()
        data = path.read_bytes()
        if rel.endswith(UNSTABLE):
            data = b"present"
        elif rel == "gate_report.json":  # measured durations; every value besides them must match
            data = json.dumps(_without_seconds(json.loads(data)), sort_keys=True).encode()
        elif rel == "manifest.json":  # it hashes those two files (outside the export id, which must match)
            data = json.dumps(_without_varying_hashes(json.loads(data)), sort_keys=True).encode()
        files[rel] = data
    return files


def _without_varying_hashes(manifest: dict) -> dict:
    """The manifest without the hashes and sizes of the files whose bytes vary from run to run: its ``records`` (the
    gate report) and the ODIX lowering among its compile outputs."""
    for record in manifest["records"]:
        record.update(sha256="varies", size=0)
    for package in manifest["packages"]:
        for step in package["compile"]:
            for entry in step["files"]:
                if entry["path"].endswith(UNSTABLE):
                    entry.update(sha256="varies", size=0)
    return manifest


def _without_seconds(value):
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def test_a_build_killed_twice_resumes_to_the_same_bundle(tmp_path):
    write_checkpoint(tmp_path / "ckpt", hidden_size=64, num_hidden_layers=6)
    (tmp_path / "corpus.txt").write_text("".join(TOKENIZER_TEXT) * 40)
    recipe(tmp_path / "r.yaml", "resume", target=TARGET, backends=["coreai", "coreml"])
    cache, fresh = tmp_path / "cache", tmp_path / "fresh-cache"

    reference = start(tmp_path, "reference", fresh)
    assert reference.wait() == 0, (tmp_path / "reference.log").read_text()[-3000:]

    first = start(tmp_path, "resumed", cache)  # 6 layers, the lm_head and the embedding: 8 units
    kill_when(first, lambda: entries(cache, "quantize") >= 2)
    stored = entries(cache, "quantize")
    assert 2 <= stored < 8 and not (tmp_path / "resumed").exists()

    second = start(tmp_path, "resumed", cache)
    kill_when(second, lambda: entries(cache, "package") >= 1)
    assert not (tmp_path / "resumed").exists()
    log = " ".join((tmp_path / "resumed.log").read_text().split())  # the console wraps long lines
    assert f"{stored} of 8 units reused, {8 - stored} computed" in log

    third = start(tmp_path, "resumed", cache)
    assert third.wait() == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    log = " ".join((tmp_path / "resumed.log").read_text().split())
    assert "8 of 8 units reused, 0 computed" in log and "restored from the cache" in log
    assert comparable(tmp_path / "resumed") == comparable(tmp_path / "reference")
    manifests = [json.loads((tmp_path / name / "manifest.json").read_text()) for name in ("resumed", "reference")]
    assert manifests[0]["export_id"] == manifests[1]["export_id"]
    assert [r["path"] for r in manifests[0]["records"]] == ["gate_report.json"]
