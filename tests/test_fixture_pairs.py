"""The fixture targets (dense and hybrid) with their trained drafters, built from the shipped recipes.

Minutes each on 2 cores.

Each build gates the target, measures speculative decoding on held-out prompts (lossless or the build fails),
runs the paired A/B of the 4-bit drafter against the fp16 one (a significant loss fails the build), packages
both parts in both formats, replays a recorded run on the Core AI runtime and checks the pair. The hybrid pairs
then run `accept --runtime coreai` on the built bundle: the packages through the host contract, with the
economics, the n-gram baseline and the A/B.
"""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main

pytestmark = pytest.mark.heavy
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.mark.parametrize("recipe, min_tokens_per_round", [("tiny_qwen3_dflash2.yaml", 2.0),
                                                          ("tiny_qwen3_mtp.yaml", 1.8),
                                                          ("tiny_qwen3_5_dflash2.yaml", 2.0),
                                                          ("tiny_qwen3_5_mtp.yaml", 1.8)])
def test_fixture_pair_builds(tmp_path, recipe, min_tokens_per_round):
    result = CliRunner().invoke(main, ["build", str(RECIPES / recipe), "--output", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    drafter = json.loads((tmp_path / "b" / "drafter" / "manifest.json").read_text())
    acceptance, ab = drafter["acceptance"], drafter["ab"]
    assert acceptance["lossless"] is True and acceptance["real_flips"] == 0
    assert acceptance["tokens_per_round"] > min_tokens_per_round  # measured: dense 2.9 / 2.5, hybrid 3.2 / 2.2
    assert ab["significant_loss"] is False and ab["fp16_tokens_per_round"] > min_tokens_per_round
    assert drafter["quantization"]["method"].startswith("lut4")
    economics, ngram = acceptance["economics"], acceptance["ngram"]
    assert economics["predicted_speedup"] > 1.0 and ngram["lossless"] is True
    result = CliRunner().invoke(main, ["check-pair", str(tmp_path / "b" / "drafter"), str(tmp_path / "b" / "target")])
    assert result.exit_code == 0, result.output
    if "qwen3_5" in recipe:  # the hybrid pairs also on the Core AI runtime: the packages through the host contract
        result = CliRunner().invoke(main, ["accept", str(RECIPES / recipe), "--runtime", "coreai", "--bundle",
                                           str(tmp_path / "b"), "--json"])
        assert result.exit_code == 0, result.output
        coreai = json.loads(result.stdout)["acceptance"]
        assert coreai["lossless"] is True and coreai["tokens_per_round"] > 1.5
        assert coreai["ngram"]["lossless"] is True and coreai["economics"]["predicted_speedup"] > 1.0
