"""The drafter stage's memory (convert/pipeline/drafter.py, drafter_build.py): GPTQ calibration a group of linears at a
time, the later groups' Hessians from replaying the recorded drafter calls, equal to one pass's bit for bit; and fp32
compute copies that share the fp16 weights (``compute_copy(share_weights=True)``), with the plain copies' outputs."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from convert.cache import BuildCache
from convert.export.functions import compute_copy
from convert.export.quantized import CodesLinear, HalfLinear, packaged_from_codes, quantized_weights
from convert.inputs.recipe import DrafterQuantization
from convert.pipeline import drafter, drafter_accept, drafter_build, drafter_calibration, drafter_memory
from convert.pipeline.build import shipped_modules
from convert.pipeline.drafter_calibration import calibration_hessians
from convert.pipeline.packaging import weights_digest
from convert.pipeline.partition import held_target_bytes
from convert.pipeline.plan import make_plan
from convert.runtime import speculative
from convert.runtime.host import ModuleFunctions, TargetDriver
from convert.weights.shipped import at_context

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_qwen3_5_dflash2.yaml"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The hybrid fixture target (fp32 compute copy), its trained DFlash2 drafter's fp16 modules and two short
    calibration prompts."""
    work = tmp_path_factory.mktemp("pair")
    recipe = work / "pair.yaml"
    recipe.write_text(RECIPE.read_text().replace("path:../fixtures", f"path:{RECIPE.parent.parent / 'fixtures'}"))
    plan = make_plan(recipe, str(work / "out"))
    target, _ = shipped_modules(plan)
    modules = drafter.build_modules(plan.drafter, plan.recipe, target, torch.float16)
    prompts, _ = drafter_build.text_prompts(plan, plan.drafter.config.quantization.calibration, "calibration")
    return compute_copy(target, torch.float32), modules, [p[:24] for p in prompts[:2]], drafter.anchor_table(target)


def _hessians(pair, monkeypatch, budget: int) -> list[dict[str, torch.Tensor]]:
    target32, modules, prompts, anchors = pair
    monkeypatch.setattr(drafter_memory, "HESSIAN_GROUP_BYTES", budget)
    return list(calibration_hessians("dflash2", target32, compute_copy(modules, torch.float32), prompts, 12,
                                             anchors))


def test_hessians_taken_a_linear_at_a_time_by_replay_equal_one_pass_bit_for_bit(pair, monkeypatch):
    linears = [name for name, _ in drafter_memory.own_linears(pair[1].core)]
    one_pass = _hessians(pair, monkeypatch, 1 << 40)
    replayed = _hessians(pair, monkeypatch, 1)  # every linear a group of its own: all but the first replayed
    assert len(one_pass) == 1 and len(replayed) == len(linears) > 10
    merged = {name: h for group in replayed for name, h in group.items()}
    assert sorted(merged) == sorted(one_pass[0]) == sorted(linears)
    assert all(torch.equal(merged[name], one_pass[0][name]) for name in linears)


def test_hessian_groups_stay_within_the_budget_and_a_larger_linear_is_alone(pair):
    core = pair[1].core
    sizes = {name: 4 * module.in_features**2 for name, module in drafter_memory.own_linears(core)}
    budget = 2 * max(sizes.values()) - 1  # two of the largest do not fit together
    groups = drafter_memory.hessian_groups(core, budget)
    widest = [name for name, size in sizes.items() if size == max(sizes.values())]
    in_order = [name for name in sizes if name not in widest] + widest  # the widest last, the rest in module order
    assert 0 < len(widest) < len(sizes) and list(sizes)[-1] not in widest
    assert [name for group in groups for name in group] == in_order
    assert all(sum(sizes[n] for n in group) <= budget for group in groups)
    assert drafter_memory.hessian_groups(core, 1) == [[name] for name in in_order]
    assert len(drafter_memory.hessian_groups(core)) == 1  # the fixture's Hessians fit the default budget at once


def test_the_last_groups_hessians_come_after_the_replays_compute_copy_is_let_go(pair, monkeypatch):
    """The last group (the widest linears) is quantized once the replays are done: by then the compute copy they ran
    on (which shares every fp16 weight) and the recording are let go."""
    import gc
    import weakref

    target32, modules, prompts, anchors = pair
    monkeypatch.setattr(drafter_memory, "HESSIAN_GROUP_BYTES", 1)
    copy32 = compute_copy(modules, torch.float32, share_weights=True)
    alive = weakref.ref(copy32.core)
    groups = calibration_hessians("dflash2", target32, copy32, prompts, 8, anchors)
    del copy32
    count = len(drafter_memory.hessian_groups(modules.core, 1))
    for index, _ in enumerate(groups):
        gc.collect()
        assert (alive() is None) == (index == count - 1), index


def _recorded_run(pair, modules, outputs: bool = True) -> list:
    target32, _, prompts, anchors = pair
    target, driver = drafter.drivers("dflash2", target32, modules, anchors)
    driver.functions = drafter_calibration.Recording(driver.functions, outputs)
    speculative.speculate(target, driver, prompts[0], 12)
    return driver.functions.calls


def test_a_calibrations_recording_keeps_the_inputs_and_not_the_outputs(pair):
    # what calibration_hessians replays: a draft call's outputs hold its fp32 logits, 7 MB at the 27B vocabulary
    with_outputs = _recorded_run(pair, compute_copy(pair[1], torch.float32, share_weights=True))
    inputs_only = _recorded_run(pair, compute_copy(pair[1], torch.float32, share_weights=True), outputs=False)
    assert [c[0] for c in inputs_only] == [c[0] for c in with_outputs] and all(c[2] == {} for c in inputs_only)
    assert any("logits" in c[2] for c in with_outputs)
    assert all(np.array_equal(a[1][k], b[1][k]) for a, b in zip(with_outputs, inputs_only, strict=True) for k in a[1])


def test_a_weight_sharing_compute_copy_holds_no_second_weight_and_computes_the_copys_outputs(pair):
    modules = pair[1]
    shared = compute_copy(modules, torch.float32, share_weights=True)
    originals = dict(drafter_memory.own_linears(modules.core))
    linears = drafter_memory.own_linears(shared.core)
    assert [name for name, _ in linears] == list(originals) and all(
        isinstance(m, HalfLinear) and m.weight.dtype == torch.float16
        and m.weight.data_ptr() == originals[name].weight.data_ptr() for name, m in linears)
    assert all(p.dtype == torch.float16 for p in modules.core.parameters())  # the original stays as shipped
    plain, sharing = _recorded_run(pair, compute_copy(modules, torch.float32)), _recorded_run(pair, shared)
    assert len(plain) == len(sharing) >= 10
    for (function, inputs, out), (function2, inputs2, out2) in zip(plain, sharing, strict=True):
        assert function == function2 and inputs.keys() == inputs2.keys() and out.keys() == out2.keys()
        assert all(np.array_equal(inputs[k], inputs2[k]) for k in inputs)
        assert all(np.array_equal(out[k], out2[k]) for k in out), function


def test_a_quantized_drafter_runs_from_its_codes_as_its_packaged_layers_do(pair):
    target32, modules, _, _ = pair
    lean = copy.deepcopy(modules)
    record = drafter_calibration.quantize(lean, DrafterQuantization(method="lut4"))
    own = [name for name, _ in drafter_memory.own_linears(modules.core)]
    codes = {name: m for name, m in lean.core.named_modules() if isinstance(m, CodesLinear)}
    assert list(codes) == own and 4.0 < record["bits_per_weight"] < 16.0
    assert sum(m.words.nbytes for m in codes.values()) * 2 == sum(m.shape[0] * m.shape[1] for m in codes.values())
    packaged = copy.deepcopy(lean)
    packaged_from_codes(packaged.core)  # released QuantizedLinears: the weight computed from what the package holds
    assert set(quantized_weights(packaged.core)) == set(own)
    from_codes = _recorded_run(pair, compute_copy(lean, torch.float32, share_weights=True))
    from_package = _recorded_run(pair, compute_copy(packaged, torch.float32))
    assert len(from_codes) == len(from_package) >= 10
    for (function, _, out), (_, _, out2) in zip(from_codes, from_package, strict=True):
        assert all(np.array_equal(out[k], out2[k]) for k in out), function


def test_a_lean_tables_anchor_rows_are_computed_when_read_and_a_plain_table_is_not_copied():
    from types import SimpleNamespace

    from convert.export.quantized import embedding_rows
    from quant.types import QuantizedWeight, Rotation

    generator = torch.Generator().manual_seed(3)
    rows, columns = 1000, 256
    quantized = QuantizedWeight(
        "exact2", torch.randint(0, 3, (rows, columns), dtype=torch.uint8, generator=generator), 128,
        scale=(torch.rand(rows, 2, generator=generator) * 0.02).half(),
        zero_point=torch.ones(rows, 2, dtype=torch.uint8),
        rotation=Rotation(torch.where(torch.rand(columns, generator=generator) < 0.5, -1.0, 1.0), 128))
    lean = CodesLinear("embed_tokens", quantized, embedding=True)
    table = drafter.anchor_table(SimpleNamespace(core=SimpleNamespace(embed_tokens=lean)))
    assert isinstance(table, drafter.AnchorRows) and table.shape == (rows, columns)
    whole = np.asarray(table)
    assert whole.dtype == np.float16 and np.array_equal(whole, embedding_rows(lean).numpy())
    assert all(np.array_equal(table[i], whole[i]) for i in (0, 1, 517, rows - 1))
    assert not np.array_equal(whole[5], quantized.dequantize()[5].numpy())  # the rows after their rotation
    with pytest.raises(IndexError, match="token id 1000 is outside the embedding's 1000 rows"):
        table[rows]
    plain = torch.nn.Embedding(rows, columns).half()
    view = drafter.anchor_table(SimpleNamespace(core=SimpleNamespace(embed_tokens=plain)))
    assert isinstance(view, np.ndarray) and np.shares_memory(view, plain.weight.detach().numpy())


def test_a_linear_that_saw_no_calibration_input_is_refused_by_name(pair):
    from convert.errors import InputError

    lean = copy.deepcopy(pair[1])
    linears = drafter_memory.own_linears(lean.core)
    hessians = [{name: torch.eye(m.in_features) for name, m in linears[:3]},
                {name: torch.eye(m.in_features) for name, m in linears[4:]}]
    with pytest.raises(InputError, match=rf"drafter.quantization.calibration: linear {linears[3][0]} saw no "
                       "calibration input"):
        drafter_calibration.quantize(lean, DrafterQuantization(method="lut4-gptq"), iter(hessians))


@pytest.mark.parametrize("method", ["none", "affine4"])
def test_the_plans_whole_target_bytes_are_the_storages_the_drafter_stage_holds(tmp_path, method):
    """``held_target_bytes`` of a whole target against the distinct storages of its shipped modules and their
    weight-sharing fp32 copy (what ``build_drafter`` holds): within 1%, where the 6 bytes a parameter the plan used
    before were 1.5-2.3 times what is held."""
    recipe = tmp_path / "pair.yaml"
    recipe.write_text(RECIPE.read_text().replace("path:../fixtures", f"path:{RECIPE.parent.parent / 'fixtures'}")
                      .replace("  context: 512\n", f"  context: 512\n  quantization: {{method: {method}}}\n"))
    plan = make_plan(recipe, str(tmp_path / "out"))
    assert plan.parts[0].is_whole
    target, _ = shipped_modules(plan)
    copy32 = compute_copy(target, torch.float32, share_weights=True)
    storages = {}
    for modules in (target, copy32):
        for t in [*modules.core.parameters(), *modules.core.buffers()]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    held = sum(storages.values())  # measured here: 34.98 MB unquantized, 51.03 MB affine4 (0.2% and 0.06% off)
    estimate = held_target_bytes(plan.args, plan.recipe.target, lean=False)
    assert abs(estimate - held) < 0.01 * held, (estimate, held)
    assert estimate == plan.drafter_stage_target_bytes
    assert 6 * plan.parameter_count > 1.5 * held  # the earlier formula: 79.3 MB


def test_prompts_run_in_sessions_give_the_runs_and_hessians_of_one_prompt_at_a_time(pair, monkeypatch):
    """``over_prompts``: three prompts over two sessions in step (the first session takes the third prompt when done),
    the target and drafter sharing their weights (every linear meets the other session's); greedy references, the
    speculative runs and the calibration's Hessians equal those of one prompt at a time, bit for bit."""
    target32, modules, prompts, anchors = pair
    prompts = [*prompts, prompts[0][5:29]]
    target = compute_copy(target32, torch.float32, share_weights=True)
    drafter32 = compute_copy(modules, torch.float32, share_weights=True)
    one = drafter_accept.greedy_references(target, prompts, 10)
    two = drafter_accept.greedy_references(target, prompts, 10, sessions=2)
    assert [ids for ids, _ in one] == [ids for ids, _ in two]
    assert all(np.array_equal(a, b) for (_, la), (_, lb) in zip(one, two, strict=True)
               for a, b in zip(la, lb, strict=True))
    stats1, runs1 = drafter_accept.accept("dflash2", target, drafter32, prompts, 10, anchors, one)
    stats2, runs2 = drafter_accept.accept("dflash2", target, drafter32, prompts, 10, anchors, one, sessions=2)
    assert stats1 == stats2 and stats1["rounds"] >= 6
    assert [(r.output, r.rounds) for r in runs1] == [(r.output, r.rounds) for r in runs2]
    monkeypatch.setattr(drafter_memory, "HESSIAN_GROUP_BYTES", 1 << 40)  # one group: taken live in one session
    live = list(calibration_hessians("dflash2", target, drafter32, prompts, 10, anchors))
    replayed = list(calibration_hessians("dflash2", target, drafter32, prompts, 10, anchors, sessions=2))
    assert len(live) == len(replayed) == 1 and list(live[0]) == list(replayed[0])
    assert all(torch.equal(live[0][name], replayed[0][name]) for name in live[0])


def test_a_calibration_stopped_part_way_runs_only_the_prompts_its_journal_lacks(pair, tmp_path, monkeypatch):
    """``over_prompts`` with a ``PromptJournal`` (the build cache's record of each finished prompt): a calibration over
    two sessions stopped at its third prompt (as a build killed in that phase stops) keeps the first two; run again,
    it runs the third alone, and its Hessians equal an uninterrupted run's bit for bit."""
    target32, modules, prompts, anchors = pair
    prompts = [*prompts, prompts[0][5:29]]
    target = compute_copy(target32, torch.float32, share_weights=True)
    drafter32 = compute_copy(modules, torch.float32, share_weights=True)
    want = list(calibration_hessians("dflash2", target, drafter32, prompts, 10, anchors, sessions=2))
    journal = drafter.PromptJournal(BuildCache(tmp_path / "cache"), "calibration of this test")
    speculate, ran = speculative.speculate, []

    def counted(target_driver, drafter_driver, prompt, tokens, stop_at=None):
        if prompt == stop_at:
            raise RuntimeError("stopped")
        ran.append(prompt)
        return speculate(target_driver, drafter_driver, prompt, tokens)

    monkeypatch.setattr(speculative, "speculate", lambda *a: counted(*a, stop_at=prompts[2]))
    with pytest.raises(RuntimeError, match="stopped"):
        calibration_hessians("dflash2", target, drafter32, prompts, 10, anchors, sessions=2, journal=journal)
    assert sorted(ran) == sorted(prompts[:2])
    ran.clear()
    monkeypatch.setattr(speculative, "speculate", counted)
    got = list(calibration_hessians("dflash2", target, drafter32, prompts, 10, anchors, sessions=2,
                                            journal=journal))
    assert ran == [prompts[2]]
    assert [list(g) for g in got] == [list(w) for w in want]
    assert all(torch.equal(g[name], w[name]) for g, w in zip(got, want, strict=True) for name in w)


@pytest.mark.heavy  # minutes on 2 cores: `make test-heavy` (the suite's 15-minute budget, docs/development.md)
def test_a_drafter_gptqd_once_is_restored_from_the_build_cache_without_calibrating(tmp_path, monkeypatch):
    """``shipped_drafter`` with ``PhaseKeys``: the GPTQ'd linears go into the build cache as they are quantized; a
    second call restores them without running the calibration or GPTQ, the same codes and record."""
    recipe = tmp_path / "pair.yaml"
    recipe.write_text(RECIPE.read_text().replace("path:../fixtures", f"path:{RECIPE.parent.parent / 'fixtures'}"))
    plan = make_plan(recipe, str(tmp_path / "out"))
    assert plan.drafter.config.quantization.uses_gptq
    target, _ = shipped_modules(plan)
    keys = drafter_build.PhaseKeys(plan, BuildCache(tmp_path / "cache"), [], [])
    first, _, record = drafter_build.shipped_drafter(plan, target, compute_copy(target, torch.float32), keys=keys)

    def refused(*_args, **_kwargs):
        raise AssertionError("calibrated or quantized again")

    monkeypatch.setattr(drafter_calibration, "calibration_hessians", refused)
    monkeypatch.setattr(drafter_calibration, "gptq_quantize", refused)
    again, fp16, restored = drafter_build.shipped_drafter(plan, target, compute_copy(target, torch.float32), keys=keys)
    assert restored == record and record["layers"]
    assert weights_digest(again) == weights_digest(first)  # every code, table and other parameter
    assert fp16 is not None


def test_the_ab_reference_is_the_fp16_drafter_loaded_again_not_held_through_quantization(tmp_path):
    """``shipped_drafter`` lets each fp16 weight go as it quantizes it and loads the drafter again for the A/B: the
    reference computes with the checkpoint's fp16 weights and shares none of the quantized modules' storages."""
    recipe = tmp_path / "pair.yaml"
    recipe.write_text(RECIPE.read_text().replace("path:../fixtures", f"path:{RECIPE.parent.parent / 'fixtures'}")
                      .replace("{method: lut4-gptq}", "{method: lut4}"))
    plan = make_plan(recipe, str(tmp_path / "out"))
    assert plan.drafter.config.quantization.method == "lut4"
    target, _ = shipped_modules(plan)
    before = drafter.build_modules(plan.drafter, plan.recipe, target, torch.float16)
    modules, fp16, record = drafter_build.shipped_drafter(plan, target, compute_copy(target, torch.float32))
    assert record["method"] == "lut4"
    own = drafter_memory.own_linears(fp16.core)
    assert [n for n, _ in own] == [n for n, _ in drafter_memory.own_linears(before.core)]
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float16 for _, m in own)
    assert all(torch.equal(m.weight, dict(drafter_memory.own_linears(before.core))[n].weight) for n, m in own)
    quantized = {t.untyped_storage().data_ptr() for m in modules.core.modules() if isinstance(m, CodesLinear)
                 for t in m.buffers()}
    assert not quantized & {t.untyped_storage().data_ptr() for t in fp16.core.parameters()}
    assert len(quantized) > 10


@pytest.mark.parametrize("layout", ["stateful", "ane"])
def test_the_drafter_stages_prompts_run_on_states_of_the_positions_they_reach(tmp_path, layout):
    """``stage_copy``: the target's fp32 copy the drafter stage runs its prompts on holds its states (the ane layout:
    the host's buffers) at the 144 positions its prompts reach (64 tokens, 64 generated and two verifies of 8), not the
    recipe's 512 (the ane one with a ladder entry at 256); it decodes what the whole-context copy decodes (a held-out
    prompt's 64 greedy ids the same, their logits within 1e-5, fp32), and its metered run prices every call as the
    shipped package reads it (a state whole; the ane host's buffers as the entry of the ladder that holds the call
    takes them): the economics of a speculative run are the whole copy's, byte for byte."""
    recipe = tmp_path / "pair.yaml"
    text = RECIPE.read_text().replace("path:../fixtures", f"path:{RECIPE.parent.parent / 'fixtures'}")
    if layout == "ane":
        text = text.replace("  context: 512\n", "  context: 512\n  layout: ane\n  ladder: [256]\n")
    recipe.write_text(text)
    plan = make_plan(recipe, str(tmp_path / "out"))
    target, _ = shipped_modules(plan)
    staged, whole = drafter_build.stage_copy(plan, target), compute_copy(target, torch.float32, share_weights=True)
    assert drafter.stage_positions(plan.recipe) == 144
    driven = {"staged": ModuleFunctions(staged), "whole": ModuleFunctions(whole)}
    rows = {name: sorted({tensor.shape[2] for key, tensor in functions.states().items() if key.startswith("key_")})
            for name, functions in driven.items()}
    assert rows == {"staged": [144], "whole": [512]}, rows
    sized = at_context(target, plan.args, drafter.stage_target(plan.recipe))  # the shipped tensors, not a copy
    assert all(a is b for a, b in zip(sized.core.parameters(), target.core.parameters(), strict=True))
    prompt = drafter_build.held_out_prompts(plan)[0][0]
    runs = {name: TargetDriver(driven[name], copy.widths, copy.contract).greedy(prompt, 64)
            for name, copy in (("staged", staged), ("whole", whole))}
    assert runs["staged"][0] == runs["whole"][0]
    assert max(float(np.abs(a - b).max()) for a, b in zip(runs["staged"][1], runs["whole"][1], strict=True)) < 1e-5

    modules = drafter.build_modules(plan.drafter, plan.recipe, target, torch.float16)
    drafter32, anchors = compute_copy(modules, torch.float32, share_weights=True), drafter.anchor_table(target)
    costs = {name: drafter_accept.economics("dflash2", target, copy, modules, drafter32, prompt, 64, anchors, 3.0)
             for name, copy in (("staged", staged), ("whole", whole))}
    assert costs["staged"] == costs["whole"]
    if layout == "ane":  # every call of the run is within 256 positions: the host passes the 256 entry its rows
        entry, owned = dict(target.functions)["verify_256"][1], target.contract["buffers"]
        assert costs["staged"]["bytes_per_call"]["target.verify"]["states"] == sum(
            math.prod(t.shape) * 2 for t in entry.inputs if t.name in owned)


@pytest.mark.parametrize("room, held", [(4 * 4 * 256 * 256, [torch.float32] * 4),  # every weight in fp32
                                        (2 * 2 * 256 * 256 + 100, [torch.float16] * 2 + [None] * 2),  # two in fp16
                                        (0, [None] * 4)])  # none: all from their codes
def test_on_an_accelerator_the_stage_copys_weights_are_dense_as_far_as_its_free_memory_holds_them(monkeypatch,
                                                                                                    room, held):
    """``dense_on_device``: the stage copy's quantized linears hold their weights dequantized once within the device's
    free memory less ``DEVICE_HEADROOM_BYTES`` and the drafter's fp32 copy: all in fp32 where they fit, else in fp16
    as many as fit (the rest from their codes); each way the fp32 calls compute the codes' outputs bit for bit (an
    fp16 weight cast exactly)."""
    from types import SimpleNamespace

    from quant.types import QuantizedWeight

    generator = torch.Generator().manual_seed(0)

    def linear(i: int) -> CodesLinear:
        shape, groups = (256, 256), (256, 256 // 32)
        return CodesLinear(f"l{i}", QuantizedWeight(
            "affine4", torch.randint(0, 16, shape, dtype=torch.uint8, generator=generator), 32,
            scale=(torch.rand(groups, generator=generator) * 0.02).half(),
            zero_point=torch.randint(0, 16, groups, dtype=torch.uint8, generator=generator)))

    core = torch.nn.Sequential(*[linear(i) for i in range(4)]).float()
    x = torch.randn(9, 256, generator=generator)
    want = [m(x) for m in core]
    drafter_params = 1000
    plan = SimpleNamespace(torch_device=torch.device("cpu"),
                           drafter=SimpleNamespace(args=SimpleNamespace(parameter_count=drafter_params)))
    monkeypatch.setattr(drafter_build, "free_bytes",
                        lambda _: drafter_build.DEVICE_HEADROOM_BYTES + 4 * drafter_params + room)
    drafter_build.dense_on_device(plan, SimpleNamespace(core=core))
    assert [m.__dict__.get("dense", SimpleNamespace(dtype=None)).dtype for m in core] == held
    assert all(torch.equal(m(x), w) for m, w in zip(core, want, strict=True))
