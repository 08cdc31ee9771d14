"""The fixture targets (dense and hybrid) with their trained drafters, built from the shipped recipes.

Minutes each on 2 cores.

Each build gates the target, measures speculative decoding on held-out prompts (lossless or the build fails),
runs the paired A/B of the 4-bit drafter against the fp16 one (a significant loss fails the build), packages
both parts in both formats, replays a recorded run on the Core AI runtime and checks the pair. The hybrid pairs
then run `accept --runtime coreai` on the built bundle: the packages through the host contract, with the
economics, the n-gram baseline and the A/B. The same four recipes with target and drafter in the ane layout build
with `--strict` (no placement finding in any package) and run on the Core AI runtime through their hosts.
"""

import json
import re
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


def ane_recipe(recipe: str, to: Path) -> Path:
    """The shipped recipe with ``layout: ane`` for its target and its drafter (sources made absolute)."""
    text = (RECIPES / recipe).read_text().replace("path:../", f"path:{RECIPES.parent}/")
    text = text.replace("  context: 512\n", "  context: 512\n  layout: ane\n", 1)
    text = re.sub(r"\ndrafter:\n  kind: (\w+)\n", lambda m: m.group(0) + "  layout: ane\n", text, count=1)
    assert text.count("layout: ane") == 2, recipe
    to.write_text(text)
    return to


@pytest.mark.parametrize("recipe, min_tokens_per_round", [("tiny_qwen3_dflash2.yaml", 2.0),
                                                          ("tiny_qwen3_mtp.yaml", 1.8),
                                                          ("tiny_qwen3_5_dflash2.yaml", 2.0),
                                                          ("tiny_qwen3_5_mtp.yaml", 1.8)])
def test_fixture_pair_builds_in_the_ane_layout(tmp_path, recipe, min_tokens_per_round):
    ane = ane_recipe(recipe, tmp_path / "ane.yaml")
    result = CliRunner().invoke(main, ["build", str(ane), "--output", str(tmp_path / "b"), "--strict"])
    assert result.exit_code == 0, result.output
    drafter = json.loads((tmp_path / "b" / "drafter" / "manifest.json").read_text())
    target = json.loads((tmp_path / "b" / "target" / "manifest.json").read_text())
    packages = drafter["packages"] + target["packages"]
    assert len(packages) == 4 and all(p["placement"] == [] for p in packages)
    assert drafter["host_contract"]["buffers"] and target["host_contract"]["buffers"]
    assert drafter["acceptance"]["lossless"] is True
    assert drafter["acceptance"]["tokens_per_round"] > min_tokens_per_round
    result = CliRunner().invoke(main, ["accept", str(ane), "--runtime", "coreai", "--bundle", str(tmp_path / "b"),
                                       "--json"])
    assert result.exit_code == 0, result.output
    coreai = json.loads(result.stdout)["acceptance"]
    assert coreai["lossless"] is True and coreai["real_flips"] == 0 and coreai["tokens_per_round"] > 1.5
