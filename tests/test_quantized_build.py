"""The fixture target built end to end with GPTQ in both 4-bit formats: gated, bit-exact packages, < 0.3x fp16."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3"
RECIPE = """\
name: fx
target:
  source: path:{source}
  graphs: {{prefill: 64, decode: 1, verify: 8}}
  context: 512
  quantization:
    method: {method}
    calibration: {{samples: 8, length: 256}}
  gate: {{data: {{samples: 8, length: 256}}}}
backends: {backends}
"""

pytestmark = pytest.mark.heavy


@pytest.mark.parametrize("method, backends", [("lut4-gptq", "[coreai, coreml]"), ("affine4-gptq", "[coreml]")])
def test_fixture_builds_quantized(tmp_path, method, backends):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(source=FIXTURE, method=method, backends=backends))
    result = CliRunner().invoke(main, ["build", str(recipe), "--output", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    q = m["quantization"]
    assert q["method"] == method and q["kept_fp16"] == [] and q["calibration"]["n"] == 8
    assert 4.0 < q["bits_per_weight"] < 4.5
    gptq_layers = [layer for layer in q["layers"] if layer.get("gptq_output_error") is not None]
    assert len(gptq_layers) == 8 * 7 + 1  # every decoder linear and the lm_head; the embedding is rounded
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
