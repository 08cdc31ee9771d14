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
from checkpoints import write_checkpoint
from click.testing import CliRunner
from dflash2_checkpoints import tiny_config, write_drafter
from safetensors.torch import load_file, save_file

from convert.cli import main

pytestmark = pytest.mark.slow

TAPS = [0, 2, 3]
TARGET = """\
name: {name}
target:
  source: path:{source}
  graphs: {{prefill: 16, decode: 1, verify: 8}}
  context: 128
  taps: {taps}
  gate:  # random weights have near-flat logits: fp16 rounding flips a few argmax ids
    data: {{samples: 2, length: 48}}
    greedy_tokens: 8
    thresholds: {{top1_min: 0.95, greedy_match_min: 0.5}}
backends: [{backends}]
"""
DRAFTER = """\
drafter:
  kind: dflash2
  source: path:{source}
  context_update: 16
  ring: 64
  quantization: {{method: lut4}}
  accept: {{samples: 2, length: 24, tokens: 16}}
"""


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def build(tmp: Path, name: str, source: Path, taps=TAPS, drafter: Path | None = None, backends="coreml") -> Path:
    recipe = tmp / f"{name}.yaml"
    text = TARGET.format(name=name, source=source, taps=taps, backends=backends)
    recipe.write_text(text + (DRAFTER.format(source=drafter) if drafter else ""))
    result = run("build", str(recipe), "--output", str(tmp / name))
    assert result.exit_code == 0, result.output
    return tmp / name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    write_checkpoint(tmp / "target", hidden_size=64, num_hidden_layers=4)
    draft = {"target_layer_ids": TAPS, "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2,
             "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    write_drafter(tmp / "drafter", config=tiny_config(vocab_size=4096, dflash_config=draft))
    (tmp / "drafter" / "LICENSE").write_text("Apache-2.0 drafter test license\n")
    bundle = build(tmp, "pair", tmp / "target", drafter=tmp / "drafter", backends="coreai, coreml")
    return tmp, bundle


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
    assert binding["lm_head_sha256"] == target["weights"]["lm_head_sha256"]
    assert binding["taps"]["layers"] == TAPS == target["taps"]["layers"]
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
    result = run("check-pair", str(bundle / "drafter"), str(bundle / "target"))
    assert result.exit_code == 0, result.output
    result = run("inspect", str(bundle))  # a pair: both manifests
    assert result.exit_code == 0 and "drafter export id" in result.output and target["export_id"] in result.output


def test_refuses_other_lm_head(pair):
    tmp, bundle = pair
    other = build(tmp, "lm-head", variant(tmp, "ckpt-lm-head", edit_tensor("lm_head.weight", 7)))
    assert "target.lm_head_sha256" in refusal(bundle / "drafter", other).splitlines()[0]


def test_refuses_other_tap_order(pair):
    tmp, bundle = pair
    other = build(tmp, "taps", tmp / "target", taps=[3, 2, 0])
    output = refusal(bundle / "drafter", other)
    assert "target.taps" in output.splitlines()[0]
    assert "lm_head" not in output  # the same tables: only the tap order (and so the export id) differs


def test_refuses_other_tokenizer(pair):
    tmp, bundle = pair

    def edit(directory: Path) -> None:
        path = directory / "tokenizer.json"
        path.write_text(path.read_text().replace("<|mask|>", "<|MASK|>"))

    other = build(tmp, "tokenizer", variant(tmp, "ckpt-tokenizer", edit))
    output = refusal(bundle / "drafter", other)
    assert "target.tokenizer_json_sha256" in output.splitlines()[0]
    assert "lm_head" not in output


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
    assert "target.lm_head_file_sha256" in refusal(bundle / "drafter", copy).splitlines()[0]


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
    result = run("accept", str(tmp / "pair.yaml"), "--runtime", "coreai", "--bundle", str(bundle), "--tokens", "6")
    assert result.exit_code == 0, result.output
    assert "runtime: coreai" in result.output and "lossless True" in result.output
    result = run("accept", str(tmp / "pair.yaml"), "--runtime", "coreai")
    assert result.exit_code == 2 and "--bundle" in result.output
