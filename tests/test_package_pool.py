"""The (part, format) packaging pool of a parted target (convert/pipeline/package_pool.py): its width from the cores,
``build --jobs`` and the host memory; and (heavy) a parted build with the pool gives the bundle of the build one part
after the other byte for byte, below and above ``CHAINED_RUN_PARAMETERS``, and resumes job by job from the cache."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main
from convert.pipeline import build
from convert.pipeline.package_pool import Job, job_bytes, jobs_of, pool_width
from convert.pipeline.partition import BASE_BYTES, GB, packaging_bytes
from convert.pipeline.plan import make_plan
from convert.verify import gates
from tests.helpers.bundle_files import comparable_manifest, files
from tests.helpers.recipes import FLAT_LOGITS, gate, recipe, tiny_target


def _recipe(folder: Path, checkpoint: Path, **fields) -> Path:
    """The tiny dense target in the ane layout under a 0.6 MB part limit: two parts (layers 0-2 beside the host's
    table, the head), both formats: four jobs."""
    return recipe(folder, "pool", target=tiny_target(checkpoint, context=64, taps=[2, 0], logits=True, layout="ane",
                                                     max_part_mb=0.6, gate=gate(4, 40, 8, **FLAT_LOGITS), **fields))


def test_the_pool_is_as_wide_as_the_cores_the_jobs_and_the_memory_allow(tmp_path, tiny_checkpoint):
    plan = make_plan(_recipe(tmp_path, tiny_checkpoint))
    assert [p.name for p in plan.parts] == ["layers-0-2", "head"] and plan.recipe.backends == ["coreai", "coreml"]
    peak = max(BASE_BYTES + packaging_bytes(part, plan.sizes) for part in plan.parts)
    assert max(job_bytes(plan, i) for i in range(2)) == peak
    assert pool_width(plan, cores=2)[0] == 2
    assert pool_width(plan, cores=16)[0] == 4  # no more than the jobs
    assert pool_width(plan, 1, cores=16)[0] == 1
    assert pool_width(plan, 3, cores=2)[0] == 3  # --jobs is the bound in place of the cores
    # a budget that holds the build process's base and two of the largest job
    budget = (BASE_BYTES + 2.5 * peak) / GB
    tight = make_plan(_recipe(tmp_path, tiny_checkpoint, max_host_memory_gb=budget))
    assert [p.name for p in tight.parts] == ["layers-0-2", "head"]
    width, why = pool_width(tight, cores=16)
    assert width == 2 and why == (f"16 cores; host memory: 2 of the largest job's {peak / GB:.1f} GB within "
                                  f"target.max_host_memory_gb {budget:g} beside the build process")
    assert pool_width(tight, 8, cores=16)[0] == 2  # --jobs does not lift the memory's bound
    # beside the drafter stage (its bytes held by the build process while the pool runs): room for one job less
    width, why = pool_width(tight, cores=16, beside=int(peak))
    assert width == 1 and why.endswith(f"beside the build process and the drafter stage's {peak / GB:.1f} GB")
    # every (part, format) once, the part with layers first (the longest), though the head's packaging memory is larger
    assert job_bytes(plan, 1) > job_bytes(plan, 0)
    assert jobs_of(plan) == [Job(0, "layers-0-2", "coreai"), Job(0, "layers-0-2", "coreml"), Job(1, "head", "coreai"),
                             Job(1, "head", "coreml")]


def _build(recipe_path: Path, out: Path, *options: str) -> str:
    result = CliRunner().invoke(main, ["build", str(recipe_path), "-o", str(out), *options])
    assert result.exit_code == 0, result.output
    return result.output


def _jobs_done(log: str) -> list[str]:
    """The jobs a log says finished, as "part, format", sorted."""
    return sorted(line.split("✓ package job: part ")[1].split(" (4 jobs)")[0] for line in log.splitlines()
                  if "✓ package job: part " in line)


@pytest.mark.heavy
@pytest.mark.parametrize("short", [False, True], ids=["chained", "short"])
def test_the_pooled_build_is_the_sequential_build_byte_for_byte(tmp_path, tiny_checkpoint, monkeypatch, capfd,
                                                                short):
    """Two workers against one part after the other (``--jobs 1``, today's order), the chained artifact gate (the
    fixture's 1.1M parameters) and the short one (``CHAINED_RUN_PARAMETERS`` 0: each part replayed alone, a fresh
    process a job); then the pooled build again from its cache: every job restored, the same bundle. The pool's
    processes print their job lines to the file descriptor (``capfd``), the build process through click's runner."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    if short:
        monkeypatch.setattr(build, "CHAINED_RUN_PARAMETERS", 0)
    recipe_path = _recipe(tmp_path, tiny_checkpoint)
    cache = str(tmp_path / "cache")
    output = _build(recipe_path, tmp_path / "pooled", "--jobs", "2", "--cache-dir", cache)
    assert "package 4 jobs (2 parts x 2 formats), 2 at once (--jobs 2; host memory:" in output
    assert _jobs_done(capfd.readouterr().err) == ["head, coreai", "head, coreml", "layers-0-2, coreai",
                                                  "layers-0-2, coreml"]
    sequential = _build(recipe_path, tmp_path / "sequential", "--jobs", "1", "--no-cache")
    assert "package job" not in sequential + capfd.readouterr().err
    pooled_files, sequential_files = files(tmp_path / "pooled"), files(tmp_path / "sequential")
    assert len(pooled_files) == 25 and sum(v != "varies" for v in pooled_files.values()) == 21
    assert pooled_files == sequential_files
    assert comparable_manifest(tmp_path / "pooled") == comparable_manifest(tmp_path / "sequential")
    scope = json.loads((tmp_path / "pooled" / "manifest.json").read_text())["gate"]["artifact"]["scope"]
    assert scope == (gates.PARTS_REPLAYED if short else gates.PARTS_CHAINED)
    if short:
        return
    resumed = _build(recipe_path, tmp_path / "resumed", "--jobs", "2", "--cache-dir", cache)
    workers = capfd.readouterr().err
    assert "package 4 jobs (2 parts x 2 formats), 2 at once" in resumed
    assert workers.count("restored from the cache (") == 4 and len(_jobs_done(workers)) == 4
    assert files(tmp_path / "resumed") == pooled_files
    assert comparable_manifest(tmp_path / "resumed") == comparable_manifest(tmp_path / "pooled")
