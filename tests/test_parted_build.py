"""A parted hybrid target end to end: the fixture built under a 6 MB part limit (the embedding, four chunks of two
layers and the head, both formats), gated through the chained parts, and `spec-convert generate` on the Core AI
runtime through them against transformers' own greedy generation."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_hybrid_build import NEW_TOKENS, _held_out_prompt, _transformers_greedy

from convert.cli import main
from convert.verify import gates

pytestmark = pytest.mark.heavy
ROOT = Path(__file__).resolve().parent.parent
LIMIT_MB = 6


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parted")
    text = (ROOT / "recipes" / "tiny_qwen3_5.yaml").read_text()
    text = text.replace("path:../fixtures/", f"path:{ROOT}/fixtures/").replace(
        "  context: 512", f"  max_part_mb: {LIMIT_MB}\n  context: 512")
    recipe = root / "parted.yaml"
    recipe.write_text(text)
    out = root / "bundle"
    result = CliRunner().invoke(main, ["build", str(recipe), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_the_bundle_lists_its_parts_in_order_each_under_the_limit(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    parts = m["parts"]
    assert [p["name"] for p in parts] == ["embed", "layers-0-1", "layers-2-3", "layers-4-5", "layers-6-7", "head"]
    assert [p["layers"] for p in parts[1:-1]] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert parts[0]["embedding_rows"] == parts[-1]["head_rows"] == [0, m["architecture"]["vocab_size"]]
    packages = {p["path"]: p for p in m["packages"]}
    assert sorted(packages) == sorted(path for p in parts for path in p["packages"])
    for part in parts:
        for path in part["packages"]:
            assert packages[path]["part"] == part["name"]
            assert sum(f["size"] for f in packages[path]["files"]) <= LIMIT_MB * 10**6, path
            assert (bundle / path).is_dir()
    # the first layer part takes the embedding's rows; a layer part holds its own layers' states only
    prefill = {p["name"]: next(f for f in p["functions"] if f["name"] == "prefill") for p in parts}
    assert [t["name"] for t in prefill["layers-0-1"]["inputs"]] == ["hidden_states", "position_ids", "accept",
                                                                    "valid"]
    assert {s["name"]: s["shape"][0] for s in prefill["layers-2-3"]["states"]} == {
        "key_cache": 1, "value_cache": 1, "conv_state": 1, "recurrent_state": 1, "pending_qkv": 1, "pending_ba": 1}
    assert prefill["embed"]["states"] == prefill["head"]["states"] == []
    artifact = m["gate"]["artifact"]
    assert artifact["passed"] and artifact["scope"] == gates.PARTS_CHAINED and artifact["argmax_compared"] > 0
    for package in m["packages"]:
        if package["format"] == "coreai":
            assert package["check"]["runtime_calls"] == 8, package["path"]
        else:
            assert package["check"]["weights_bit_exact"] is True


def test_generate_through_the_chained_parts_equals_transformers(bundle):
    prompt = _held_out_prompt()
    result = CliRunner().invoke(main, ["generate", str(bundle), "--prompt", prompt, "-n", str(NEW_TOKENS),
                                       "--runtime", "coreai", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["generated_ids"] == _transformers_greedy(prompt)


def test_the_parted_build_records_what_the_whole_target_gives(bundle):
    """Built part by part (the gate streamed one layer at a time), the manifest's identity hashes and parameter count
    are the whole target's, and its gate values are the in-memory gate's."""
    from convert.pipeline.build import shipped_modules
    from convert.pipeline.plan import make_plan
    from manifests import identity

    m = json.loads((bundle / "manifest.json").read_text())
    plan = make_plan(bundle.parent / "parted.yaml")
    modules, _ = shipped_modules(plan)
    assert m["weights"]["embedding_sha256"] == identity.tensor_sha256(modules.core.embed_tokens.weight)
    assert m["weights"]["lm_head_sha256"] == identity.tensor_sha256(modules.core.lm_head.weight)
    assert m["weights"]["parameter_count"] == sum(p.numel() for p in modules.core.parameters())
    whole = {x.name: x.value for x in gates.gate_target(plan, modules).metrics}
    assert set(m["gate"]["metrics"]) == set(whole)
    for name, value in m["gate"]["metrics"].items():
        assert value == pytest.approx(whole[name], rel=1e-5, abs=1e-7), name


def test_gate_on_the_parted_bundle_chains_its_parts(bundle, tmp_path):
    report = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["gate", str(bundle.parent / "parted.yaml"), "--bundle", str(bundle),
                                       "--report", str(report)])
    assert result.exit_code == 0, result.output
    artifact = json.loads(report.read_text())["artifact"]
    assert artifact["passed"] and artifact["scope"] == gates.PARTS_CHAINED and artifact["argmax_compared"] > 0
