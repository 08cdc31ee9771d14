"""The fixture targets (dense and hybrid) built end to end with GPTQ in both 4-bit formats: gated, bit-exact packages,
< 0.3x fp16."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main
from tests.helpers.recipes import recipe, tiny_target

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def fixture_recipe(path: Path, source: Path, method: str, backends: list[str]) -> Path:
    """A fixture's recipe: 8 windows of 256 tokens to calibrate on and to gate."""
    target = tiny_target(source, graphs={"prefill": 64, "decode": 1, "verify": 8}, context=512,
                         quantization={"method": method, "calibration": {"samples": 8, "length": 256}},
                         gate={"data": {"samples": 8, "length": 256}})
    return recipe(path, "fx", target=target, backends=backends)


pytestmark = pytest.mark.heavy


def _quantized_linears(config: dict) -> tuple[int, list[str]]:
    """GPTQ'd linears (every decoder linear and the lm_head; the embedding is rounded) and those kept fp16 (a Gated
    DeltaNet layer's in_proj_a / in_proj_b)."""
    kinds = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    gdn = [i for i, kind in enumerate(kinds) if kind == "linear_attention"]
    kept = sorted(f"layers.{i}.linear_attn.in_proj_{x}" for i in gdn for x in "ab")
    return sum(6 if kind == "linear_attention" else 7 for kind in kinds) + 1, kept


@pytest.mark.parametrize("fixture, method, backends", [("stdlib-qwen3", "lut4-gptq", "[coreai, coreml]"),
                                                       ("stdlib-qwen3", "affine4-gptq", "[coreml]"),
                                                       ("stdlib-qwen3_5", "lut4-gptq", "[coreai, coreml]")])
def test_fixture_builds_quantized(tmp_path, fixture, method, backends):
    path = fixture_recipe(tmp_path / "r.yaml", FIXTURES / fixture, method, backends.strip("[]").split(", "))
    result = CliRunner().invoke(main, ["build", str(path), "--output", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    q = m["quantization"]
    gptq_count, kept = _quantized_linears(json.loads((FIXTURES / fixture / "config.json").read_text()))
    assert q["method"] == method and q["kept_fp16"] == kept and q["calibration"]["n"] == 8
    assert 4.0 < q["bits_per_weight"] < 4.5
    gptq_layers = [layer for layer in q["layers"] if layer.get("gptq_output_error") is not None]
    assert len(gptq_layers) == gptq_count
    total_gptq = sum(layer["gptq_output_error"] for layer in gptq_layers)
    assert total_gptq < 0.6 * sum(layer["rtn_output_error"] for layer in gptq_layers)  # calibration error
    assert m["gate"]["passed"] is True and m["gate"]["metrics"]["kl_mean"] < 0.1
    fp16_weight_bytes = 2 * m["weights"]["parameter_count"]  # what the fp16 bundle's weight files hold
    weight_files = ("weight.bin", "main.mlirb")  # Core ML weights; Core AI program + weights in one file
    for package in m["packages"]:
        assert package["check"]["quantized_bit_exact"] is True
        shipped = sum(f["size"] for f in package["files"] if f["path"].endswith(weight_files))
        assert shipped < 0.3 * fp16_weight_bytes, (package["path"], shipped, fp16_weight_bytes)
    if "coreai" in backends:
        assert m["gate"]["artifact"]["passed"] is True
