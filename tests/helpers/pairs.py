"""The dense pair two modules read (tests/test_pair.py, tests/test_verify_bundle.py): a seeded tiny Qwen3 target
(hidden 64, 4 layers, affine4) and a seeded random DFlash2 drafter (lut4) tapping layers 0, 2 and 3, both formats.

Random weights quantized to 4 bits agree with their fp32 selves on few argmax ids: the gate's bars are set out of
the way (identity, packaging, verify and the lossless check do not depend on quality)."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main
from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.dflash2_checkpoints import tiny_config, write_drafter
from tests.helpers.recipes import gate, recipe, tiny_dflash2, tiny_target
from tests.helpers.shared import built_once

TAPS = [0, 2, 3]
DRAFT = {"target_layer_ids": TAPS, "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2,
         "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
QUANTIZATION = {"method": "affine4", "group_size": 32}
OUT_OF_THE_WAY = {"top1_min": 0, "greedy_match_min": 0, "cosine_min": 0, "tap_cosine_min": 0, "mean_kl_max": 10,
                  "p99_kl_max": 50, "max_kl_max": 100, "device_top1_min": 0, "device_greedy_match_min": 0,
                  "device_mean_kl_max": 10}


def pair_target(source: Path, taps=TAPS, **fields) -> dict:
    """The pair's target fields for ``source``: what a variant changes is ``source``, ``taps`` or ``fields``."""
    bars = gate(2, 48, greedy_tokens=8, **OUT_OF_THE_WAY)
    return tiny_target(source, taps=list(taps), quantization=dict(QUANTIZATION), gate=bars, **fields)


def _make(folder: Path) -> None:
    write_checkpoint(folder / "target", hidden_size=64, num_hidden_layers=4)
    write_drafter(folder / "drafter", config=tiny_config(vocab_size=4096, dflash_config=DRAFT))
    (folder / "drafter" / "LICENSE").write_text("Apache-2.0 drafter test license\n")
    path = recipe(folder, "pair", target=pair_target(folder / "target"), backends=["coreai", "coreml"],
                  drafter=tiny_dflash2(folder / "drafter"))
    result = CliRunner().invoke(main, ["build", str(path), "--output", str(folder / "pair")])
    assert result.exit_code == 0, result.output
    (folder / "build-output.txt").write_text(result.output)


def dense_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared folder: ``target/``, ``drafter/`` (checkpoints), ``pair.yaml``, ``pair/`` (the bundle),
    ``build-output.txt`` and ``cache/`` (its build cache). Read it; copy before changing."""
    return built_once(tmp_path_factory, "dense-pair", _make)
