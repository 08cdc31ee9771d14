"""Issue #41: progress a log can show. With stderr not a terminal (CI, nohup, ``> log``) a build prints a stamped line
when each stage starts, unit lines with the time elapsed and left, and a heartbeat while a stage runs long, so a log
never stays silent for 30 s of work; ``generate`` says what it runs and its tokens per second on stderr, its result
alone on stdout."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert import progress

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny_qwen3.yaml"
STAMP = re.compile(r"^\[(\d+):(\d\d):(\d\d)\] (.*)$")
START = re.compile(r"^\u25b6 (.*?)(?: \(phase (\d+)/(\d+) ([a-z ]+)\))?$")
DONE = re.compile(r"^\u2713 (.*) \(\d+\.\d s\)$")
LOG_GAP_LIMIT = 30  # seconds: the bound on a log's silence while a build works


def stamped(log: str) -> list[tuple[int, str]]:
    """The log's stamped lines: (seconds since the command started, text)."""
    found = []
    for raw in log.splitlines():
        match = STAMP.match(raw)
        if match:
            h, m, s, text = match.groups()
            found.append((int(h) * 3600 + int(m) * 60 + int(s), text))
    return found


def script(tmp_path: Path, body: str, heartbeat: str) -> str:
    """``body`` run in a fresh interpreter with stderr to a file (not a terminal); the file's text."""
    (tmp_path / "run.py").write_text("import time\nfrom convert import progress\nprogress.start_clock()\n" + body)
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.run([sys.executable, str(tmp_path / "run.py")], cwd=ROOT, stderr=err, timeout=120,
                              env={**os.environ, progress.HEARTBEAT_ENV: heartbeat})
    assert proc.returncode == 0, log.read_text()
    return log.read_text()


def test_the_heartbeat_names_a_long_stage(tmp_path):
    """A stage with no sub-steps that sleeps 2 s under a 0.5 s heartbeat: its start line, "still running" lines naming
    it, its end line; a fast stage after it gets no heartbeat."""
    log = script(tmp_path, "with progress.stage('one long unit'):\n    time.sleep(2)\n"
                           "with progress.stage('quick'):\n    pass\n", "0.5")
    texts = [text for _, text in stamped(log)]
    assert texts[0] == "\u25b6 one long unit"
    beats = [t for t in texts if t.startswith("  still running ")]
    assert len(beats) >= 2, log
    assert all(t.startswith("  still running one long unit (") for t in beats), log
    assert DONE.match(texts[len(beats) + 1]).group(1) == "one long unit", log
    assert texts[len(beats) + 2:] == ["\u25b6 quick", texts[-1]] and DONE.match(texts[-1]).group(1) == "quick", log


def test_steps_print_a_line_per_slow_unit(monkeypatch, capsys):
    """Units slower than ``UNIT_SECONDS`` (0 here): a line for each but the last (the end line follows), with the count,
    the time elapsed and the time left; in a log the stage-start line carries the step count."""
    monkeypatch.setattr(progress, "UNIT_SECONDS", 0.0)
    with progress.phases(["one", "two"]):
        progress.phase("two")
        with progress.steps("quantize", 4, "layers") as advance:
            for _ in range(4):
                advance()
    texts = [text for _, text in stamped(capsys.readouterr().err)]
    assert START.match(texts[0]).groups() == ("quantize: 4 layers", "2", "2", "two")
    units = [t for t in texts[1:-1]]
    assert [re.match(r"  quantize: (\d)/4 layers, \d+ s elapsed, about \d+ s left$", t).group(1) for t in units] == \
        ["1", "2", "3"]
    assert DONE.match(texts[-1]).group(1) == "quantize: 4 layers"


def test_units_faster_than_the_interval_are_not_each_a_line(monkeypatch, capsys):
    monkeypatch.setattr(progress, "UNIT_SECONDS", 3600.0)
    with progress.steps("gate", 100, "windows") as advance:
        for _ in range(100):
            advance()
    texts = [text for _, text in stamped(capsys.readouterr().err)]
    assert len(texts) == 2 and texts[0] == "\u25b6 gate: 100 windows" and DONE.match(texts[1]).group(1) == \
        "gate: 100 windows"


def test_units_of_a_stage_name_it(monkeypatch, capsys):
    """``units``: the prompts (calls, parts) of the stage running now, a line each when slow, named by the stage."""
    monkeypatch.setattr(progress, "UNIT_SECONDS", 0.0)
    with progress.stage("accept: 3 prompts x 8 tokens"):
        advance = progress.units(3, "prompts")
        for _ in range(3):
            advance()
    texts = [text for _, text in stamped(capsys.readouterr().err)]
    assert texts[0] == "\u25b6 accept: 3 prompts x 8 tokens"
    assert [t.split(",")[0] for t in texts[1:-1]] == ["  accept: 3 prompts x 8 tokens: 1/3 prompts",
                                                      "  accept: 3 prompts x 8 tokens: 2/3 prompts"]
    assert DONE.match(texts[-1]).group(1) == "accept: 3 prompts x 8 tokens"


def test_a_terminal_keeps_the_live_display_and_prints_end_lines_only(monkeypatch):
    """On a terminal: no start, unit or heartbeat lines (the spinner and the bar say it, with the phase k/n and the
    time left by the plan's estimates), only the end lines."""
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=True, color_system=None, width=200,
                                                          highlight=False))
    monkeypatch.setattr(progress, "UNIT_SECONDS", 0.0)
    assert not progress.lines()
    with progress.phases(["sources", "weights"], {"weights": 3600.0}):
        progress.phase("weights")
        with progress.stage("load weights"):
            advance = progress.units(2, "parts")
            advance()
            advance()
        with progress.steps("quantize", 2, "units") as step:
            step()
            step()
    text = out.getvalue()
    assert "\u25b6" not in text and "still running" not in text
    assert "\u2713 load weights" in text and "\u2713 quantize: 2 units" in text
    # on the spinner: the phase count and the overall time left by the plan's estimates (an hour, less what ran)
    assert re.search(r"phase 2/2 weights, about (1 h 00 min|59 min \d\d s) left by the plan's estimate", text), text


@pytest.fixture(scope="module")
def build_log(tmp_path_factory):
    """The default recipe built by the CLI in a subprocess, stderr to a file; (bundle, log text, wall seconds)."""
    tmp = tmp_path_factory.mktemp("logged")
    log = tmp / "build.log"
    env = {**os.environ, "SPEC_CONVERT_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}  # see test_temporaries
    env.pop(progress.HEARTBEAT_ENV, None)
    start = time.monotonic()
    with log.open("w") as err:
        proc = subprocess.run([sys.executable, "-m", "convert", "build", str(RECIPE), "-o", str(tmp / "bundle")],
                              cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=1200)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, log.read_text()[-3000:]
    return tmp / "bundle", log.read_text(), seconds


@pytest.mark.slow
def test_a_build_log_starts_every_stage_and_never_stays_silent_30_s(build_log):
    _, log, seconds = build_log
    lines = stamped(log)
    starts = [START.match(text) for _, text in lines if START.match(text)]
    done = [DONE.match(text).group(1) for _, text in lines if DONE.match(text)]
    started = [m.group(1) for m in starts]
    assert len(done) >= 8, log  # hash, load, range, package x2, check x2, compile x2, artifact
    missing = [title for title in done if title not in started]
    assert not missing, f"stages that ended with no start line: {missing}\n{log}"
    assert started.index("hash source files") == 0
    assert any(t.startswith("numeric gate: 17 windows") for t in started), started  # 16 + 1 device window
    assert "package coreml: tiny-qwen3.mlpackage (prefill, decode, verify)" in started  # the forked worker's
    phases = {m.group(4): (int(m.group(2)), int(m.group(3))) for m in starts if m.group(2)}
    assert phases["sources"] == (1, 5) and phases["weights"] == (2, 5) and phases["numeric gate"] == (3, 5) and \
        phases["packages"] == (4, 5), phases
    in_time = sorted(lines, key=lambda stamped_line: stamped_line[0])  # two processes print: a second's race
    gaps = [(b - a, text) for (a, _), (b, text) in zip(in_time, in_time[1:], strict=False)]
    worst = max(gaps)
    assert worst[0] <= LOG_GAP_LIMIT, f"{worst[0]} s without a line before {worst[1]!r} (build {seconds:.0f} s)"


@pytest.mark.slow
def test_generate_says_what_it_runs_and_its_tokens_per_second(build_log, tmp_path):
    bundle, _, _ = build_log
    log = tmp_path / "generate.log"
    with log.open("w") as err:
        proc = subprocess.run([sys.executable, "-m", "convert", "generate", str(bundle), "-p", "def add(a, b):",
                               "-n", "4", "--json"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = log.read_text()
    assert proc.returncode == 0, text
    result = json.loads(proc.stdout)  # stdout: the result alone
    assert len(result["generated_ids"]) == 4 and result["runtime"] == "coreai"
    started = [START.match(t).group(1) for _, t in stamped(text) if START.match(t)]
    assert started[0] == "load tiny-qwen3.aimodel on the Core AI runtime"
    assert started[1].startswith("prefill: ") and started[1].endswith(" prompt tokens")
    assert started[2] == "decode: 3 steps at most"
    rate = re.search(r"generated 4 tokens in (\d+\.\d) s: (\d+\.\d\d) tokens/s overall .*; (\d+\.\d\d) tokens/s "
                     r"decoding\)$", text, re.M)
    assert rate is not None, text
    assert float(rate.group(2)) > 0 and float(rate.group(3)) > 0


def test_a_heartbeat_says_the_time_left(tmp_path):
    """A heartbeat line carries the time left: inside a counted run, from its units' rate (4 units of 0.6 s: after the
    first, about 2 s left); outside one, from the running phase's estimate (the plan's); else it says it is not
    known."""
    log = script(tmp_path, (
        "with progress.steps('counted', 4, 'units') as advance:\n"
        "    for _ in range(4):\n        time.sleep(0.6)\n        advance()\n"
        "with progress.phases(['quantize', 'gate'], {'gate': 100.0}):\n"
        "    progress.phase('gate')\n"
        "    with progress.stage('estimated'):\n        time.sleep(1.2)\n"
        "with progress.stage('unknown'):\n    time.sleep(1.2)\n"), "0.5")
    beats = [text for _, text in stamped(log) if text.startswith("  still running ")]
    counted = [t for t in beats if t.startswith("  still running counted: 4 units (")]
    assert counted and all(re.search(r"; about \d+ s left in it \([123]/4 done\)\)$", t) for t in counted[1:]), log
    estimated = [t for t in beats if t.startswith("  still running estimated (")]
    assert estimated and all(re.search(r"; about 1 min 3\d s left in this phase by the plan's estimate\)$", t)
                             for t in estimated), log
    unknown = [t for t in beats if t.startswith("  still running unknown (")]
    assert unknown and all(t.endswith("; time left not known: no counted units)") for t in unknown), log
