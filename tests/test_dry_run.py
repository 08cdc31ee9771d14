"""`build --dry-run` loads and downloads no weights (issue #41): an ``hf://`` source that is not in the Hugging Face
cache is planned from its config, tokenizer files and safetensors headers, read through the hub's API, which these
tests replace with a fake hub that serves local directories and records every file asked for. The plan starts with a
summary: what is built, what a build downloads, the peak host memory against the budget (and a plain line when the
build would be refused), time and disk estimates."""

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from click.testing import CliRunner
from huggingface_hub.utils import SafetensorsFileMetadata, TensorInfo

from convert.cli import main
from tests.helpers.prism_packs import write_pack

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
COMMIT = "5eed" + "0" * 36


class FakeHub:
    """The hub's calls spec-convert makes, served from local directories; ``requests`` records each (kind, repo, file)
    asked for: ``download`` a whole file, ``header`` a safetensors header (a range request), ``info`` the file list."""

    def __init__(self, cache: Path):
        self.repos: dict[str, Path] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.cache = cache

    def serve(self, directory: Path) -> str:
        repo = "fixtures/" + directory.name
        self.repos[repo] = directory
        return f"hf://{repo}@{COMMIT[:7]}"

    def _repo(self, repo_id: str, revision: str | None) -> Path:
        if repo_id not in self.repos or not COMMIT.startswith(revision or "-"):
            raise ConnectionError(f"{repo_id}@{revision}: not on this fake hub")
        return self.repos[repo_id]

    def _files(self, directory: Path) -> list[Path]:
        return sorted(p for p in directory.rglob("*") if p.is_file())

    def model_info(self, repo_id, *, revision=None, files_metadata=False, **_):
        self.requests.append(("info", repo_id, ""))
        directory = self._repo(repo_id, revision)
        siblings = [SimpleNamespace(rfilename=p.relative_to(directory).as_posix(),
                                    size=p.stat().st_size if files_metadata else None) for p in self._files(directory)]
        return SimpleNamespace(sha=COMMIT, siblings=siblings)

    def hf_hub_download(self, repo_id, filename, *, revision=None, local_dir=None, cache_dir=None, **_):
        self.requests.append(("download", repo_id, filename))
        source = self._repo(repo_id, revision) / filename
        target = Path(local_dir or cache_dir or self.cache) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        return str(target)

    def parse_safetensors_file_metadata(self, repo_id, filename, *, revision=None, **_):
        self.requests.append(("header", repo_id, filename))
        with open(self._repo(repo_id, revision) / filename, "rb") as f:  # the two range requests: length, header
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        metadata = header.pop("__metadata__", None) or {}
        return SafetensorsFileMetadata(metadata=metadata, tensors={
            name: TensorInfo(dtype=t["dtype"], shape=t["shape"], data_offsets=tuple(t["data_offsets"]))
            for name, t in header.items()})

    def snapshot_download(self, repo_id, *, revision=None, cache_dir=None, **_):
        directory = self._repo(repo_id, revision)
        self.requests += [("download", repo_id, p.relative_to(directory).as_posix()) for p in self._files(directory)]
        target = Path(cache_dir or self.cache) / ("models--" + repo_id.replace("/", "--")) / "snapshots" / COMMIT
        shutil.copytree(directory, target)
        return str(target)

    def get_safetensors_metadata(self, repo_id, *, revision=None, **_):
        self.requests.append(("header", repo_id, "*"))
        raise ConnectionError("not served: the code reads each file's header")

    @property
    def weights_downloaded(self) -> list[str]:
        return [f"{repo}/{name}" for kind, repo, name in self.requests if kind == "download"
                and name.endswith(".safetensors")]


@pytest.fixture
def hub(tmp_path, monkeypatch) -> FakeHub:
    """An empty Hugging Face cache in tmp_path, the network on (no HF_HUB_OFFLINE) and the fake hub in place."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    fake = FakeHub(tmp_path / "hf" / "hub")
    for name in ("model_info", "hf_hub_download", "parse_safetensors_file_metadata", "snapshot_download",
                 "get_safetensors_metadata"):
        monkeypatch.setattr(huggingface_hub, name, getattr(fake, name), raising=False)
    return fake


def dry_run(recipe: Path, *extra: str):
    return CliRunner().invoke(main, ["build", str(recipe), "--dry-run", *extra])


def served(recipe: Path, hub: FakeHub, directory: Path) -> tuple[Path, dict[str, str]]:
    """``recipe`` in ``directory`` with each ``path:`` source served by the fake hub as an ``hf://`` reference;
    returns the new recipe and {hf reference: the original path reference}."""
    lines, renamed = [], {}
    for line in recipe.read_text().splitlines():
        key, sep, value = line.partition("source: path:")
        if sep:
            local = value.split("#")[0].strip()
            reference = hub.serve((recipe.parent / local).resolve())
            renamed[reference] = "path:" + local
            line = f"{key}source: {reference}"
        lines.append(line)
    path = directory / recipe.name
    path.write_text("\n".join(lines) + "\n")
    return path, renamed


def test_every_recipe_dry_runs_without_downloading_a_weight(hub, tmp_path):
    """Each shipped recipe with an empty hub cache, its local checkpoints served as hf:// references: exit 0, no
    safetensors file downloaded (every header read instead), no snapshot download; the release recipes' repos are
    not on the (fake) hub, so they plan from their contracts, as offline. The two 27B release pairs plan over the
    default 16 GB (the drafter stage holds the target's codes beside the drafter): the summary says the build would
    be refused and what to change; the Bonsai pair plans within it and names its target's quantization, exact."""
    recipes = sorted(RECIPES.glob("*.yaml"))
    assert len(recipes) >= 9
    outputs = {}
    for recipe in recipes:
        path, renamed = served(recipe, hub, tmp_path)
        result = dry_run(path)
        assert result.exit_code == 0, (recipe.name, result.output)
        assert result.output.startswith("summary"), (recipe.name, result.output[:300])
        if renamed:
            assert "  download: a build fetches" in result.output, recipe.name
        else:
            assert "planned from the recipe's contracts" in result.output, recipe.name
        out = result.output
        outputs[recipe.name] = out[:out.index("\n", out.index("  disk:"))]  # the summary
    assert hub.weights_downloaded == []
    headers = {name for kind, _, name in hub.requests if kind == "header"}
    assert "model-00001-of-00003.safetensors" in headers and "selector.safetensors" in headers
    downloaded = {name for kind, _, name in hub.requests if kind == "download"}
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= downloaded
    assert not list((tmp_path / "hf" / "hub").glob("models--*")), "a dry run leaves the hub cache as it was"

    for name, peak in (("dflash2_27b.yaml", "21.0"), ("qwen3_mtp_27b.yaml", "16.5")):
        summary = outputs[name]
        assert f"this build would be refused: peak {peak} GB > target.max_host_memory_gb 16 (the drafter stage); " \
            "raise target.max_host_memory_gb to" in summary
        assert "build the target alone" in summary
        assert "quantize (lut4-gptq): 92.5 h | 17 min" in summary  # COST_MODEL's rates at 27B
        assert "gate (16 x 256 tokens): 3.1 h | the reference under a minute, the candidate 6 min (one H100" in summary
        assert "; its device pass (1 window in the device's arithmetic): not measured at this size" in summary
        assert "packaging (14 parts x 2 formats): 3.6 h | 30 min (the parts' check calls on the GPU, then 8" in summary
        assert "range (1 x 256 tokens): not measured | 2 min (one H100; on its 16 CPU cores: 7 min)" in summary
    assert "drafter packages (the check's calls, 2 formats): 60 min | not measured" in \
        outputs["dflash2_27b.yaml"]  # the 27B drafter's measured on 2 cores: 1,305.6 + 2,131.1 + 162.0 s
    # its range over 64 tokens (156.5 s for 32), its calibration's 16 x (64 + 64) tokens (165.9 s for 2 x (64 + 32))
    assert "not measured at this size | range 5 min, calibration 29 min (the seeded 27B DFlash2 pair on one H100), " \
        "its GPTQ, acceptance and A/B not measured" in outputs["dflash2_27b.yaml"]
    summary = outputs["bonsai2_27b_dflash2.yaml"]
    assert "quantization exact" in summary and "would be refused" not in summary and "within budget" in summary


@pytest.mark.parametrize("name", ["tiny_qwen3_dflash2.yaml", "tiny_qwen3_5_mtp.yaml"])
def test_the_plan_from_headers_is_the_plan_from_the_checkpoint(hub, tmp_path, name):
    """Planned through the fake hub (headers only), the plan is the one the local checkpoint gives: every line but the
    source's name and the download line, which sums the weight files' sizes on the hub."""
    local = dry_run(RECIPES / name)
    path, renamed = served(RECIPES / name, hub, tmp_path)
    remote = dry_run(path)
    assert local.exit_code == 0 and remote.exit_code == 0, (local.output, remote.output)
    text = remote.output
    for reference, original in renamed.items():
        text = text.replace(reference, original)
    download = [line for line in text.splitlines() if line.startswith("  download:")]
    assert len(download) == 1
    assert [line for line in text.splitlines() if not line.startswith("  download:")] == local.output.splitlines()
    assert "parameters: " in local.output
    sizes = sum(p.stat().st_size for original in renamed.values()
                for p in (RECIPES / original.removeprefix("path:")).glob("*.safetensors"))
    assert f"a build fetches {sizes / 1e6:.1f} MB of weights" in download[0]
    assert hub.weights_downloaded == []


def test_a_prism_pack_on_the_hub_plans_from_its_headers(hub, tmp_path):
    """An ``exact`` pack planned from its headers (its unfolded shapes from config.json's modules list and the
    codes' headers: nothing unfolded, no scale read) gives the plan its local copy gives (which unfolds it)."""
    write_pack(tmp_path / "pack", tmp_path / "unfolded", seed=3, dense_dtype=torch.bfloat16)
    recipe = ("name: tiny-bonsai\ntarget:\n  source: SOURCE\n  graphs: {prefill: 16, decode: 1, verify: 8}\n"
              "  context: 128\n  quantization: {method: exact}\n  gate:\n    data: {samples: 4, length: 64}\n"
              "    greedy_tokens: 4\nbackends: [coreai, coreml]\n")
    (tmp_path / "local.yaml").write_text(recipe.replace("SOURCE", f"path:{tmp_path / 'pack'}"))
    reference = hub.serve(tmp_path / "pack")
    (tmp_path / "hub.yaml").write_text(recipe.replace("SOURCE", reference))
    local = dry_run(tmp_path / "local.yaml", "--cache-dir", str(tmp_path / "cache"))
    remote = dry_run(tmp_path / "hub.yaml", "--cache-dir", str(tmp_path / "cache2"))
    assert local.exit_code == 0 and remote.exit_code == 0, (local.output, remote.output)
    lines = [line.replace(reference, f"path:{tmp_path / 'pack'}") for line in remote.output.splitlines()
             if not line.startswith("  download:")]
    assert lines == local.output.splitlines()
    assert "quantization exact" in remote.output and "rotations (block 64" in remote.output
    assert hub.weights_downloaded == []
    assert not (tmp_path / "cache2").exists() or not list((tmp_path / "cache2").rglob("*.safetensors"))


def test_small_points(hub, tmp_path):
    """Did-you-mean for an unknown recipe key; an hf:// source without a revision; --output as a path; the gate's
    text named in the summary."""
    text = (RECIPES / "tiny_qwen3.yaml").read_text().replace("../fixtures", str(ROOT / "fixtures"))
    (tmp_path / "typo.yaml").write_text(text.replace("  context:", "  contxt:"))
    result = dry_run(tmp_path / "typo.yaml")
    assert result.exit_code == 2 and "target.contxt: unknown field; did you mean 'context'?" in result.output
    (tmp_path / "unpinned.yaml").write_text(text.replace(f"path:{ROOT / 'fixtures'}/stdlib-qwen3", "hf://org/model"))
    result = dry_run(tmp_path / "unpinned.yaml")
    assert result.exit_code == 2 and "has no revision; append @<commit hash>" in result.output
    assert len(result.output.strip().splitlines()) == 1
    (tmp_path / "ok.yaml").write_text(text)
    result = dry_run(tmp_path / "ok.yaml", "--output", "elsewhere/b")
    assert result.exit_code == 0 and "-> elsewhere/b" in result.output
    # the gate's text is named, and the fixture's Python split is said to be a default, not the model's own domain
    assert "  gate text: fixture:eval (the fixture corpus: Python source, the default; for another domain set " \
           "target.gate.data.corpus to path:FILE" in result.output
    (tmp_path / "own.yaml").write_text(text.replace("data: {samples: 16", "data: {corpus: 'path:own.txt', samples: 16"))
    (tmp_path / "own.txt").write_text("text of the model's own domain\n" * 200)
    result = dry_run(tmp_path / "own.yaml")
    assert result.exit_code == 0 and "  gate text: path:own.txt\n" in result.output, result.output


def test_a_headers_only_snapshot_holds_no_weights_to_read(hub, tmp_path):
    """The stubs stand for the files on the hub (their size, their headers checked as the files'), and no reader takes
    weights from them: what a dry run resolves is never built from."""
    from convert.inputs import sources

    reference = hub.serve(ROOT / "fixtures" / "stdlib-qwen3")
    with sources.headers_only():
        directory = sources.resolve(reference, tmp_path).directory
        shapes = sources.tensor_shapes(directory)
        assert shapes == sources.tensor_shapes(ROOT / "fixtures" / "stdlib-qwen3")
        assert sources.weight_bytes(directory) == sources.weight_bytes(ROOT / "fixtures" / "stdlib-qwen3")
        assert sum(p.stat().st_size for p in directory.glob("*.safetensors")) < 100_000  # headers only
        for read in (sources.load_tensors, sources.CheckpointReader):
            with pytest.raises(sources.InputError, match="headers-only snapshot"):
                read(directory)
    assert not directory.exists()  # removed with the dry run
    assert hub.weights_downloaded == []
