"""The shipped recipes validate and plan; contracts pin config.json values and refuse a checkpoint that differs."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from convert.cli import main

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(autouse=True)
def empty_offline_hub(tmp_path, monkeypatch):
    """The release recipes pin hf:// sources: an empty cache and no network, as on CI."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def dry_run(recipe: Path):
    return CliRunner().invoke(main, ["build", str(recipe), "--dry-run"])


def test_dflash2_27b_plans_from_its_contract():
    """The headline pair in the ane layout (target and drafter), as anemll-forge ships it: the target at forge's
    largest context with its ladder, every host buffer with its bytes, and what the lint expects of the planned
    shapes: no finding in the target's parts or the drafter (its head's logits in 4 outputs of 62,080 rows, within the
    ANE's 65,536, which the host puts side by side)."""
    result = dry_run(RECIPES / "dflash2_27b.yaml")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "planned from the recipe's contracts" in out
    assert "outputs: taps [1, 8, 25600] float16, logits [1, 8, 248320] float16" in out  # 5 taps x hidden 5120
    assert "ladder: entries at 8,192, 16,384, 32,768 beside 65,472 positions" in out
    assert "host buffers: 4174.4 MiB in all, owned and written by the host (layout ane)" in out
    assert "placement lint of the planned shapes: no finding" in out  # the target's parts
    assert "anchor_embedding [1, 1, 5120] float16, rope_cos [8, 64] float16" in out
    assert ("outputs: logits_0 [1, 7, 62080] float16, logits_1 [1, 7, 62080] float16, logits_2 [1, 7, 62080] "
            "float16, logits_3 [1, 7, 62080] float16, selector_projected [1, 7, 256] float16") in out  # the host walks
    assert "ring_keys [5, 8, 2048, 128] float16: 20.00 MiB" in out and "ring_mask_2048 [2048, 8] float16" in out
    assert "host buffers: 40.0 MiB in all" in out
    assert "taps [1, 64, 25600] float16, rope_cos [64, 64] float16" in out  # context_update width 64
    drafter = out[out.index("  drafter dflash2"):]
    assert "    placement lint of the planned shapes: no finding (the ops are linted when packaged)" in drafter
    assert "mask id 248070, 5 sliding layers (windows [2048])" in out
    assert "parameters: 1,924,404,480" in out  # the published 3.85 GB of bf16
    assert "parameters: 26,895,998,464" in out and "about 50.10 GiB of fp16 weights each" in out  # the target
    # the measured cost model: 48 x 16.1 s + 16 x 13.4 s + 5.2 s + 3.7 s at 128 x 2048 tokens = 16.6 min
    assert "estimated quantize time (lut4-gptq, 128 x 2048 calibration tokens): 17 min on one H200" in out
    # parts under the default 2000 MB and packaged within the default 16 GB (convert/pipeline/partition.py's measured
    # cost per weight, beside the build process's base): 7 decoder layers (7 x ~383 M weights) a part, the first
    # beside the host's embedding table, the head in 4 parts of at most 65,536 rows (a logit a row)
    assert "parts: 14 (target.max_part_mb 2000, target.max_host_memory_gb 16), chained by the host" in out
    # which bound chose them: 10 layers (10 x ~185 MB) fit the device's 2000 MB, but the host packages 7
    assert "layer chunks: 7 layers from the first, set by the host memory bound (the device's 2000 MB alone: 10; " \
        "host memory alone: 7, packaging about 5 bytes a layer weight within 12.67 GiB)" in out
    assert "tables: 4 parts each, set by the device bound (device alone: 4, at most 65,536 rows a head part" in out
    assert "layers-0-5: the host's embedding table (not packaged), layers 0..5, taps [5]: 1.08 GiB (packaging " \
        "about 14.5 GB)" in out
    assert "layers-62-63: layers 62..63: 369.79 MiB" in out
    assert "head-1of4: norm + lm_head rows 0..62079: 151.69 MiB" in out
    # the drafter stage's fp32 session holds the host's buffers at the 144 positions its prompts reach (64 + 64 tokens
    # and two verifies), not the whole 65,472 rows (8.23 GiB: 29.6 GB in all)
    assert "estimated peak host memory: 21.0 GB (target.max_host_memory_gb 16)" in out
    assert ("estimated drafter stage: 21.0 GB (its largest phase, accept: the target (its quantized weights as "
            "packed codes) 12.58 GiB, the drafter 5.61 GiB, 1 session of prompts run at once, its states 262.77 MiB "
            "(at 144 positions))") in out


def test_bonsai2_27b_plans_the_exact_pack_from_its_contract():
    """The ternary pack shipped as it is: the bundle size from the real shapes (2-bit codes and an fp16 scale per 128
    columns; in_proj_a / in_proj_b, norms, conv and A_log fp16), under forge's 9.9 GB target, and the rotations'
    work: 401 rotated linears and the embedding, 10 butterfly additions and 2 multiplications a feature at block
    1024."""
    result = dry_run(RECIPES / "bonsai2_27b_dflash2.yaml")
    assert result.exit_code == 0, result.output
    out = result.output
    # the prompts' sessions at the 144 positions they reach: 4 at once within 16 GB (at the whole 8,192-row context
    # a session's states were 1.24 GiB and one fit)
    assert "estimated drafter stage: 15.7 GB (its largest phase, accept: the target (its quantized weights as " \
        "packed codes) 6.90 GiB, the drafter 5.61 GiB, 4 sessions of prompts run at once, their states 1.03 GiB " \
        "(at 144 positions))" in out
    assert "parameters: 26,895,998,464" in out
    # the packages' weights: the embedding table is the host's in the ane layout (6.70 GiB with it, stateful)
    assert "shipped weights: 6.38 GiB per format (2.04 bits a parameter; 50.10 GiB in fp16)" in out
    assert "rotations (block 1024, butterflies): 402 signed Hadamard transforms a token over 2,910,208 features: " \
        "34,922,496 additions and multiplications a token, 0.14% of the linears' 25,598,361,600 multiply-adds" in out
    assert "parts: 14 (target.max_part_mb 2000" in out and "estimated quantize time" not in out
    assert "host buffers: 594.4 MiB in all" in out and "layout ane" in out
    assert "drafter dflash2 hf://ProCreations/Ternary-Bonsai-2-27B-DFlash2@4cfb6ad" in out
    drafter = out[out.index("  drafter dflash2"):]  # its head (the pack's exact lm_head) in 4 parts: no finding
    assert "logits_3 [1, 7, 62080] float16" in drafter and "placement lint of the planned shapes: no finding" in drafter


def test_the_quantize_estimate_of_round_to_nearest_is_the_cpu_measurement(tmp_path):
    """affine4 (no calibration) measured on 2 CPU cores: 48 x 22.9 s + 16 x 21.3 s + 68.0 s + 83.0 s = 26.5 min."""
    text = (RECIPES / "dflash2_27b.yaml").read_text().replace("method: lut4-gptq\n    calibration: "
                                                              "{samples: 128, length: 2048}", "method: affine4")
    (tmp_path / "r.yaml").write_text(text)
    out = dry_run(tmp_path / "r.yaml").output
    assert "estimated quantize time (affine4): 27 min on 2 CPU cores" in out


def test_the_quantize_estimate_scales_with_the_calibration_tokens(tmp_path):
    """A quarter of the tokens: the GPTQ solves stay, the rest shrinks 4x (48 x 7.25 + 16 x 6.725 + 3.85 + 0.925 s)."""
    text = (RECIPES / "dflash2_27b.yaml").read_text().replace("{samples: 128, length: 2048}",
                                                              "{samples: 32, length: 2048}")
    (tmp_path / "r.yaml").write_text(text)
    out = dry_run(tmp_path / "r.yaml").output
    assert "estimated quantize time (lut4-gptq, 32 x 2048 calibration tokens): 8 min on one H200" in out


@pytest.mark.parametrize("recipe", ["dflash2_27b.yaml", "qwen3_mtp_27b.yaml"])
def test_release_targets_plan_the_hybrid_functions_and_buffers(recipe):
    """The contract pins Qwen3.8-27B's text_config: 48 Gated DeltaNet + 16 attention layers, every host buffer with
    its bytes (KV history for the attention layers only; conv, recurrent and pending rows per GDN layer)."""
    out = dry_run(RECIPES / recipe).output
    verify = 8 if recipe == "dflash2_27b.yaml" else 3
    assert "(48 Gated DeltaNet L, 16 gated attention F)" in out
    assert "inputs:  hidden_states [1, 64, 5120] float16, rope_cos [64, 32] float16, rope_sin [64, 32] float16, " \
        "history_mask [1, 65472] float16" in out
    assert f"inputs:  hidden_states [1, {verify}, 5120] float16, rope_cos [{verify}, 32] float16" in out
    assert "key_history [16, 4, 65472, 256] float16: 2.00 GiB" in out
    assert "conv_state [48, 3, 10240] float16: 2.81 MiB" in out
    assert "recurrent_state [48, 48, 128, 128] float16: 72.00 MiB" in out
    assert f"pending_qkv [48, {verify}, 10240] float16" in out and f"pending_ba [48, {verify}, 96] float16" in out


def test_the_27b_target_plans_the_ane_layout_with_its_ladder(tmp_path):
    """dflash2_27b's target alone (ane, at forge's largest context, with a ladder): every entry's history, the host's
    buffers and table, head parts within the ANE's 65,536 rows, and no lint finding in the planned shapes (the
    stateful plan's states are findings)."""
    text = (RECIPES / "dflash2_27b.yaml").read_text()
    target = text[: text.index("\ndrafter:")] + "\n"
    recipe = tmp_path / "ane.yaml"
    recipe.write_text(target)
    result = dry_run(recipe)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "rollback: spec-convert/commit-next-call-host-buffers v1" in out
    for rung in (8192, 16384, 32768):
        assert f"verify_{rung} inputs: hidden_states [1, 8, 5120] float16" in out
        assert f"key_history [16, 4, {rung}, 256] float16, value_history [16, 4, {rung}, 256] float16" in out
    assert "key_history [16, 4, 65472, 256] float16: 2.00 GiB" in out
    assert "recurrent_state [48, 48, 128, 128] float16: 72.00 MiB" in out
    assert "host buffers: 4174.4 MiB in all" in out and "host embedding table: [248320, 5120] fp16, 2425.0 MiB" in out
    assert "ladder: entries at 8,192, 16,384, 32,768 beside 65,472 positions" in out
    assert "layers-0-5: the host's embedding table (not packaged), layers 0..5, taps [5]" in out
    assert "head-1of4: norm + lm_head rows 0..62079" in out and "head-4of4: norm + lm_head rows 186240..248319" in out
    assert "placement lint of the planned shapes: no finding" in out
    stateful = tmp_path / "stateful.yaml"
    lines = [line for line in target.splitlines(keepends=True) if not line.startswith(("  layout:", "  ladder:"))]
    stateful.write_text("".join(lines).replace("  context: 65472", "  context: 8192"))
    assert "placement lint of the planned shapes: 30 findings" in " ".join(dry_run(stateful).output.split())


def test_qwen3_mtp_27b_plans_from_its_contract():
    result = dry_run(RECIPES / "qwen3_mtp_27b.yaml")
    assert result.exit_code == 0, result.output
    assert "drafter mtp hf://Qwen/Qwen3.8-27B@1d4bf0f (its own mtp.* tensors)" in result.output
    assert "parameters: 424,699,392" in result.output  # fc, one gated attention layer, MLP: the target's geometry
    assert "key_history [1, 4, 65472, 256] float16: 127.88 MiB" in result.output  # the head's own, the host's
    assert "token_embeddings [1, 3, 5120] float16, hidden [1, 3, 5120] float16, rope_cos [3, 32] float16" in \
        result.output
    assert ("outputs: logits_0 [1, 3, 62080] float16, logits_1 [1, 3, 62080] float16, logits_2 [1, 3, 62080] "
            "float16, logits_3 [1, 3, 62080] float16, hidden_out [1, 3, 5120] float16, key_rows [1, 4, 3, 256]") in \
        result.output
    drafter = result.output[result.output.index("  drafter mtp"):]
    assert "    placement lint of the planned shapes: no finding (the ops are linted when packaged)" in drafter


@pytest.mark.parametrize("recipe", ["dflash2_27b.yaml", "qwen3_mtp_27b.yaml"])
def test_release_recipes_need_their_checkpoints_to_build(recipe):
    result = CliRunner().invoke(main, ["build", str(RECIPES / recipe)])
    assert result.exit_code == 2 and "hf://Qwen/Qwen3.8-27B@1d4bf0f is not in the Hugging Face cache" in result.output


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


def test_a_drafter_of_another_width_is_refused(tmp_path):
    from tests.helpers.dflash2_checkpoints import tiny_config, write_drafter

    draft = {"target_layer_ids": [1, 2, 4, 5, 6], "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2,
             "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    config = tiny_config(vocab_size=8192, num_target_layers=8, dflash_config=draft)  # hidden 64, not 256
    write_drafter(tmp_path / "d", config=config)
    recipe = (RECIPES / "tiny_qwen3_dflash2.yaml").read_text().replace(
        "path:../fixtures/stdlib-qwen3-dflash2", f"path:{tmp_path / 'd'}").replace(
        "path:../fixtures/", f"path:{RECIPES.parent}/fixtures/")
    (tmp_path / "r.yaml").write_text(recipe)
    result = dry_run(tmp_path / "r.yaml")
    assert result.exit_code == 2 and "hidden_size 64 differs from the target's 256: not its drafter" in result.output


def test_an_mtp_drafter_needs_the_hidden_output(tmp_path):
    recipe = (RECIPES / "tiny_qwen3_mtp.yaml").read_text().replace(
        "path:../fixtures/", f"path:{RECIPES.parent}/fixtures/").replace("  hidden: true", "  hidden: false")
    (tmp_path / "r.yaml").write_text(recipe)
    result = dry_run(tmp_path / "r.yaml")
    assert result.exit_code == 2
    assert "target.hidden: an MTP drafter reads the target's final-norm hidden" in result.output
