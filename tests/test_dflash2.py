"""DFlash2 / DFlash drafter: config and checkpoint layouts, export modules vs the eager reference, packages on the
Core AI runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from convert.backends import coreai, coreml
from convert.errors import InputError
from convert.models import dflash2 as D
from tests.helpers.dflash2_checkpoints import LAYOUTS, target_tensors, tiny_config, write_drafter

RING, MAX_POSITIONS, UPDATE, APPEND = 64, 256, 64, 8
FP32_LOGITS_BOUND = 1e-4
FP16_RELATIVE_BOUND = 2e-2
FLIP_GAP = 0.25  # a runtime id may differ from torch's fp16 id only where torch's top-2 score gap is below this


@pytest.fixture(scope="module")
def target():
    return target_tensors()


@pytest.fixture(scope="module")
def features():
    return torch.randn(160, len(tiny_config()["dflash_config"]["target_layer_ids"]) * 64,
                       generator=torch.Generator().manual_seed(7))


def drafter(tmp_path: Path, layout: str = "plain", **config_overrides):
    config = tiny_config(layers=1 if layout == "aliases" else 2, **config_overrides)
    model, _ = write_drafter(tmp_path, layout, config)
    args, tensors = D.load_checkpoint(tmp_path)
    return model, args, tensors


def modules(args, tensors, target, dtype=torch.float32):
    return D.build_modules(args, dict(tensors), target["lm_head"], target["embed_tokens"][args.mask_token_id], dtype,
                           MAX_POSITIONS, ring_rows=RING, update_width=UPDATE, append_width=APPEND, logits=True)


def padded(positions: list[int], width: int) -> list[int]:
    """A chunk right-padded by repeating its last real row (same position, same features)."""
    return positions + [positions[-1]] * (width - len(positions))


def write_context(mods, features, positions: list[int], update: bool = True) -> list[np.ndarray]:
    """One context_update (first 64 rows, padded) when ``update``, then context_append chunks of 8 (last padded)."""
    written, start = [], 0
    chunks = []
    if update:
        chunks.append(("context_update", positions[:UPDATE], UPDATE))
        start = UPDATE
    chunks += [("context_append", positions[i:i + APPEND], APPEND) for i in range(start, len(positions), APPEND)]
    for name, chunk, width in chunks:
        if not chunk:
            continue
        rows = padded(chunk, width)
        out = mods.call(name, taps=features[rows][None], position_ids=[rows])
        written.append(out["written"].numpy())
    return written


def draft_inputs(target, anchor: int, p0: int, dtype=torch.float32) -> dict:
    return {
        "anchor_embedding": target["embed_tokens"][anchor].to(dtype)[None, None],
        "anchor_id": [[anchor]],
        "position_ids": [list(range(p0, p0 + 8))],
    }


def reference_draft(model, target, features, anchor, p0, positions=None):
    rows = features if positions is None else features[positions]
    with torch.no_grad():
        return model.draft(rows, target["embed_tokens"][anchor], target["embed_tokens"][3], target["lm_head"],
                           anchor, p0, positions=positions)


# ---------------------------------------------------------------------------------------------------- config


def test_config_fields_and_styles():
    args = D.DFlash2Args.from_config(tiny_config())
    assert (args.architecture, args.target_layer_ids, args.tap_convention) == (
        "DFlash2DraftModel", (0, 2, 3), "output-of-layer-0-based")
    assert (args.block_size, args.mask_token_id, args.layer_windows) == (8, 3, (48, 48))
    assert (args.conv_kernel_size, args.conv_group_size, args.selector_rank, args.selector_top_k) == (2, 16, 16, 8)
    v4 = tiny_config(window=None, rope_theta=1e6, block_size=16)
    del v4["rope_parameters"], v4["dflash_config"]["block_size"]
    args = D.DFlash2Args.from_config(v4)
    assert (args.rope_theta, args.block_size, args.layer_windows) == (1e6, 16, (None, None))
    mixed = tiny_config(layer_types=["full_attention", "sliding_attention"])
    assert D.DFlash2Args.from_config(mixed).layer_windows == (None, 48)
    v1 = D.DFlash2Args.from_config(tiny_config("dflash"))
    assert (v1.architecture, v1.has_conv, v1.has_selector) == ("DFlashDraftModel", False, False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), r"drafter/config.json: field 'architectures'"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), r"field 'dflash_config.target_layer_ids'"),
        (lambda c: c["dflash_config"].pop("selector_top_k"), r"field 'dflash_config.selector_top_k' is missing"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), r"field 'dflash_config.mask_token_id' is missing"),
        (lambda c: c["dflash_config"].pop("block_size"), r"'dflash_config.block_size' \(or top-level"),
        (lambda c: c["dflash_config"].update(conv_group_size=24), r"conv_group_size 24 must divide hidden_size 64"),
        (lambda c: c.update(is_causal=True), r"field 'is_causal' is True: a causal draft block"),
        (lambda c: c.update(layer_types=["sliding_attention"]), r"field 'layer_types' has 1 entries"),
    ],
)
def test_config_refusals_name_the_file_and_field(change, message):
    config = tiny_config()
    change(config)
    with pytest.raises(InputError, match=message):
        D.DFlash2Args.from_config(config, "drafter/config.json")


# ---------------------------------------------------------------------------------------------------- loader


def test_every_layout_loads_bit_identical_tensors(tmp_path):
    loaded = {}
    for layout in LAYOUTS:
        model, args, tensors = drafter(tmp_path / layout, layout)
        expected = model.drafter_state()
        assert sorted(tensors) == sorted(expected), layout
        assert all(torch.equal(tensors[k], expected[k]) for k in expected), layout
        loaded[layout] = tensors
    files = {layout: sorted(p.name for p in (tmp_path / layout).iterdir()) for layout in LAYOUTS}
    assert files["plain"] == files["selector_weight"] == ["config.json", "model.safetensors", "selector.safetensors"]
    assert files["main_file"] == files["model_prefix"] == ["config.json", "model.safetensors"]
    assert "candidate_selector.predecessor_codebook" in load_file(tmp_path / "plain" / "selector.safetensors")
    assert "candidate_selector.successor_codebook.weight" in load_file(
        tmp_path / "selector_weight" / "selector.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in load_file(tmp_path / "aliases" / "model.safetensors")
    # the same seed and config in four layouts: the same tensors
    for layout in ("selector_weight", "main_file", "model_prefix"):
        assert all(torch.equal(loaded["plain"][k], loaded[layout][k]) for k in loaded["plain"]), layout


def edit_main_file(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path))


def test_modules_take_each_tensor_as_cast_and_share_a_head_in_their_dtype(tmp_path, target):
    """``build_modules`` fills a core made with its parameters on meta: each checkpoint tensor is taken out of the dict
    as it is cast (its own memory map let go), and the target's head is shared when in the modules' dtype (at 27B a
    core made in fp32 first and a copied head held 12.2 GiB at the peak: docs/benchmarks.md)."""
    model, args, tensors = drafter(tmp_path)
    expected = {k: v.half() for k, v in model.drafter_state().items()}
    head = target["lm_head"].half()
    modules = D.build_modules(args, tensors, head, target["embed_tokens"][args.mask_token_id], torch.float16,
                              MAX_POSITIONS, ring_rows=RING, update_width=UPDATE, append_width=APPEND)
    assert tensors == {}
    state = modules.core.drafter_state()
    assert sorted(state) == sorted(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    assert all(p.device.type == "cpu" and p.dtype == torch.float16 for p in modules.core.parameters())
    assert modules.core.lm_head.weight.data_ptr() == head.data_ptr()
    in_fp32 = D.build_modules(args, dict(drafter(tmp_path / "again")[2]), head,
                              target["embed_tokens"][args.mask_token_id], torch.float32, MAX_POSITIONS,
                              ring_rows=RING, update_width=UPDATE, append_width=APPEND)
    assert in_fp32.core.lm_head.weight.data_ptr() != head.data_ptr()
    assert torch.equal(in_fp32.core.lm_head.weight, head.float())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("layers.1.mlp_conv.base_kernel"),
         r"tensor 'layers.1.mlp_conv.base_kernel' is missing \(expected shape \[2, 2, 64\]\)"),
        (lambda t: t.update({"layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}),
         r"model.safetensors: unexpected tensor 'layers.0.self_attn.rotary_emb.inv_freq'"),
        (lambda t: t.update({"fc.weight": torch.zeros(64, 128)}),
         r"tensor 'fc.weight' has shape \[64, 128\], expected \[64, 192\]"),
        (lambda t: t.update({"layers.0.attention_conv.kernel_projection.weight": torch.zeros(8, 64)}),
         r"'layers.0.attention_conv.kernel_projection.weight' has shape \[8, 64\], expected \[16, 64\]"),
        (lambda t: t.update({"model.norm.weight": t["norm.weight"].clone()}),
         r"tensor 'norm.weight' appears twice: 'model.norm.weight' in model.safetensors and 'norm.weight'"),
        (lambda t: t.update({"layers.0.self_attn.qkv_proj.weight": torch.zeros(128, 64)}),
         r"'layers.0.self_attn.qkv_proj.weight' is a fused qkv_proj, which is not supported; split it"),
    ],
)
def test_loader_refusals_name_the_key_and_expected_shape(tmp_path, edit, message):
    write_drafter(tmp_path, "plain")
    edit_main_file(tmp_path, edit)
    with pytest.raises(InputError, match=message):
        D.load_checkpoint(tmp_path)


def test_missing_codebook_and_wrong_codebook_shape_are_refused(tmp_path):
    write_drafter(tmp_path, "plain")
    selector = tmp_path / "selector.safetensors"
    codebooks = load_file(selector)
    save_file({"candidate_selector.predecessor_codebook": codebooks["candidate_selector.predecessor_codebook"]},
              str(selector))
    with pytest.raises(InputError, match=r"'candidate_selector.successor_codebook' is missing \(main weights or "
                                         r"selector.safetensors\) \(expected shape \[512, 16\]\)"):
        D.load_checkpoint(tmp_path)
    codebooks["candidate_selector.successor_codebook"] = torch.zeros(512, 8)
    save_file(codebooks, str(selector))
    with pytest.raises(InputError, match=r"selector.safetensors: tensor 'candidate_selector.successor_codebook' "
                                         r"has shape \[512, 8\], expected \[512, 16\]"):
        D.load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------------- export vs ref


@pytest.mark.parametrize(
    ("overrides", "p0s"),
    [
        ({"window": 48}, (5, 37, 61, 100)),
        ({"window": None}, (23, 100)),
        ({"window": 48, "layer_types": ["full_attention", "sliding_attention"]}, (37, 100)),
    ],
    ids=["sliding-48", "full", "mixed"],
)
def test_export_modules_match_the_reference_in_fp32(tmp_path, target, features, overrides, p0s):
    """Context through one context_update and context_append chunks, then a draft at p0: logits and ids equal the
    eager reference over the full context (window 48 < R), or over the last R rows the ring holds (a layer without
    a window, once p0 > R = 64)."""
    model, args, tensors = drafter(tmp_path, **overrides)
    window = None if None in args.layer_windows else 48
    for p0 in p0s:
        mods = modules(args, tensors, target)
        written = write_context(mods, features, list(range(p0)))
        assert np.array_equal(np.concatenate(written, axis=1)[0, :p0], np.arange(p0) % RING)
        anchor = (p0 * 37) % 512
        got = mods.call("draft", **draft_inputs(target, anchor, p0))
        kept = list(range(max(0, p0 - RING), p0)) if window is None else None
        ref = reference_draft(model, target, features[:p0] if kept is None else features, anchor, p0, kept)
        assert float((got["logits"][0] - ref.logits).abs().max()) < FP32_LOGITS_BOUND, p0
        assert got["draft_ids"][0].tolist() == ref.draft_ids.tolist(), p0
        assert float((got["selector_scores"][0] - ref.scores).abs().max()) < FP32_LOGITS_BOUND, p0
    if overrides == {"window": None}:  # the ring wrapped: an unlimited window sees fewer rows than a plain reference
        full = reference_draft(model, target, features[:100], anchor, 100)
        assert float((full.logits - ref.logits).abs().max()) > 1e-3


def test_stale_rows_after_a_rollback_stay_hidden(tmp_path, target, features):
    model, args, tensors = drafter(tmp_path)
    mods = modules(args, tensors, target)
    write_context(mods, features, list(range(41)))  # positions 0..40
    laps = mods.states()["ring_laps"][0]
    assert laps[:41].tolist() == [1.0] * 41 and not laps[41:].any()
    got = mods.call("draft", **draft_inputs(target, 99, 30))
    ref = reference_draft(model, target, features[:30], 99, 30)
    assert float((got["logits"][0] - ref.logits).abs().max()) < FP32_LOGITS_BOUND
    assert got["draft_ids"][0].tolist() == ref.draft_ids.tolist()
    with_stale = reference_draft(model, target, features[:41], 99, 30, positions=None)  # rows >= p0 ignored too
    assert torch.equal(with_stale.logits, ref.logits)


def test_draft_leaves_the_ring_unchanged(tmp_path, target, features):
    _, args, tensors = drafter(tmp_path)
    mods = modules(args, tensors, target)
    write_context(mods, features, list(range(20)))
    before = {k: v.clone() for k, v in mods.states().items()}
    mods.call("draft", **draft_inputs(target, 5, 20))
    assert all(torch.equal(before[k], v) for k, v in mods.states().items())


def test_dflash_v1_loads_and_matches_its_reference(tmp_path, target, features):
    model, args, tensors = drafter(tmp_path, version="dflash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert not any("conv" in k or "selector" in k for k in tensors)
    mods = modules(args, tensors, target)
    write_context(mods, features, list(range(45)), update=False)  # context_append chunks only
    got = mods.call("draft", **draft_inputs(target, 11, 45))
    ref = reference_draft(model, target, features[:45], 11, 45)
    assert float((got["logits"][0] - ref.logits).abs().max()) < FP32_LOGITS_BOUND
    assert got["draft_ids"][0].tolist() == ref.draft_ids.tolist() == ref.logits.argmax(-1).tolist()


def test_training_forward_is_the_reference(tmp_path, target, features):
    """forward_blocks (several blocks per sequence, one boolean mask) gives the reference's logits for each block."""
    model, args, _ = drafter(tmp_path)
    anchors = torch.tensor([[3, 20, 51], [9, 33, 60]])
    ids = torch.tensor([[7, 8, 9], [10, 11, 12]])
    rows = torch.stack([features[:64], features[64:128]])
    blocks = target["embed_tokens"][3].expand(2, 3, 8, 64).clone()
    blocks[:, :, 0] = target["embed_tokens"][ids]
    with torch.no_grad():
        hidden = model.forward_blocks(rows, blocks, anchors)
    for b in range(2):
        for m in range(3):
            p0 = int(anchors[b, m])
            ref = reference_draft(model, target, rows[b, :p0], int(ids[b, m]), p0)
            logits = hidden[b, m, 1:] @ target["lm_head"].T
            assert float((logits - ref.logits).abs().max()) < FP32_LOGITS_BOUND


# ---------------------------------------------------------------------------------------------------- packages


@pytest.mark.slow
def test_packages_convert_read_back_and_run_on_core_ai(tmp_path, target, features):
    _, args, tensors = drafter(tmp_path / "ckpt")
    mods = modules(args, tensors, target, torch.float16)
    specs = {name: spec for name, (_, spec) in mods.functions.items()}
    coreai.package(mods.functions, tmp_path / "drafter.aimodel")
    coreml.package(mods.functions, tmp_path / "drafter.mlpackage")
    assert coreai.read_back(tmp_path / "drafter.aimodel") == specs
    assert coreml.read_back(tmp_path / "drafter.mlpackage") == specs
    features16 = features.half()
    calls = [("context_update", list(range(40))), ("draft", 40), ("context_append", [40, 41, 42]), ("draft", 43),
             ("draft", 41)]  # the last one after a rollback: rows 41, 42 are stale
    compared = []
    with coreai.open_session(tmp_path / "drafter.aimodel") as session:
        for name, what in calls:
            if name == "draft":
                inputs = draft_inputs(target, (what * 53) % 512, what, torch.float16)
            else:
                rows = padded(what, UPDATE if name == "context_update" else APPEND)
                inputs = {"taps": features16[rows][None], "position_ids": [rows]}
            arrays = {k: np.asarray(v, dtype=np.float16 if k in ("taps", "anchor_embedding") else np.int32)
                      for k, v in inputs.items()}
            got = session.call(name, arrays)
            ref = mods.call(name, **inputs)
            if name != "draft":
                assert np.array_equal(got["written"], ref["written"].numpy())
                continue
            logits = ref["logits"][0].float()
            relative = np.abs(got["logits"][0].astype(np.float32) - logits.numpy()).max() / float(logits.abs().max())
            assert relative < FP16_RELATIVE_BOUND, (what, relative)
            compared.append(matching_rows(got["draft_ids"][0], ref["draft_ids"][0], ref["selector_scores"][0]))
        states = session.states()
    assert all(rows >= 1 for rows in compared) and sum(compared) >= 15, compared
    torch_states = mods.states()
    assert np.array_equal(states["ring_laps"], torch_states["ring_laps"].numpy())
    written = slice(0, 43)
    delta = np.abs(states["ring_keys"][:, :, written].astype(np.float32) - torch_states["ring_keys"][:, :, written]
                   .float().numpy()).max()
    assert delta < 2e-2 * float(torch_states["ring_keys"].abs().max())


def matching_rows(got: np.ndarray, expected: torch.Tensor, scores: torch.Tensor) -> int:
    """Rows whose runtime id equals torch's, up to the first difference; a difference is allowed only where
    torch's top-2 selector score gap is below FLIP_GAP (the later rows then follow another predecessor)."""
    for row, (a, b) in enumerate(zip(got.tolist(), expected.tolist(), strict=True)):
        if a != b:
            top2 = torch.topk(scores[row].float(), 2).values
            assert float(top2[0] - top2[1]) < FLIP_GAP, (row, a, b, top2)
            return row
    return len(expected)


def test_function_specs_contract():
    args = D.DFlash2Args.from_config(tiny_config())
    specs = {s.name: s for s in D.function_specs(args, ring_rows=2048)}
    assert list(specs) == ["context_update", "context_append", "draft"]
    assert [(t.name, t.shape, t.dtype) for t in specs["context_update"].inputs] == [
        ("taps", (1, 64, 192), "float16"), ("position_ids", (1, 64), "int32")]
    assert [(t.name, t.shape) for t in specs["draft"].inputs] == [
        ("anchor_embedding", (1, 1, 64)), ("anchor_id", (1, 1)), ("position_ids", (1, 8))]
    assert [(t.name, t.shape, t.dtype) for t in specs["draft"].outputs] == [("draft_ids", (1, 7), "int32")]
    assert [(t.name, t.shape) for t in specs["draft"].states] == [
        ("ring_keys", (2, 2, 2048, 16)), ("ring_values", (2, 2, 2048, 16)), ("ring_laps", (1, 2048))]
    assert all(s.states == specs["draft"].states for s in specs.values())
    with pytest.raises(InputError, match="ring rows 32 must hold one context chunk"):
        D.function_specs(args, ring_rows=32)

