"""A speculative pair at the magnitudes real checkpoints carry (issue #40): the trained dense fixture with its residual
stream times 4096 (``rescaled.residual_scaled``: the same function in fp32) and its trained DFlash2 drafter with its
own stream times 4096 too (``drafter_residual_scaled``: its block starts from the target's embedding rows), whose
``fc`` then reads taps past 1e5 and computes an output past 1.3e4 (vLLM issue #55250 reports 5,000-12,800 in the
published drafter, then NaN in fp16). The range scales fold the target's residual stream by 1/8, the taps with it and
the drafter's stream and fc norm with them: the pair accepts exactly what the unscaled pair accepts, on the same
prompts, and stays lossless."""

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from convert.cli import main
from convert.inputs.thresholds import NEAR_TIE_LOGITS
from convert.pipeline import drafter_accept
from tests.helpers.rescaled import (
    DrafterCalls,
    drafter_residual_scaled,
    first_parting,
    mtp_residual_scaled,
    part_at_a_near_tie,
    residual_scaled,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFTER = ROOT / "fixtures" / "stdlib-qwen3", ROOT / "fixtures" / "stdlib-qwen3-dflash2"
MTP = ROOT / "fixtures" / "stdlib-qwen3-mtp"
FACTOR = 4096.0

RECIPE = """\
name: pair
target:
  source: path:{target}
  graphs: {{prefill: 32, decode: 1, verify: 8}}
  context: 512
  taps: [1, 2, 4, 5, 6]
drafter:
  kind: dflash2
  source: path:{drafter}
  context_update: 32
  context_append: 8
  ring: 256
  quantization: {{method: none}}
  accept: {{samples: 2, length: 48, tokens: 24}}
backends: [coreai]
"""


MTP_RECIPE = """\
name: mtp
target:
  source: path:{target}
  graphs: {{prefill: 32, decode: 1, verify: 3}}
  context: 512
  hidden: true
drafter:
  kind: mtp
  source: path:{drafter}
  quantization: {{method: none}}
  accept: {{samples: 2, length: 48, tokens: 24}}
backends: [coreai]
"""


def accept(tmp: Path, target: Path, drafter: Path, recipe_text: str = RECIPE,
           runtime: str = "torch") -> tuple[str, dict]:
    recipe = tmp / f"{target.name}-{drafter.name}.yaml"
    recipe.write_text(recipe_text.format(target=target, drafter=drafter))
    result = CliRunner().invoke(main, ["accept", str(recipe), "--runtime", runtime, "--json"])
    assert result.exit_code == 0, result.output
    return result.output, json.loads(result.stdout)["acceptance"]


def fc_peak(target: Path) -> float:
    """The drafter's fc output peak on the taps transformers' fp32 target computes over a fixture prompt."""
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = torch.arange(3, 67)[None]
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    taps = torch.cat([states[i + 1] for i in (1, 2, 4, 5, 6)], dim=-1)
    fc = load_file(str(DRAFTER / "model.safetensors"))["fc.weight"].float()
    return float((taps @ fc.T).abs().max())


def test_a_pair_through_scaled_taps_accepts_as_the_unscaled_pair(tmp_path):
    scaled = residual_scaled(TARGET, tmp_path / "scaled", FACTOR)
    drafter = drafter_residual_scaled(DRAFTER, tmp_path / "drafter", FACTOR)
    assert fc_peak(scaled) >= 1.3e4  # what the drafter's fc would compute in fp16 without the range scales
    _, plain = accept(tmp_path, TARGET, DRAFTER)
    output, rescaled = accept(tmp_path, scaled, drafter)
    assert re.search(r"range \(gpu, headroom 4x\): residual stream x 1/8\b", output), output
    assert re.search(r"range \(gpu, headroom 4x\): dflash2 drafter's residual stream x 1/\d+", output), output
    assert rescaled["lossless"] is True and plain["lossless"] is True
    assert rescaled["tokens_per_round"] == plain["tokens_per_round"] > 1.5
    assert rescaled["rounds"] == plain["rounds"]
    assert rescaled["acceptance_by_position"] == plain["acceptance_by_position"]


def in_layout(text: str, layout: str) -> str:
    """A pair recipe with both sides in ``layout``."""
    if layout == "stateful":
        return text
    return text.replace("  context: 512\n", f"  context: 512\n  layout: {layout}\n").replace(
        "drafter:\n", f"drafter:\n  layout: {layout}\n")


@pytest.mark.parametrize("kind, layout", [("dflash2", "stateful"),  # 3 accept runs each: the rest heavy
                                          pytest.param("dflash2", "ane", marks=pytest.mark.heavy),
                                          pytest.param("mtp", "stateful", marks=pytest.mark.heavy),
                                          pytest.param("mtp", "ane", marks=pytest.mark.heavy)])
def test_in_the_devices_arithmetic_the_scaled_pair_accepts_as_the_unscaled(tmp_path, monkeypatch, kind, layout):
    """``accept --runtime device``: both sides' fp16 modules in the arithmetic of their layout's device (stateful: the
    GPU's, ane: the Neural Engine's), lossless against the target's own greedy decoding so computed, every drafter
    tensor within its limit: the scaled pair accepts what the unscaled pair accepts, away from near ties (fp16 at the
    two pairs' magnitudes may order a drafter's two tied logits either way: then their drafter calls agree id for id
    until the first such tie). Without the range scales the same checkpoints fail (exit 1), naming a drafter tensor past
    fp16."""
    target = residual_scaled(TARGET, tmp_path / "scaled", FACTOR)
    if kind == "dflash2":
        plain_drafter, drafter, text = DRAFTER, drafter_residual_scaled(DRAFTER, tmp_path / "drafter", FACTOR), RECIPE
    else:
        plain_drafter, drafter, text = MTP, mtp_residual_scaled(MTP, tmp_path / "mtp", 4 * FACTOR), MTP_RECIPE
    text = in_layout(text, layout)
    recorded = []
    for pair in ((TARGET, plain_drafter), (target, drafter)):
        calls = DrafterCalls()
        monkeypatch.setattr(drafter_accept, "DeviceFunctions", calls.functions())
        recorded.append((accept(tmp_path, *pair, text, "device")[1], calls.calls))
    (plain, plain_calls), (rescaled, scaled_calls) = recorded
    for result in (plain, rescaled):
        assert result["lossless"] is True and result["range"]["passed"] and result["range"]["checked"] > 20
    assert len(plain_calls) >= 10 and plain["tokens_per_round"] > 1.5  # dflash2, stateful: 11 drafts recorded
    parting = first_parting(plain_calls, scaled_calls)
    if parting is None:
        assert rescaled["tokens_per_round"] == plain["tokens_per_round"]
        assert rescaled["acceptance_by_position"] == plain["acceptance_by_position"]
    else:  # measured: mtp, ane (docs/fp16.md, bench.mtp_ane_pairs)
        assert part_at_a_near_tie(plain_calls, scaled_calls, NEAR_TIE_LOGITS), (plain_calls[parting],
                                                                                 scaled_calls[parting])
    monkeypatch.undo()
    recipe = tmp_path / "raw.yaml"
    recipe.write_text(text.format(target=target, drafter=drafter).replace("  context: 512\n",
                                                                          "  context: 512\n  rescale: false\n"))
    result = CliRunner().invoke(main, ["accept", str(recipe), "--runtime", "device"])
    assert result.exit_code == 1, result.output
    assert re.search(r"range: drafter\.[\w.]+ \((output|input|port)\)", result.output), result.output


def test_an_mtp_head_at_scale_accepts_as_the_unscaled_head(tmp_path):
    """The MTP head's own residual stream (its fc, o_proj and down_proj) times 16384 (its peak near 7 past 1e5) beside
    the residual-scaled target: the head's range scale folds it back (printed), and the pair accepts exactly what the
    unscaled pair accepts."""
    target = residual_scaled(TARGET, tmp_path / "scaled", FACTOR)
    head = mtp_residual_scaled(MTP, tmp_path / "mtp", 4 * FACTOR)
    _, plain = accept(tmp_path, TARGET, MTP, MTP_RECIPE)
    output, rescaled = accept(tmp_path, target, head, MTP_RECIPE)
    found = re.search(r"range \(gpu, headroom 4x\): mtp drafter's residual stream x 1/(\d+)", output)
    assert found and int(found.group(1)) >= 8, output
    peak = re.search(r"drafter\.layers\.0[^\n]*\(output\): peak ([\d.e+]+)", output)
    assert peak and float(peak.group(1)) >= 1e5, output  # the head's stream at the magnitude real checkpoints have
    assert rescaled["lossless"] is True and plain["lossless"] is True
    assert rescaled["tokens_per_round"] == plain["tokens_per_round"] > 1.5
    assert rescaled["rounds"] == plain["rounds"]
    assert rescaled["acceptance_by_position"] == plain["acceptance_by_position"]


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["stateful", "ane"])
def test_the_scaled_pair_bundle_accepts_on_the_runtime_as_the_unscaled(tmp_path, layout):
    """Both pairs built (target and drafter in ``layout``, both formats, every check passing), then run on the Core AI
    runtime through the host contract: the scaled pair's packages accept what the unscaled pair's accept."""
    scaled = residual_scaled(TARGET, tmp_path / "scaled", FACTOR)
    drafter = drafter_residual_scaled(DRAFTER, tmp_path / "drafter", FACTOR)
    results = []
    for target, draft in ((TARGET, DRAFTER), (scaled, drafter)):
        text = RECIPE.format(target=target, drafter=draft).replace("backends: [coreai]", "backends: [coreai, coreml]")
        text = in_layout(text, layout)
        recipe = tmp_path / f"{target.name}-{layout}.yaml"
        recipe.write_text(text)
        bundle = tmp_path / f"{target.name}-{layout}-bundle"
        result = CliRunner().invoke(main, ["build", str(recipe), "--output", str(bundle)])
        assert result.exit_code == 0, result.output
        result = CliRunner().invoke(main, ["accept", str(recipe), "--runtime", "coreai", "--bundle", str(bundle),
                                           "--json"])
        assert result.exit_code == 0, result.output
        results.append(json.loads(result.stdout)["acceptance"])
    plain, rescaled = results
    assert rescaled["lossless"] is True and plain["lossless"] is True
    assert rescaled["acceptance_by_position"] == plain["acceptance_by_position"]
    # measured 1.5 for both, both layouts (the runtime's run: one 32-token prompt, 16 tokens; torch's: 2 x 48, 24)
    assert rescaled["tokens_per_round"] == plain["tokens_per_round"] > 1.0
