"""The drafters in the ane layout (``drafter.layout: ane``): DFlash2 over the host's ring (its masks and selector walk
done by the host) and the MTP head over the host's KV history, against their stateful functions through the same
drivers; the host's ring masks and first row; the contracts' shapes lint clean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import write_checkpoint
from dflash2_checkpoints import target_tensors, tiny_config, write_drafter
from mtp_checkpoints import head_tensors, qwen35_text_config, write_head_only, write_target_with_head

from convert.export.ane import MASKED, history_mask_row
from convert.inputs.sources import load_tensors, read_json
from convert.models import dflash2, mtp
from convert.runtime.host import HostOwned, ModuleFunctions
from convert.runtime.speculative import DFlash2Driver, MTPDriver
from convert.verify import placement
from manifests.schema import HostContract

RING, MAX_POSITIONS, CONTEXT = 64, 256, 64
FP32_BOUND = 1e-4


def _dflash2_modules(tmp_path, version: str, layer_types, layout: str, dtype=torch.float32):
    config = tiny_config(version, layers=2, layer_types=layer_types)
    write_drafter(tmp_path, "plain", config)
    args, tensors = dflash2.load_checkpoint(tmp_path)
    target = target_tensors()
    return dflash2.build_modules(args, dict(tensors), target["lm_head"], target["embed_tokens"][args.mask_token_id],
                                 dtype, MAX_POSITIONS, ring_rows=RING, update_width=64, append_width=8, logits=True,
                                 layout=layout), target


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
