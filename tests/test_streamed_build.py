"""A target larger than memory: the shipped modules loaded a piece at a time equal the whole shipped modules bit for
bit, the quantize stage's weights read back from its cache entries equal the ones it returns, and the streamed
gate's candidate computes what the whole candidate computes."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from convert.cache import BuildCache
from convert.errors import InputError
from convert.export.functions import compute_copy
from convert.export.quantized import dense_products
from convert.fp16 import Peaks
from convert.models import family_of
from convert.pipeline import build, gate_cache, partition
from convert.pipeline import plan as planning
from convert.pipeline.build import shipped_modules
from convert.pipeline.drafter import stage_target
from convert.pipeline.partition import reference_window_bytes
from convert.pipeline.plan import make_plan
from convert.runtime.host import TargetDriver
from convert.verify import gates
from convert.verify.checks import part_calls, recorded_calls, short_schedule
from convert.weights.quantize import quantize_checkpoint, summary
from convert.weights.shipped import HeldTarget, PartLoader, part_modules

ROOT = Path(__file__).resolve().parents[1]
FP32_BOUND = 1e-5


def _recipe(tmp_path: Path, name: str, method: str, taps: str, layout: str = "stateful") -> Path:
    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    text = text.replace("path:../fixtures", f"path:{ROOT / 'fixtures'}")
    text = text.replace("  context: 512", f"  context: 512\n  layout: {layout}\n  taps: {taps}\n  max_part_mb: 1\n"
                        f"  quantization: {{method: {method}}}")
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(text)
    return recipe


# hybrid-ane: the streamed gate's one-layer pieces include attention layers alone, which take no commit inputs
CASES = {"hybrid": ("tiny_qwen3_5", "affine4", "[5, 1]"), "dense": ("tiny_qwen3", "affine4", "[2, 0]"),
         "hybrid-ane": ("tiny_qwen3_5", "affine4", "[5, 1]", "ane")}


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory):
    name, method, taps, *layout = CASES[request.param]
    plan = make_plan(_recipe(tmp_path_factory.mktemp(name), name, method, taps, *layout))
    cache = BuildCache(tmp_path_factory.mktemp("cache"))

    def quantize(in_memory: bool):
        return quantize_checkpoint(plan.snapshot.directory, plan.args, plan.recipe.target, plan.layout,
                                   plan.recipe.target.quantization, plan.recipe_path.parent, cache=cache,
                                   in_memory=in_memory)

    returned = quantize(True)  # computed and stored
    result = quantize(False)  # every unit stored: read back by the loader
    modules, _ = shipped_modules(plan, cache)
    return plan, modules, PartLoader(plan, result), result, returned


def test_the_parts_loaded_alone_are_the_shipped_modules_bit_for_bit(built):
    plan, modules, loader, *_ = built
    assert len(plan.parts) > 3
    for part in [*plan.parts, *loader.units()]:
        alone = loader.load([part])[0].core.state_dict()
        whole = part_modules(modules, plan.recipe.target, [part])[0].core.state_dict()
        assert alone.keys() == whole.keys(), part.name
        for key, value in whole.items():
            assert alone[key].dtype == value.dtype and torch.equal(alone[key], value), f"{part.name}: {key}"


def test_the_weights_read_back_from_the_cache_are_the_ones_returned(built):
    plan, modules, _, result, returned = built
    assert set(result.units.values()) == {"cached"} and set(returned.units.values()) == {"computed"}
    assert not result.weights and len(result.entries) == plan.args.num_hidden_layers + 2
    assert result.names() == set(returned.weights)
    for name, weight in result.items():
        assert torch.equal(weight.codes, returned.weights[name].codes), name
    assert summary(result.items(), modules.core.parameters()) == summary(returned.weights, modules.core.parameters())


# watched: the windows one after the other on one host. kept: the states between passes on disk, in memory, or in
# memory with the pieces views of the whole target held as its codes (``HeldTarget``, here on the CPU); "held-dense":
# that, computed as on an accelerator (one host, each piece's weights dequantized once: ``dense_products``), in the
# release layout only. Both fixtures have the commit-next-call contract.
@pytest.mark.parametrize("built, watched, kept", [
    *((built, watched, kept) for built in ("hybrid", "hybrid-ane")
      for watched, kept in ((False, "disk"), (True, "memory"), (False, "held"))),
    ("hybrid-ane", False, "held-dense")], indirect=["built"])
def test_the_streamed_candidate_computes_what_the_whole_candidate_computes(built, watched, kept, monkeypatch):
    plan, modules, loader, *_ = built
    if kept == "held-dense":
        monkeypatch.setattr(gates, "_in_step", lambda _device: False)
        dense = []
        monkeypatch.setattr(gates, "dense_products", lambda core: dense.append(core) or dense_products(core))
    g = torch.Generator().manual_seed(5)
    windows = torch.randint(3, plan.args.vocab_size, (2, 80), generator=g).tolist()
    taps, probe = list(modules.core.taps), gates.default_probe(modules)
    peaks = Peaks() if watched else None
    if kept.startswith("held"):
        loader = HeldTarget(loader, torch.device("cpu"))
        assert all(type(m).__name__ == "CodesLinear" for m in loader.whole.core.modules()
                   if type(m).__name__ in ("CodesLinear", "QuantizedLinear"))
    streamed = gates.streamed_candidate(loader, windows, taps, 4, probe, torch.Generator().manual_seed(0),
                                        peaks=peaks, state_room=0 if kept == "disk" else 1 << 40)
    if watched:  # each piece's modules noted under the whole target's names
        layers = {int(name.split(".")[2]) for name, kind in peaks.peaks if kind == "output"
                  and re.fullmatch(r"target\.layers\.\d+", name)}
        assert layers == set(range(plan.args.num_hidden_layers))
    if kept == "held-dense":  # every piece dense: its quantized linears' weights as their blocks compute them
        assert len(dense) == 4 * len(loader.units())
        linears = [m for m in dense[1].modules() if type(m).__name__ == "CodesLinear" and not m.embedding]
        assert linears and all(torch.equal(m.dense[lo:hi], m.dense_rows(lo, hi, torch.float32))
                               for m in linears for lo, hi in m.row_blocks())
    candidate, generator = compute_copy(modules, torch.float32), torch.Generator().manual_seed(0)
    for window, got in zip(windows, streamed, strict=True):
        want = gates._candidate_window(candidate, window, taps, 4, probe, generator)
        assert got.greedy == want.greedy
        assert (got.logits - want.logits).abs().max() <= FP32_BOUND * want.logits.abs().max()
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        for t in taps:
            assert (got.taps[t] - want.taps[t]).abs().max() <= FP32_BOUND * want.taps[t].abs().max()
        assert len(got.probe) == len(want.probe) == len(probe)
        for (p, block, chain), (q, block_want, chain_want) in zip(got.probe, want.probe, strict=True):
            assert p == q and block.shape == block_want.shape and chain.shape == chain_want.shape
            assert (block - block_want).abs().max() <= FP32_BOUND * block_want.abs().max()
            assert (chain - chain_want).abs().max() <= FP32_BOUND * chain_want.abs().max()


def test_each_part_records_alone_the_calls_of_the_chained_parts(built):
    plan, modules, loader, *_ = built
    outline = loader.outline
    pieces = part_modules(modules, plan.recipe.target, plan.parts)
    chained = recorded_calls(plan.parts, pieces, plan.recipe.target.taps, modules.contract, plan.args.vocab_size,
                             short=True)
    driver = TargetDriver(None, outline.widths, outline.contract)
    schedule = [(f, driver.inputs(f, t, p0)) for f, t, p0 in short_schedule(outline.widths, plan.args.vocab_size)]
    rows = [None] * len(schedule)
    for part, want in zip(plan.parts, chained, strict=True):
        got, rows = part_calls(loader.load([part])[0], schedule, rows)
        assert [c[0] for c in got] == [c[0] for c in want] == ["reset", "decode", "decode", "verify"]
        for (_, inputs, outputs), (_, inputs_want, outputs_want) in zip(got, want, strict=True):
            assert inputs.keys() == inputs_want.keys() and outputs.keys() == outputs_want.keys()
            for k in inputs_want:
                assert np.array_equal(inputs[k], inputs_want[k]), (part.name, k)
            for k in outputs_want:
                assert np.array_equal(outputs[k], outputs_want[k]), (part.name, k)


@pytest.mark.heavy  # the candidate test above and the reference's own tests cover its pieces in `make test`
@pytest.mark.parametrize("built", ["hybrid"], indirect=True)
def test_the_streamed_gate_reports_what_the_gate_reports(built):
    plan, modules, loader, *_ = built
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(plan.snapshot.directory / "tokenizer.json"))
    data = gates.EvalData.fixture(tokenizer, n=2, length=80)
    thresholds = gates.default_thresholds(plan.recipe.target.quantization.method)
    whole = gates.run_gates(gates.load_reference(plan.snapshot.directory), modules, data, thresholds,
                            greedy_tokens=3, progress=False)
    streamed = gates.run_streamed_gates(plan.snapshot.directory, loader, data, thresholds, greedy_tokens=3)
    values = {m.name: m.value for m in whole.metrics}
    assert [m.name for m in streamed.metrics] == list(values)
    for m in streamed.metrics:
        assert m.value == pytest.approx(values[m.name], rel=1e-5, abs=1e-7), m.name
    assert streamed.passed == whole.passed


@pytest.mark.parametrize("built", ["hybrid"], indirect=True)
def test_a_streamed_gate_stopped_in_its_reference_resumes_with_the_candidate_it_kept(built, tmp_path, monkeypatch):
    """``gate_cache.GatePasses``: the candidate's windows are a cache entry as soon as they are computed. A gate
    stopped in its reference runs again without the candidate (refused): its windows restored are the ones computed,
    bit for bit; a third run restores the reference too and reports the second's values; ``discard`` removes both
    entries."""
    plan, _, loader, *_ = built
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(plan.snapshot.directory / "tokenizer.json"))
    data = gates.EvalData.fixture(tokenizer, n=2, length=80)  # four probe blocks of 8 after a prefill of 40
    thresholds = gates.default_thresholds(plan.recipe.target.quantization.method)
    passes = gate_cache.GatePasses(tmp_path / "cache", "the gate of this test")
    candidate, reference, computed = gates.streamed_candidate, gates.streamed_reference, []

    def run(**refused):
        for name in refused:
            monkeypatch.setattr(gates, name, lambda *a, name=name, **k: pytest.fail(f"{name} ran again"))
        return gates.run_streamed_gates(plan.snapshot.directory, loader, data, thresholds, greedy_tokens=3,
                                        keep=passes)

    monkeypatch.setattr(gates, "streamed_candidate", lambda *a, **k: computed.append(candidate(*a, **k)) or computed[0])
    monkeypatch.setattr(gates, "streamed_reference", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stopped")))
    with pytest.raises(RuntimeError, match="stopped"):
        run()
    monkeypatch.setattr(gates, "streamed_reference", reference)
    second = run(streamed_candidate=True)
    third = run(streamed_candidate=True, streamed_reference=True)
    restored = passes("candidate", lambda: pytest.fail("not kept"))
    assert len(restored) == len(computed[0]) == 2
    for got, want in zip(restored, computed[0], strict=True):
        assert torch.equal(got.logits, want.logits) and got.greedy == want.greedy
        assert all(torch.equal(got.taps[t], want.taps[t]) for t in want.taps)
    assert [m.value for m in third.metrics] == [m.value for m in second.metrics]
    passes.discard()
    assert not list((tmp_path / "cache").rglob("entry.json"))


def test_the_manifest_records_of_a_streamed_build_are_the_whole_targets(built):
    plan, modules, loader, result, returned = built
    tables = loader.load([build.tables_part(plan.args)])[0]
    quant = plan.recipe.target.quantization
    assert build.quantization_record(quant, result, tables) == build.quantization_record(quant, returned, modules)
    for name in ("embed_tokens", "lm_head"):
        assert torch.equal(getattr(tables.core, name).weight, getattr(modules.core, name).weight)
    assert sum(p.numel() for p in tables.core.parameters()) == sum(p.numel() for p in modules.core.parameters())


def test_a_streamed_gate_over_the_host_memory_budget_is_refused_before_any_work(tmp_path):
    recipe = _recipe(tmp_path, "tiny_qwen3_5", "affine4", "[5, 1]")
    plan = make_plan(recipe)
    assert not plan.parts[0].is_whole and plan.peak_memory_bytes <= 16e9
    # the reference holds every window's states and taps (its logits go to disk): enough windows put the gate over
    # the budget
    per_window = reference_window_bytes(plan.args, plan.recipe.target)
    windows = int(16e9 / per_window) + 1
    recipe.write_text(recipe.read_text().replace("data: {samples: 16, length: 256}",
                                                 f"data: {{samples: {windows}, length: 256}}"))
    with pytest.raises(InputError, match=rf"target.gate.data: the streamed gate over {windows} x 256 tokens "
                       r"needs about 1[6-9]\.\d GB of host memory \(every window's states.*over "
                       r"target.max_host_memory_gb 16; lower samples or length"):
        make_plan(recipe)


def test_a_drafter_stage_over_the_host_memory_budget_is_refused_by_name(tmp_path, monkeypatch):
    # the drafter stage runs in the build process (one base), the parted target's stages beside it (two): weigh the
    # tiny drafter's own share as a drafter 100 times its size would weigh, so that its stage is the larger
    own_phase_bytes = planning.own_phase_bytes
    monkeypatch.setattr(planning, "own_phase_bytes", lambda d: {k: 100 * v for k, v in own_phase_bytes(d).items()})
    text = (ROOT / "recipes" / "tiny_qwen3_5_dflash2.yaml").read_text()
    text = text.replace("path:../fixtures", f"path:{ROOT / 'fixtures'}").replace(
        "  context: 512\n", "  context: 512\n  max_part_mb: 3\n  quantization: {method: affine4}\n").replace(
        "data: {samples: 16, length: 256}", "data: {samples: 2, length: 64}")  # a gate small beside the target
    recipe = tmp_path / "pair.yaml"
    recipe.write_text(text)
    plan = make_plan(recipe)
    target_alone = partition.build_memory_bytes(plan.args, plan.recipe.target, plan.parts, plan.specs)
    # the drafter stage holds the parted target as its packed codes (held_target_bytes) while it calls it, its tables
    # alone while GPTQ runs and at packaging; the sessions' states (each the fp32 states of the target and the
    # drafter) where prompts run
    lean = partition.held_target_bytes(plan.args, plan.recipe.target, lean=True)
    assert lean < 3 * plan.parameter_count  # affine4 codes and scales, not fp16 and fp32 (6 bytes a parameter)
    phases = plan.drafter_phases
    assert list(phases) == ["load", "calibrate", "quantize", "accept", "package"]
    assert phases["load"]["target"] == phases["calibrate"]["target"] == phases["accept"]["target"] == lean
    assert phases["quantize"]["target"] == phases["package"]["target"] < lean / 2
    # the target's states at the 144 positions the stage's prompts reach (64 + 64 tokens, two verifies of 8)
    states = [*family_of(plan.args).function_specs(plan.args, stage_target(plan.recipe))[0].states,
              *plan.drafter.specs[0].states]
    assert {s.shape[2] for s in states if s.name == "key_cache"} == {144}
    assert plan.drafter_session_bytes == sum(4 * math.prod(s.shape) for s in states)
    sessions = plan.drafter_sessions * plan.drafter_session_bytes
    assert [p["sessions"] for p in phases.values()] == [0, sessions, 0, sessions, 0]
    assert plan.drafter_stage_bytes == partition.BASE_BYTES + max(sum(p.values()) for p in phases.values()) \
        > target_alone
    budget = (target_alone + plan.drafter_stage_bytes) / 2 / 1e9
    recipe.write_text(text.replace("  max_part_mb: 3\n", f"  max_part_mb: 3\n  max_host_memory_gb: {budget}\n"))
    with pytest.raises(InputError, match=r"drafter: the drafter stage needs about \d+ GB \(its largest phase, "
                       r"(\w+): the target \(its quantized weights as packed codes\) [\d.]+ [KM]iB, the drafter "
                       r"[\d.]+ [KMG]iB(, 1 session of prompts run at once, its states [\d.]+ [KM]iB \(at 144 "
                       r"positions\))?\), over target.max_host_memory_gb .*; build the target alone here") as refused:
        make_plan(recipe)
    named = re.search(r"largest phase, (\w+):", str(refused.value)).group(1)
    monkeypatch.setattr(planning, "check_host_memory", lambda plan: None)
    phases = make_plan(recipe).drafter_phases  # the refused plan's, one session
    assert named == max(phases, key=lambda phase: sum(phases[phase].values()))
