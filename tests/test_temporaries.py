"""Issue #41: nothing leaked. A build, failed, interrupted or successful, leaves nothing in the system temp dir:
each runs the CLI in a subprocess with a private ``TMPDIR`` (and build cache), and the folder holds afterwards exactly
what it held before (the names of anything left are the failure message).

coremltools makes a temporary ``.mlpackage`` per conversion and removes it only at interpreter exit
(``convert/backends/coreml.py`` ``_temporaries_in`` / ``_save_and_release``); coreai-torch writes its packages
through temporary files; torch makes its compile-cache folder (``torchinductor_<user>``) in the temp dir when
``torch._dynamo`` is first imported (the CLI points it beside the build cache).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny_qwen3.yaml"
INTERRUPTED = "interrupted: nothing was published"


def environment(tmp: Path) -> dict[str, str]:
    (tmp / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp / "tmp"), "SPEC_CONVERT_CACHE": str(tmp / "cache"),
           "OMP_NUM_THREADS": "1"}  # one torch thread: two spin-wait for each other on a shared 2-core machine
    for name in ("TEMP", "TMP", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(name, None)
    return env


def entries(tmp: Path) -> set[str]:
    return {p.name for p in (tmp / "tmp").iterdir()}


def assert_nothing_left(tmp: Path, before: set[str], what: str) -> None:
    left = sorted(entries(tmp) - before)
    assert not left, f"{what} left in the temp dir: {left}"


def recipe(tmp: Path, gate: str = "") -> Path:
    """The default recipe with its source as an absolute path (and ``gate`` as its target's gate section)."""
    text = RECIPE.read_text().replace("path:../fixtures", f"path:{ROOT / 'fixtures'}")
    if gate:
        head, _, rest = text.partition("  gate:\n")
        text = head + gate + rest.split("\n", 1)[1]
    path = tmp / "r.yaml"
    path.write_text(text)
    return path


def cli(tmp: Path, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "convert", *args], cwd=tmp, env=environment(tmp),
                          capture_output=True, text=True, timeout=timeout)


def interrupted(tmp: Path, after: str, *args: str) -> tuple[int, str]:
    """The CLI interrupted as Ctrl-C does (SIGINT to its process group: the forked workers too) once a stderr line
    holds ``after``; (exit code, stderr)."""
    env = environment(tmp)
    proc = subprocess.Popen([sys.executable, "-m", "convert", *args], cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # a shell's background job ignores SIGINT, and so would the CLI it starts: as a terminal's
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if after in line:
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest = proc.stderr.read()
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, "".join(seen) + rest


@pytest.mark.slow
def test_a_failed_build_leaves_no_temporaries(tmp_path):
    """A gate no build passes (``mean_kl_max: 0``): exit 1, no bundle, the temp dir as it was."""
    environment(tmp_path)
    before = entries(tmp_path)
    path = recipe(tmp_path, "  gate:\n    data: {samples: 2, length: 64}\n    thresholds: {mean_kl_max: 0}\n")
    done = cli(tmp_path, "build", str(path), "-o", str(tmp_path / "out"))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "numeric gate failed: kl_mean" in done.stderr
    assert not (tmp_path / "out").exists()
    assert_nothing_left(tmp_path, before, "a failed build")


@pytest.mark.slow
def test_an_interrupted_build_leaves_no_temporaries(tmp_path):
    """Ctrl-C once the first stage has started: exit 130, the one message, no bundle, the temp dir as it was."""
    environment(tmp_path)
    before = entries(tmp_path)
    code, err = interrupted(tmp_path, "\u25b6 ", "build", str(recipe(tmp_path)), "-o", str(tmp_path / "out"))
    assert code == 130, err[-3000:]
    assert INTERRUPTED in err
    assert not (tmp_path / "out").exists()
    assert_nothing_left(tmp_path, before, "an interrupted build")


@pytest.mark.heavy
def test_a_successful_build_and_builds_interrupted_while_packaging_leave_no_temporaries(tmp_path):
    """The default recipe built whole (both formats packaged side by side, checked on the Core AI runtime), then built
    again with no cache and interrupted while Core ML converts in the forked worker (its coremltools temporaries
    exist then), and once more while the Core AI runtime runs the package (coreai's ``.aimodelx`` temporary exists
    then): nothing left after any."""
    environment(tmp_path)
    before = entries(tmp_path)
    path = recipe(tmp_path)
    done = cli(tmp_path, "build", str(path), "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert_nothing_left(tmp_path, before, "a successful build")
    for at in ("package coreml", "check coreai"):
        out = tmp_path / at.replace(" ", "-")
        code, err = interrupted(tmp_path, f"\u25b6 {at}", "build", str(path), "-o", str(out), "--no-cache")
        assert code == 130, err[-3000:]
        assert INTERRUPTED in err
        assert not out.exists()
        assert_nothing_left(tmp_path, before, f"a build interrupted at {at}")
