"""The hybrid fixture end to end: `spec-convert build recipes/tiny_qwen3_5.yaml` with both packages, then
`spec-convert generate` on the bundle against transformers' own greedy generation."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from convert.cli import main
from convert.models import qwen3_5
from convert.verify.checks import FP16_STATE_BOUND

# The trained hybrid built with both fp16 packages takes 2.5 min alone on 2 cores (about 4 min beside the suite's other
# worker): `make test-heavy`. The default suite keeps a hybrid end to end in the exact pack's build
# (tests/test_exact_build.py: both formats, gated, `generate` on torch and the Core AI runtime against transformers).
pytestmark = [pytest.mark.slow, pytest.mark.heavy]
ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "stdlib-qwen3_5"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hybrid") / "tiny-qwen3_5"
    result = CliRunner().invoke(main, ["build", str(ROOT / "recipes" / "tiny_qwen3_5.yaml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_bundle_is_a_gated_hybrid_target(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["architecture"]["family"] == "qwen3_5"
    config = json.loads((FIXTURE / "config.json").read_text())
    assert m["architecture"]["hybrid"]["layer_types"] == config["layer_types"]
    contract = m["host_contract"]
    assert (contract["name"], contract["version"], contract["rollback"]) == (
        qwen3_5.HOST_CONTRACT_NAME, qwen3_5.HOST_CONTRACT_VERSION, "commit-next-call")
    assert contract["pending_rows"] == {"decode": 1, "verify": 8}
    inputs = {f["name"]: [t["name"] for t in f["inputs"]] for f in m["functions"]}
    assert inputs == {"prefill": ["input_ids", "position_ids", "accept", "valid"],
                      "decode": ["input_ids", "position_ids", "accept"],
                      "verify": ["input_ids", "position_ids", "accept"]}
    assert [s["name"] for s in m["functions"][0]["states"]] == list(qwen3_5.STATE_NAMES)
    gate = m["gate"]
    assert gate["passed"] and gate["metrics"]["kl_mean"] < 1e-4 and gate["metrics"]["top1"] >= 0.99
    assert gate["metrics"]["block_chain_positions"] == 16 * (8 + 4 + 1 + 7)  # probe accepts 0, 4, 7, 1 per window
    assert gate["artifact"]["passed"] and gate["artifact"]["runtime_calls"] == 8
    checks = {p["format"]: p["check"] for p in m["packages"]}
    assert checks["coreai"]["max_state_delta"] <= FP16_STATE_BOUND
    assert checks["coreml"]["weights_bit_exact"] is True
    for check in checks.values():  # neither converter fused a device-safe form back into the op it avoids
        assert check["unsafe_ops_absent"] == "silu,softplus"


def _held_out_prompt() -> str:
    from fixtures.corpus import read_split

    return read_split("eval")[0].text[:200]


def _transformers_greedy(prompt: str) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(FIXTURE))
    model = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_generate_on_the_core_ai_runtime_equals_transformers(bundle):
    prompt = _held_out_prompt()
    result = CliRunner().invoke(main, ["generate", str(bundle), "--prompt", prompt, "-n", str(NEW_TOKENS),
                                       "--runtime", "coreai", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["runtime"] == "coreai" and len(out["prompt_ids"]) > 32
    assert out["generated_ids"] == _transformers_greedy(prompt)


def test_generate_in_torch_needs_the_recipe_and_matches(bundle):
    prompt = _held_out_prompt()
    result = CliRunner().invoke(main, ["generate", str(bundle), "--prompt", prompt, "--runtime", "torch"])
    assert result.exit_code == 2 and "give --recipe" in result.output
    result = CliRunner().invoke(main, ["generate", str(bundle), "--prompt", prompt, "--runtime", "torch", "--json",
                                       "--recipe", str(ROOT / "recipes" / "tiny_qwen3_5.yaml")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["generated_ids"] == _transformers_greedy(prompt)


@pytest.fixture(scope="module")
def ane_bundle(tmp_path_factory) -> Path:
    """The same recipe with ``layout: ane``, built with ``--strict`` (any placement finding fails it)."""
    tmp = tmp_path_factory.mktemp("hybrid-ane")
    text = (ROOT / "recipes" / "tiny_qwen3_5.yaml").read_text().replace("path:../fixtures/", f"path:{ROOT}/fixtures/")
    recipe = tmp / "ane.yaml"
    recipe.write_text(text.replace("  context: 512", "  context: 512\n  layout: ane", 1))
    result = CliRunner().invoke(main, ["build", str(recipe), "-o", str(tmp / "ane"), "--strict"])
    assert result.exit_code == 0, result.output
    return tmp / "ane"


def test_the_ane_layout_holds_no_state_lookup_or_fp32_and_generates_the_same_ids(ane_bundle):
    """The hybrid's ane functions: the host's buffers (the Gated DeltaNet ones replaced or written at their leading
    rows), its commit inputs, lookup and argmax; no placement finding in either format, the delta rule in fp16 running
    on the Core AI runtime in lockstep with the torch modules; generate gives transformers' greedy ids (as the
    stateful bundle does) on the runtime."""
    m = json.loads((ane_bundle / "manifest.json").read_text())
    contract = m["host_contract"]
    assert (contract["name"], contract["rollback"]) == (qwen3_5.ANE_HOST_CONTRACT_NAME, "commit-next-call")
    assert {name: rule.get("write", "positions") for name, rule in contract["buffers"].items()} == {
        "key_history": "positions", "value_history": "positions", "conv_state": "whole", "recurrent_state": "whole",
        "pending_qkv": "leading", "pending_ba": "leading"}
    assert all(f["states"] == [] for f in m["functions"])
    assert [p["placement"] for p in m["packages"]] == [[], []]
    assert m["gate"]["passed"] and m["gate"]["artifact"]["passed"]
    prompt = _held_out_prompt()
    result = CliRunner().invoke(main, ["generate", str(ane_bundle), "--prompt", prompt, "-n", str(NEW_TOKENS),
                                       "--runtime", "coreai", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["generated_ids"] == _transformers_greedy(prompt)

