"""A target + DFlash2 drafter recipe builds both bundles bound by identity; check-pair refuses any other target.

The drafter is seeded random (it accepts nothing, which is fine here: identity, packaging and the lossless
check do not depend on its quality; the trained fixture pairs are built in tests/test_fixture_pairs.py).
Each refused target differs from the right one in exactly one thing, and is built the normal way.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from convert.cli import main
from tests.helpers.dflash2_checkpoints import tiny_config, write_drafter
from tests.helpers.pairs import DRAFT, TAPS, dense_pair, pair_target
from tests.helpers.recipes import FLAT_LOGITS, gate, recipe, tiny_dflash2, tiny_target

pytestmark = pytest.mark.slow


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def build(tmp: Path, name: str, source: Path, taps=TAPS, drafter: Path | None = None, backends=("coreml",),
          target: dict | None = None, layout: str = "stateful") -> Path:
    """``target`` defaults to the shared pair's target fields (a variant differs from it in one thing)."""
    ane = {"layout": "ane"} if layout == "ane" else {}  # target and drafter
    fields = {**(target or pair_target(source, taps)), **ane}
    recipe_path = recipe(tmp, name, target=fields, backends=backends,
                         drafter=tiny_dflash2(drafter, **ane) if drafter else None)
    result = run("build", str(recipe_path), "--output", str(tmp / name))
    assert result.exit_code == 0, result.output
    return tmp / name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The session's shared dense pair (tests/helpers/pairs.py): its folder and its bundle."""
    tmp = dense_pair(tmp_path_factory)
    return tmp, tmp / "pair"


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def variant(tmp: Path, name: str, edit) -> Path:
    """A copy of the target checkpoint with one thing changed by ``edit(directory)``."""
    directory = tmp / name
    shutil.copytree(tmp / "target", directory)
    edit(directory)
    return directory


def edit_tensor(key: str, row: int):
    def edit(directory: Path) -> None:
        path = directory / "model.safetensors"
        tensors = load_file(path)
        tensors[key][row, 0] += 0.125
        save_file(tensors, path, metadata={"format": "pt"})
    return edit


def refusal(drafter: Path, target: Path) -> str:
    result = run("check-pair", str(drafter), str(target))
    assert result.exit_code == 1, result.output
    return result.output


def test_pair_bundle(pair):
    tmp, bundle = pair
    target, drafter = manifest(bundle / "target"), manifest(bundle / "drafter")
    assert drafter["kind"] == "drafter" and target["kind"] == "target"
    binding = drafter["target"]
    assert binding["export_id"] == target["export_id"]
    for record in ("architecture", "taps", "tokenizer", "host_contract", "weights", "drafter_interface"):
        assert binding[record] == target[record], record  # whole records, every field
    assert binding["taps"]["layers"] == TAPS
    assert {p.name for p in (bundle / "drafter").iterdir()} >= {
        "dflash2_lut4.aimodel", "dflash2_lut4.mlpackage", "selector.safetensors", "LICENSE", "SOURCE.json",
        "config.json", "manifest.json"}
    # the drafter borrows the target's tables exactly as shipped
    lm_head = load_file(bundle / "target" / "lm_head.safetensors")["weight"]
    assert lm_head.dtype == torch.float16 and lm_head.shape == (4096, 64)
    # the Core AI package replayed a recorded speculative run and the quantized constants read back bit-exact
    checks = {p["format"]: p["check"] for p in drafter["packages"]}
    assert checks["coreai"]["runtime_calls"] > 3 and checks["coreai"]["quantized_bit_exact"] is True
    assert checks["coreml"]["weights_bit_exact"] is True
    assert drafter["acceptance"]["lossless"] is True and drafter["acceptance"]["real_flips"] == 0
    assert drafter["ab"]["matched_rounds"] == drafter["acceptance"]["rounds"]
    device = drafter["acceptance"]["device"]  # the pair in the arithmetic of its devices (stateful: the GPU's)
    assert device["target_device"] == device["device"] == "gpu" and device["lossless"] is True
    assert device["range"]["passed"] is True and device["range"]["checked"] > 20 and device["tokens_per_round"] >= 1
    result = run("check-pair", str(bundle / "drafter"), str(bundle / "target"))
    assert result.exit_code == 0, result.output
    result = run("inspect", str(bundle))  # a pair: both manifests
    assert result.exit_code == 0 and "drafter export id" in result.output and target["export_id"] in result.output


@pytest.mark.heavy  # minutes on 2 cores: `make test-heavy` (the suite's 15-minute budget, docs/development.md)
def test_a_rebuild_restores_the_gate_and_every_drafter_phase_from_the_build_cache(pair, monkeypatch):
    """The same recipe built again (another name and output; the build cache of the first): the numeric gate's report
    and each prompt of the drafter stage's phases (plain greedy, acceptance, the n-gram baseline, the A/B's fp16
    drafter) come from the cache, none run again, and the drafter's acceptance record is the first build's."""
    tmp, bundle = pair
    monkeypatch.setenv("SPEC_CONVERT_CACHE", str(tmp / "cache"))  # the first build's cache (tests/helpers/shared.py)
    renamed = tmp / "pair-again.yaml"
    renamed.write_text((tmp / "pair.yaml").read_text().replace("name: pair", "name: pair-again"))
    result = run("build", str(renamed), "--output", str(tmp / "pair-again"))
    assert result.exit_code == 0, result.output
    assert result.output.count("\u2713 numeric gate: restored from the cache") == 1  # its end line
    assert result.output.count("2 of 2 prompts restored from the build cache\n") == 4
    again = manifest(tmp / "pair-again" / "drafter")
    assert again["acceptance"] == manifest(bundle / "drafter")["acceptance"]
    assert again["ab"] == manifest(bundle / "drafter")["ab"]


@pytest.mark.heavy  # a whole variant build each; the field-by-field test below covers every field fast
def test_refuses_other_lm_head(pair):
    tmp, bundle = pair
    other = build(tmp, "lm-head", variant(tmp, "ckpt-lm-head", edit_tensor("lm_head.weight", 7)))
    assert "target.weights.lm_head_sha256" in refusal(bundle / "drafter", other).splitlines()[0]


@pytest.mark.heavy  # a whole variant build each; the field-by-field test below covers every field fast
def test_refuses_other_tap_order(pair):
    tmp, bundle = pair
    other = build(tmp, "taps", tmp / "target", taps=[3, 2, 0])
    output = refusal(bundle / "drafter", other)
    assert "target.taps.layers" in output.splitlines()[0]
    assert "lm_head" not in output  # the same tables: only the tap order (and so the export id) differs


@pytest.mark.heavy  # a whole variant build each; the field-by-field test below covers every field fast
def test_refuses_other_tokenizer(pair):
    tmp, bundle = pair

    def edit(directory: Path) -> None:
        path = directory / "tokenizer.json"
        path.write_text(path.read_text().replace("<|mask|>", "<|MASK|>"))

    other = build(tmp, "tokenizer", variant(tmp, "ckpt-tokenizer", edit))
    output = refusal(bundle / "drafter", other)
    assert output.splitlines()[0].startswith("mismatch: target.tokenizer.")
    assert "target.tokenizer.tokenizer_json_sha256" in output and "lm_head" not in output


@pytest.mark.heavy  # a whole variant build each; the field-by-field test below covers every field fast
def test_refuses_other_mask_row(pair):
    tmp, bundle = pair
    other = build(tmp, "mask-row", variant(tmp, "ckpt-mask", edit_tensor("model.embed_tokens.weight", 3)))
    output = refusal(bundle / "drafter", other)
    assert "target.mask_row_sha256" in output.splitlines()[0]
    assert "lm_head" not in output


def test_refuses_a_file_changed_after_the_build(pair):
    tmp, bundle = pair
    copy = tmp / "tampered"
    shutil.copytree(bundle / "target", copy)
    tensors = load_file(copy / "lm_head.safetensors")
    tensors["weight"][0, 0] += 1
    save_file(tensors, copy / "lm_head.safetensors")
    assert "target.drafter_interface.lm_head_file.sha256" in refusal(bundle / "drafter", copy).splitlines()[0]


def test_check_pair_bad_input(pair):
    tmp, bundle = pair
    result = run("check-pair", str(bundle / "target"), str(bundle / "drafter"))
    assert result.exit_code == 2 and "drafter bundle comes first" in result.output
    result = run("check-pair", str(bundle), str(bundle / "target"))
    assert result.exit_code == 2 and "target/ and drafter/" in result.output


def test_accept_cli(pair):
    tmp, bundle = pair
    result = run("accept", str(tmp / "pair.yaml"), "--prompts", "1", "--tokens", "12")
    assert result.exit_code == 0, result.output
    assert "runtime: torch" in result.output and "lossless True" in result.output
    assert "A/B quantized vs fp16" in result.output  # the recipe's drafter is lut4
    assert "bytes read per call" in result.output and "predicted speedup" in result.output
    assert "n-gram baseline" in result.output
    result = run("accept", str(tmp / "pair.yaml"), "--runtime", "coreai", "--bundle", str(bundle), "--tokens", "6",
                 "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    acceptance = out["acceptance"]
    assert out["runtime"] == "coreai" and acceptance["lossless"] is True and acceptance["tokens"] == 6
    economics, ngram = acceptance["economics"], acceptance["ngram"]
    assert set(economics["bytes_per_call"]) == {"target.prefill", "target.verify", "target.decode",
                                                "drafter.context_update", "drafter.context_append", "drafter.draft"}
    assert economics["verify_cost"] >= 1.0 and economics["draft_cost"] > 0
    assert economics["predicted_speedup"] == pytest.approx(
        acceptance["tokens_per_round"] / (economics["draft_cost"] + economics["verify_cost"]))
    assert ngram["lossless"] is True and ngram["verify_calls"] + ngram["decode_calls"] == ngram["rounds"]
    ab = out["ab"]  # rounds pair up by start offset: a round one drafter's accepted token moves is unpaired
    assert 0 < ab["matched_rounds"] <= acceptance["rounds"]
    assert ab["base_more"] + ab["other_more"] <= ab["matched_rounds"]
    result = run("accept", str(tmp / "pair.yaml"), "--runtime", "coreai")
    assert result.exit_code == 2 and "--bundle" in result.output


BOUND = ("architecture", "taps", "tokenizer", "host_contract", "weights", "drafter_interface")
SWAPS = {"qwen3": "qwen3_5", "qwen3_5": "qwen3", "positional": "commit-next-call", "commit-next-call": "positional",
         "function": "host", "host": "function", "positions": "leading", "leading": "whole", "whole": "positions"}


def leaves(value, path: str):
    """(dotted path, value) of every leaf of a JSON record; a list is one leaf."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}")
    elif value is not None:
        yield path, value


def changed(value):
    """Another value of the same type, valid for the manifest schema."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return SWAPS.get(value, value + "-other")
    return value + value[-1:] if value else [1]  # a list: one more item of the same kind (or one, e.g. a ladder)


def light_copy(target: Path, to: Path) -> Path:
    """What check-pair reads of a target bundle: its manifest and the files a drafter borrows."""
    (to / "tokenizer").mkdir(parents=True)
    for name in ("manifest.json", "lm_head.safetensors", "embeddings.safetensors", "tokenizer/tokenizer.json"):
        shutil.copy2(target / name, to / name)
    return to


def every_field_is_bound(tmp: Path, bundle: Path) -> int:
    """Each leaf of each bound record changed alone in a copy of the target manifest: check-pair refuses, naming it
    first. Returns how many fields were tried."""
    original = manifest(bundle / "target")
    fields = [(path, value) for record in BOUND for path, value in leaves(original[record], record)]
    for i, (path, value) in enumerate(fields):
        copy = light_copy(bundle / "target", tmp / f"field-{i}")
        edited = json.loads(json.dumps(original))
        node = edited
        *parents, last = path.split(".")
        for part in parents:
            node = node[part]
        node[last] = changed(value)
        (copy / "manifest.json").write_text(json.dumps(edited))
        assert f"target.{path}" in refusal(bundle / "drafter", copy).splitlines()[0], path
        shutil.rmtree(copy)
    return len(fields)


def test_every_field_of_every_bound_record_is_checked(pair, tmp_path):
    tmp, bundle = pair
    assert every_field_is_bound(tmp_path, bundle) > 30
    copy = light_copy(bundle / "target", tmp_path / "edited")  # a field outside the records: the export id catches it
    edited = manifest(copy)
    edited["gate"]["metrics"]["kl_mean"] = 0.5
    (copy / "manifest.json").write_text(json.dumps(edited))
    assert "the manifest was edited after the build" in refusal(bundle / "drafter", copy).splitlines()[0]


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A seeded tiny hybrid (Gated DeltaNet + attention) target and a random DFlash2 drafter tapping both layer
    kinds, built the normal way, both in the ane layout."""
    from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

    tmp = tmp_path_factory.mktemp("hybrid-pair")
    write_hybrid(tmp / "target", hidden_size=64, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)
    write_drafter(tmp / "drafter", config=tiny_config(vocab_size=4096, dflash_config=DRAFT))
    bars = gate(2, 64, greedy_tokens=8, **FLAT_LOGITS)  # 4 probe blocks of 8
    return tmp, build(tmp, "hybrid", tmp / "target", drafter=tmp / "drafter",
                      target=tiny_target(tmp / "target", taps=TAPS, gate=bars), layout="ane")


@pytest.mark.heavy  # minutes on 2 cores: `make test-heavy` (the suite's 15-minute budget, docs/development.md)
def test_hybrid_pair_binds_the_host_contract_and_every_field(hybrid_pair, pair, tmp_path):
    """The ane pair: the drafter binds the target's host contract and records its own (the host's ring), no package
    of either has a placement finding; every bound field is checked."""
    tmp, bundle = hybrid_pair
    drafter = manifest(bundle / "drafter")
    assert drafter["target"]["host_contract"]["name"] == "spec-convert/commit-next-call-host-buffers"
    assert drafter["host_contract"]["name"] == "spec-convert/dflash2-host-ring"
    assert {rule["ring"] for rule in drafter["host_contract"]["buffers"].values()} == {64}
    assert drafter["host_contract"]["selector"]["top_k"] == 8
    packages = drafter["packages"] + manifest(bundle / "target")["packages"]
    assert len(packages) == 2 and all(p["placement"] == [] for p in packages)
    shown = " ".join(run("inspect", str(bundle / "drafter"), "--details").output.split())
    assert "host contract spec-convert/dflash2-host-ring v1" in shown and "(slot = position mod 64)" in shown
    assert "placement lint dflash2_lut4.mlpackage: no finding" in shown
    assert drafter["acceptance"]["lossless"] is True
    assert run("check-pair", str(bundle / "drafter"), str(bundle / "target")).exit_code == 0
    assert every_field_is_bound(tmp_path, bundle) > 30
    # a drafter built for the dense target, paired with the hybrid one
    _, dense = pair
    assert refusal(dense / "drafter", bundle / "target").splitlines()[0].startswith("mismatch: target.architecture.")
