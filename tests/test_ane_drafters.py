"""The drafters in the ane layout (``drafter.layout: ane``): DFlash2 over the host's ring (its masks and selector walk
done by the host) and the MTP head over the host's KV history, against their stateful functions through the same
drivers; the host's ring masks and first row; the contracts' shapes lint clean."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from convert.commands.inspect import _print_contract
from convert.export.ane import MASKED, history_mask_row, pointwise, rows_of
from convert.export.quantized import QuantizedLinear, apply_quantized
from convert.inputs.sources import load_tensors, read_json
from convert.models import dflash2, mtp
from convert.models.dflash2.driver import DFlash2Driver
from convert.models.mtp.driver import MTPDriver
from convert.pipeline.drafter_calibration import Recording
from convert.pipeline.packaging import package_formats
from convert.runtime.host import HostOwned, ModuleFunctions
from convert.verify import checks, placement
from convert.weights.quantize import round_to_nearest
from manifests.schema import HostContract
from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.dflash2_checkpoints import target_tensors, tiny_config, write_drafter
from tests.helpers.mtp_checkpoints import head_tensors, qwen35_text_config, write_head_only, write_target_with_head

RING, MAX_POSITIONS, CONTEXT = 64, 256, 64
ROOT = Path(__file__).resolve().parents[1]
FP32_BOUND = 1e-4


def _dflash2_modules(tmp_path, version: str, layer_types, layout: str, dtype=torch.float32, head_ranges=None):
    config = tiny_config(version, layers=2, layer_types=layer_types)
    write_drafter(tmp_path, "plain", config)
    args, tensors = dflash2.load_checkpoint(tmp_path)
    target = target_tensors()
    return dflash2.build_modules(args, dict(tensors), target["lm_head"], target["embed_tokens"][args.mask_token_id],
                                 dtype, MAX_POSITIONS, ring_rows=RING, update_width=64, append_width=8, logits=True,
                                 layout=layout, head_ranges=head_ranges), target


@pytest.mark.parametrize("version, layer_types", [("dflash2", ["sliding_attention", "full_attention"]),
                                                  ("dflash", ["full_attention", "full_attention"])])
def test_dflash2_ane_drafts_as_the_stateful_functions(tmp_path, version, layer_types):
    """Context rows past the ring (positions to 170 in a 64-row ring: slots lapped twice), a sliding and a full
    window, 20 drafts after appends of 1..5 rows: the ane functions through the host give the stateful functions'
    logits within 1e-4, their ids, and (DFlash2) the selector's scores within 1e-4."""
    runs = {}
    for layout in ("stateful", "ane"):
        modules, target = _dflash2_modules(tmp_path / layout, version, layer_types, layout)
        embeddings = target["embed_tokens"].numpy()
        driver = DFlash2Driver(ModuleFunctions(modules), modules.widths, embeddings)
        features = torch.randn(200, modules.core.args.feature_size, generator=torch.Generator().manual_seed(1)).numpy()
        driver.functions.reset()
        driver.add_context(features[:70], 0, "context_update")
        p, outs = 70, []
        for r in range(20):
            count = 1 + r % 5
            driver.add_context(features[p:p + count], p, "context_append")
            p += count
            outs.append(driver.functions.call("draft", {
                "anchor_embedding": embeddings[r][None, None].astype(np.float16),
                "anchor_id": np.asarray([[r]], dtype=np.int32),
                "position_ids": np.arange(p, p + 8, dtype=np.int32)[None]}))
        runs[layout] = outs
    assert p > 2 * RING
    for stateful, ane in zip(runs["stateful"], runs["ane"], strict=True):
        assert np.abs(stateful["logits"] - ane["logits"]).max() < FP32_BOUND
        assert np.array_equal(stateful["draft_ids"], ane["draft_ids"])
        if version == "dflash2":
            assert np.abs(stateful["selector_scores"] - ane["selector_scores"]).max() < FP32_BOUND
            assert "selector_projected" in ane
        else:
            assert "selector_scores" not in ane


def _mtp_head(tmp_path, variant: str):
    if variant == "qwen3.5-inside":
        write_target_with_head(tmp_path / "ckpt", layout="qwen3.5")
        return tmp_path / "ckpt", load_tensors(tmp_path / "ckpt")
    gated = variant == "gated-partial"
    write_checkpoint(tmp_path / "target", vocab_size=512)
    config = qwen35_text_config(read_json(tmp_path / "target" / "config.json"), gated, 0.25 if gated else 1.0)
    write_head_only(tmp_path / "head", config, head_tensors(config["text_config"], zero_centred=True, seed=5,
                                                            gated=gated))
    return tmp_path / "head", load_tensors(tmp_path / "target")


@pytest.mark.parametrize("variant", ["gated-partial", "plain-rope", "qwen3.5-inside"])
def test_mtp_ane_drafts_as_the_stateful_functions(tmp_path, variant):
    """accept over 10 rows, three chained draft_steps, then a rollback (accept at an earlier position) and a step:
    the ane head through the host gives the stateful head's draft ids and hidden rows within 1e-5 (fp32)."""
    directory, target = _mtp_head(tmp_path, variant)
    args = mtp.MTPArgs.from_config(read_json(directory / "config.json"), where=str(directory))
    head = mtp.load_head(directory, args)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(20, args.hidden_size, generator=generator).numpy()
    tokens = torch.randint(0, args.vocab_size, (20,), generator=generator).tolist()
    runs = {}
    for layout in ("stateful", "ane"):
        modules = mtp.build_modules(args, head, target, CONTEXT, dtype=torch.float32, layout=layout)
        driver = MTPDriver(ModuleFunctions(modules), modules.widths)
        driver.functions.reset()
        steps = [driver.accept(tokens[:10], hidden[:10], 1)]
        for j in range(3):
            steps.append(driver.step(*steps[-1], 11 + j))
        steps.append(driver.accept(tokens[11:13], hidden[11:13], 11))  # two of the three drafts kept
        steps.append(driver.step(*steps[-1], 13))
        runs[layout] = steps
    for (ids, rows), (ane_ids, ane_rows) in zip(runs["stateful"], runs["ane"], strict=True):
        assert ids == ane_ids
        assert np.abs(rows - ane_rows).max() < 1e-5


def test_the_hosts_ring_masks_follow_the_positions_its_slots_hold(tmp_path):
    """A ring of 64 rows after context at positions 0..69 (slots 0..5 lapped) and a draft at 70: the whole-ring mask
    opens every slot holding a position below 70; the 48-row window opens only positions above q - 48 for each
    query q; a fresh session (reset) opens none."""
    modules, _ = _dflash2_modules(tmp_path, "dflash2", ["sliding_attention", "full_attention"], "ane")
    specs = {name: spec for name, (_, spec) in modules.functions.items()}
    owned = ModuleFunctions(modules).driven
    assert isinstance(owned, HostOwned)
    features = np.zeros((1, 64, modules.core.args.feature_size), dtype=np.float32)
    owned.call("context_update", {"taps": features, "position_ids": np.arange(64, dtype=np.int32)[None]})
    owned.call("context_append", {"taps": features[:, :8], "position_ids": np.arange(62, 70, dtype=np.int32)[None]})
    where = np.arange(70, 78)
    masks = owned.ring_mask_inputs(specs["draft"], where)
    held = np.where(np.arange(64) < 6, np.arange(64) + 64, np.arange(64))  # slot s holds 64 + s for s < 6
    assert np.array_equal(masks["ring_mask"], np.where(held[:, None] < 70, 0.0, MASKED) * np.ones((1, 8)))
    window = (held[:, None] < 70) & (where[None, :] - held[:, None] < 48)
    assert np.array_equal(masks["ring_mask_48"], np.where(window, 0.0, MASKED))
    assert int((masks["ring_mask_48"] == 0).sum()) == sum(47 - (q - 70) for q in where)  # q = 70 sees 23..69
    owned.reset()
    assert (owned.ring_mask_inputs(specs["draft"], where)["ring_mask"] == MASKED).all()


def test_the_mtp_history_mask_hides_row_zero():
    """The MTP head's history starts at row 1 (row 0 holds no position): a call at position 5 opens rows 1..4."""
    assert np.array_equal(np.flatnonzero(history_mask_row(5, 8, first_row=1)[0] == 0), [1, 2, 3, 4])
    assert np.array_equal(np.flatnonzero(history_mask_row(5, 8)[0] == 0), [0, 1, 2, 3, 4])


def test_ane_drafter_contracts_validate_and_their_shapes_lint_clean(tmp_path):
    """Both drafters' ane functions keep no state, take no integer and no dim past the limits (the lint of their
    planned shapes finds nothing, where the stateful ones' states are findings), and their contracts are valid
    manifest records naming every buffer the functions take."""
    modules, _ = _dflash2_modules(tmp_path / "d", "dflash2", ["sliding_attention", "full_attention"], "ane",
                                  torch.float16)
    directory, target = _mtp_head(tmp_path / "m", "gated-partial")
    args = mtp.MTPArgs.from_config(read_json(directory / "config.json"), where=str(directory))
    heads = {layout: mtp.build_modules(args, mtp.load_head(directory, args), target, CONTEXT, layout=layout)
             for layout in ("stateful", "ane")}
    stateful_dflash2, _ = _dflash2_modules(tmp_path / "s", "dflash2", ["sliding_attention", "full_attention"],
                                           "stateful", torch.float16)
    for drafter, findings in ((modules, 0), (heads["ane"], 0), (heads["stateful"], 2), (stateful_dflash2, 3)):
        specs = {name: spec for name, (_, spec) in drafter.functions.items()}
        found = placement.lint("coreai", specs, {}, placement.positional_buffers(drafter.contract))
        assert len([f for f in found if "state" in f]) == findings, found
        if drafter.contract:
            assert not found
            contract = HostContract.model_validate(drafter.contract)
            taken = {t.name for spec in specs.values() for t in spec.inputs}
            assert set(contract.buffers) <= taken and set(contract.ring_masks) <= taken
            assert all(t.dtype == "float16" for spec in specs.values() for t in (*spec.inputs, *spec.outputs))
    assert HostContract.model_validate(modules.contract).selector.top_k == 8
    assert HostContract.model_validate(heads["ane"].contract).positions.first_row == 1


# the fixtures' vocabulary (512 rows) in three parts, as the 27B heads' 248,320 rows go in four of 62,080 (the ANE's
# largest dim is 65,536): whole lut4 tables of 16 rows, the last part shorter
HEAD_PARTS = [(0, 192), (192, 384), (384, 512)]


def _dflash2_drafts(modules, embeddings: np.ndarray, functions=None) -> list[dict]:
    """Context at positions 0..69 in a 64-row ring, then four drafts after appends of 1..4 rows."""
    driver = DFlash2Driver(functions or ModuleFunctions(modules), modules.widths, embeddings)
    features = torch.randn(80, modules.core.args.feature_size, generator=torch.Generator().manual_seed(1)).numpy()
    driver.functions.reset()
    driver.add_context(features[:70], 0, "context_update")
    p, outs = 70, []
    for r in range(4):
        driver.add_context(features[p:p + r + 1], p, "context_append")
        p += r + 1
        outs.append(driver.functions.call("draft", {
            "anchor_embedding": embeddings[r][None, None].astype(np.float16),
            "anchor_id": np.asarray([[r]], dtype=np.int32),
            "position_ids": np.arange(p, p + 8, dtype=np.int32)[None]}))
    return outs


def test_a_head_in_row_parts_drafts_as_the_whole_head(tmp_path):
    """An ane drafter's lm_head past the ANE's largest dim is computed in row parts, one logits output each, which
    the host puts side by side (the contract's logits_parts): fp32, the DFlash2 drafter's logits and selector scores
    and the MTP head's hidden rows equal the whole head's within 1e-6 and their ids are the same."""
    runs = {}
    for ranges in (None, HEAD_PARTS):
        modules, target = _dflash2_modules(tmp_path / str(bool(ranges)), "dflash2",
                                           ["sliding_attention", "full_attention"], "ane", head_ranges=ranges)
        runs[bool(ranges)] = _dflash2_drafts(modules, target["embed_tokens"].numpy())
    draft = modules.functions["draft"][1]
    assert [(t.name, t.shape[-1]) for t in draft.outputs[:3]] == [("logits_0", 192), ("logits_1", 192),
                                                                   ("logits_2", 128)]
    contract = HostContract.model_validate(modules.contract)
    assert contract.logits_parts == {"logits_0": [0, 192], "logits_1": [192, 384], "logits_2": [384, 512]}
    shown = io.StringIO()
    _print_contract(Console(file=shown, width=200), contract)
    assert ("logits in 3 parts, which the host puts side by side: logits_0 rows 0..191, logits_1 rows 192..383, "
            "logits_2 rows 384..511") in shown.getvalue()
    for whole, parted in zip(runs[False], runs[True], strict=True):
        assert parted["logits"].shape == whole["logits"].shape == (1, 7, 512)
        assert np.abs(whole["logits"] - parted["logits"]).max() < 1e-6
        assert np.abs(whole["selector_scores"] - parted["selector_scores"]).max() < 1e-6
        assert np.array_equal(whole["draft_ids"], parted["draft_ids"])

    directory, target = _mtp_head(tmp_path / "m", "gated-partial")
    args = mtp.MTPArgs.from_config(read_json(directory / "config.json"), where=str(directory))
    head = mtp.load_head(directory, args)
    hidden = torch.randn(12, args.hidden_size, generator=torch.Generator().manual_seed(3)).numpy()
    steps = {}
    for ranges in (None, HEAD_PARTS):
        heads = mtp.build_modules(args, head, target, CONTEXT, dtype=torch.float32, layout="ane", head_ranges=ranges)
        driver = MTPDriver(ModuleFunctions(heads), heads.widths)
        driver.functions.reset()
        steps[bool(ranges)] = [driver.accept(list(range(10)), hidden[:10], 1)]
        steps[bool(ranges)].append(driver.step(*steps[bool(ranges)][-1], 11))
    assert [t.name for t in heads.functions["accept"][1].outputs][:3] == ["logits_0", "logits_1", "logits_2"]
    for (ids, rows), (parted_ids, parted_rows) in zip(steps[False], steps[True], strict=True):
        assert ids == parted_ids
        assert np.abs(rows - parted_rows).max() < 1e-6


def test_a_head_in_row_parts_ships_each_part_and_replays_on_the_runtime(tmp_path):
    """The DFlash2 drafter with its lut4 head (the target's, quantized as a target ships it) in three row parts, in
    both formats: each part is stored as its own quantized constant, bit for bit (3 compared where a whole head is
    1), no placement finding, and the Core AI runtime replays the recorded drafts (logits side by side) within the
    fp16 bound."""
    modules, target = _dflash2_modules(tmp_path / "d", "dflash2", ["sliding_attention", "full_attention"], "ane",
                                       torch.float16, head_ranges=HEAD_PARTS)
    apply_quantized(modules.core, {"lm_head": round_to_nearest("lut4", target["lm_head"].float(), 16)})
    assert [type(part) for part in modules.core.lm_head.parts] == [QuantizedLinear] * 3
    recording = Recording(ModuleFunctions(modules))
    with checks.like_the_runtime():
        _dflash2_drafts(modules, target["embed_tokens"].numpy(), recording)
    done = {p.format: p for p in package_formats(["coreai", "coreml"], modules, tmp_path, "dflash2_lut4",
                                                 recording.calls)}
    for packaged in done.values():
        assert packaged.check["placement"] == []
        assert packaged.check["quantized_bit_exact"] and packaged.check["quantized_weights_compared"] == 3
    assert done["coreai"].check["runtime_calls"] == 4 + 4 + 2  # 4 drafts, 4 appends, 2 context updates


def test_the_drafter_stage_borrows_the_targets_head_in_row_parts(tmp_path):
    """The pipeline's drafter modules with the head in row parts take the target's head as the target holds it:
    row views of a fp16 head, a quantized head's rows, or (a lean target, ``CodesLinear``) views of its packed codes,
    never quantized as the drafter's own linears; the parts' logits side by side are the whole head's."""
    from dataclasses import replace

    from convert.backends.stored import fingerprint
    from convert.export.ane import even_ranges
    from convert.export.quantized import CodesLinear
    from convert.pipeline import drafter, drafter_memory
    from convert.pipeline.build import shipped_modules
    from convert.pipeline.plan import make_plan

    source = ROOT / "recipes" / "tiny_qwen3_5_dflash2.yaml"
    recipe = tmp_path / "pair.yaml"
    recipe.write_text(source.read_text().replace("path:../fixtures", f"path:{ROOT / 'fixtures'}")
                      .replace("  kind: dflash2\n", "  kind: dflash2\n  layout: ane\n"))
    plan = make_plan(recipe, str(tmp_path / "out"))
    target, _ = shipped_modules(plan)
    vocab = plan.drafter.args.vocab_size
    ranges = even_ranges(vocab, vocab // 3 + 64, 64)  # 8192 rows in three parts
    assert len(ranges) == 3 and plan.drafter.head_ranges == [(0, vocab)]
    split = replace(plan.drafter, head_ranges=ranges)
    whole = drafter.build_modules(plan.drafter, plan.recipe, target, torch.float32)
    parted = drafter.build_modules(split, plan.recipe, target, torch.float32)
    assert [name for name, _ in drafter_memory.own_linears(parted.core)] == [name for name, _ in
                                                                      drafter_memory.own_linears(whole.core)]
    assert [t.name for t in parted.functions["draft"][1].outputs][:3] == ["logits_0", "logits_1", "logits_2"]
    hidden = torch.randn(1, plan.drafter.args.hidden_size, 1, 7, generator=torch.Generator().manual_seed(2))
    side_by_side = torch.cat([rows_of(pointwise(part, hidden)) for part in parted.core.lm_head.parts], dim=-1)
    assert torch.equal(side_by_side, rows_of(pointwise(whole.core.lm_head, hidden)))

    quantized = round_to_nearest("lut4", target.core.lm_head.weight.float(), 16)
    for held in (QuantizedLinear("lm_head", quantized), CodesLinear("lm_head", quantized)):
        target.core.lm_head = held
        parts = drafter.build_modules(split, plan.recipe, target, torch.float16).core.lm_head.parts
        assert [type(part) for part in parts] == [type(held)] * 3
        assert [fingerprint(part.quantized_weight()) for part in parts] == \
            [fingerprint(quantized.rows(lo, hi)) for lo, hi in ranges]
        if isinstance(held, CodesLinear):  # the lean target's codes themselves, not a copy
            assert {part.words.untyped_storage().data_ptr() for part in parts} == \
                {held.words.untyped_storage().data_ptr()}
