"""Stages in a fresh process (convert/processes.py): the result and the stage's own errors come back; a process that
dies is named, not hung on; a pool of them returns its results in the order of its calls and names the call that
failed; a pool driven from a thread (``InBackground``) returns or raises there and, stopped, ends its running calls
within seconds; and the parted build with every stage in a process of its own gives the bundle of the build in one
process."""

import json
import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main
from convert.errors import InputError
from convert.pipeline import build
from convert.processes import InBackground, Stopped, in_fresh_process, in_fresh_processes
from tests.helpers.pool_calls import held, refuse_or_mark, slept

ROOT = Path(__file__).resolve().parent.parent


def _pid_and_sum(*values: int) -> tuple[int, int]:
    return os.getpid(), sum(values)


def _refuse(name: str) -> None:
    raise InputError(f"{name}: refused")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_stage_runs_in_another_process_and_returns_its_result():
    pid, total = in_fresh_process(_pid_and_sum, 2, 3, 4)
    assert total == 9 and pid != os.getpid()


def test_a_stage_error_is_raised_here_as_itself():
    with pytest.raises(InputError, match="^tensor.x: refused$"):
        in_fresh_process(_refuse, "tensor.x")


def test_a_stage_process_that_dies_is_named():
    with pytest.raises(RuntimeError, match="the process running _die died"):
        in_fresh_process(_die)


def test_a_pool_returns_its_results_in_the_order_of_its_calls():
    """The first call finishes last; two run at once, each in a process of its own (``one_each``), none here."""
    results = in_fresh_processes(slept, [(1.5, 1), (0.0, 2), (0.0, 3)], ["a", "b", "c"], 2, one_each=True)
    assert [value for value, *_ in results] == [1, 2, 3]
    assert len({pid for _, pid, *_ in results}) == 3 and os.getpid() not in {pid for _, pid, *_ in results}
    assert results[1][2] < results[0][3]  # b started while a slept


def test_a_pool_call_that_fails_is_named_and_stops_the_calls_not_started(tmp_path):
    """One process: the call after the failing one never starts; the error keeps its type (its exit code)."""
    calls = [(name, str(tmp_path)) for name in ("embed", "head", "layers")]
    with pytest.raises(InputError, match="^part head, coreml package: head: refused$"):
        in_fresh_processes(refuse_or_mark, calls, [f"part {n}, coreml package" for n, _ in calls], 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embed"]


def _pooled(seconds: float, calls: int, stop=None) -> list:
    return in_fresh_processes(slept, [(seconds, i) for i in range(calls)], [f"call {i}" for i in range(calls)], 2,
                              stop=stop)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_pool_in_the_background_returns_its_results_or_its_error_there():
    running = InBackground(_pooled, 0.0, 3)
    assert [value for value, *_ in running.result()] == [0, 1, 2]
    running.stop()  # a no-op once it has ended
    failing = InBackground(in_fresh_processes, _refuse, [("tensor.y",)], ["part head, coreai package"], 1)
    with pytest.raises(InputError, match="^part head, coreai package: tensor.y: refused$"):
        failing.result()


def test_a_pool_stopped_ends_its_running_calls_and_starts_no_more(tmp_path):
    """Two calls of a minute each running, four more waiting: stopped, it ends within seconds, its running calls
    unwound (each removed its temporary folder) and no process left, the four never started; a pool stopped before it
    starts raises ``Stopped`` saying how many calls were not done."""
    import threading
    import time

    from convert import processes

    started = time.time()
    calls = [(60.0, str(tmp_path), f"call-{i}") for i in range(6)]
    running = InBackground(in_fresh_processes, held, calls, [f"call {i}" for i in range(6)], 2)
    deadline = time.time() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.2)
    children = _children()
    assert len(children) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["call-0", "call-1"]
    running.stop()
    assert time.time() - started < 30 + processes.STOP_POLL_SECONDS
    assert list(tmp_path.iterdir()) == []  # unwound, not killed: their temporaries removed, none started after
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in children)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped, match="^stopped with 3 of 3 calls not done$"):
        _pooled(60.0, 3, stop)


def _children() -> list[int]:
    """The pids of this process's spawned workers (not the resource tracker)."""
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]


def _build(tmp_path: Path, name: str) -> dict:
    text = (ROOT / "recipes" / "tiny_qwen3_5.yaml").read_text().replace(
        "path:../fixtures/", f"path:{ROOT}/fixtures/").replace(
        "  context: 512", "  max_part_mb: 6\n  context: 512").replace(
        "backends: [coreai, coreml]", "backends: [coreml]").replace(
        "data: {samples: 16, length: 256}", "data: {samples: 2, length: 64}")
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(text)
    out = tmp_path / name
    result = CliRunner().invoke(main, ["build", str(recipe), "-o", str(out), "--no-cache"])
    assert result.exit_code == 0, result.output
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.heavy
def test_a_parted_build_in_fresh_processes_gives_the_same_bundle(tmp_path, monkeypatch):
    """Above ``CHAINED_RUN_PARAMETERS`` the quantize stage, the gate and each part run in a process of their own: the
    packages, the parts, the identity hashes and the gate are those of the same build in one process."""
    together = _build(tmp_path, "one-process")
    monkeypatch.setattr(build, "CHAINED_RUN_PARAMETERS", 0)
    apart = _build(tmp_path, "fresh-processes")
    assert len(apart["parts"]) == 6
    assert [p["files"] for p in apart["packages"]] == [p["files"] for p in together["packages"]]
    assert [p["stable_hash"] for p in apart["packages"]] == [p["stable_hash"] for p in together["packages"]]
    assert apart["parts"] == together["parts"] and apart["weights"] == together["weights"]
    assert apart["gate"]["metrics"] == together["gate"]["metrics"]
