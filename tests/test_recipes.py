"""The shipped recipes validate and plan; contracts pin config.json values and refuse a checkpoint that differs."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def dry_run(recipe: Path):
    return CliRunner().invoke(main, ["build", str(recipe), "--dry-run"])


def test_dflash2_27b_plans_from_its_contract():
    result = dry_run(RECIPES / "dflash2_27b.yaml")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "planned from the recipe's contracts" in out
    assert "taps [1, 8, 25600] float16 (layers [5, 19, 33, 47, 61])" in out  # 5 taps x hidden 5120
    assert "anchor_embedding [1, 1, 5120] float16" in out and "draft_ids [1, 7] int32" in out
    assert "ring_keys [5, 8, 2048, 128] float16" in out and "ring_laps [1, 2048] float16" in out
    assert "taps [1, 64, 25600] float16, position_ids [1, 64] int32" in out  # context_update width 64
    assert "not pinned (read from config.json at build time): intermediate_size, dflash_config.mask_token_id" in out


def test_qwen3_mtp_27b_plans_from_its_contract():
    result = dry_run(RECIPES / "qwen3_mtp_27b.yaml")
    assert result.exit_code == 0, result.output
    assert "hidden [1, 3, 5120] float16" in result.output
    assert "accept" in result.output and "draft_ids [1, 3] int32, hidden_out [1, 3, 5120] float16" in result.output


@pytest.mark.parametrize("recipe", ["dflash2_27b.yaml", "qwen3_mtp_27b.yaml"])
def test_release_recipes_need_their_checkpoints_to_build(recipe):
    result = CliRunner().invoke(main, ["build", str(RECIPES / recipe)])
    assert result.exit_code == 2 and "does not exist" in result.output


@pytest.mark.parametrize("recipe", ["tiny_qwen3_dflash2.yaml", "tiny_qwen3_mtp.yaml"])
def test_fixture_pair_recipes_plan(recipe):
    result = dry_run(RECIPES / recipe)
    assert result.exit_code == 0, result.output
    assert "drafter" in result.output and "planned from the recipe's contracts" not in result.output


def test_contract_mismatch_is_refused(tmp_path):
    recipe = (RECIPES / "tiny_qwen3_dflash2.yaml").read_text().replace(
        "path:../fixtures/", f"path:{RECIPES.parent}/fixtures/")
    pinned = recipe.replace("  context: 512\n", "  context: 512\n  contract: {hidden_size: 512}\n", 1)
    (tmp_path / "r.yaml").write_text(pinned)
    result = dry_run(tmp_path / "r.yaml")
    assert result.exit_code == 2
    assert "target.contract.hidden_size: the recipe pins 512; config.json has 256" in result.output
    drafter_pin = recipe.replace("  ring: 2048", "  ring: 2048\n  contract: {dflash_config.selector_rank: 256}")
    (tmp_path / "d.yaml").write_text(drafter_pin)
    result = dry_run(tmp_path / "d.yaml")
    assert result.exit_code == 2
    assert "drafter.contract.dflash_config.selector_rank: the recipe pins 256; config.json has 32" in result.output


def test_taps_must_match_the_drafter(tmp_path):
    recipe = (RECIPES / "tiny_qwen3_dflash2.yaml").read_text().replace(
        "path:../fixtures/", f"path:{RECIPES.parent}/fixtures/")
    recipe = recipe.replace("taps: [1, 2, 4, 5, 6]", "taps: [2, 1, 4, 5, 6]")
    (tmp_path / "r.yaml").write_text(recipe)
    result = dry_run(tmp_path / "r.yaml")
    assert result.exit_code == 2 and "target.taps [2, 1, 4, 5, 6] must equal" in result.output
