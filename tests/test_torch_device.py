"""``build --device``: where the torch stages compute (``convert/torch_device.py``), and that a GPU computes what the
CPU does. The option's refusals, the plan's line and the build cache's keys run anywhere; the equality tests need CUDA
and are skipped without it (they run on the GPU machine: docs/benchmarks.md "Torch stages on a GPU" has the run)."""

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from convert.cli import main
from convert.errors import InputError
from convert.torch_device import resolve

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_qwen3.yaml"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")


def test_the_default_and_cpu_resolve_to_the_cpu():
    assert resolve(None) == resolve("cpu") == torch.device("cpu")
    assert resolve("auto").type == ("cuda" if torch.cuda.is_available() else "mps"
                                    if torch.backends.mps.is_available() else "cpu")


def test_an_unknown_or_absent_device_is_refused_naming_the_option():
    with pytest.raises(InputError, match=r"--device: 'tpu' is not one of auto, cpu, cuda, mps"):
        resolve("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="--device cuda: this machine has no cuda device"):
            resolve("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA refuses --device cuda")
def test_build_device_cuda_without_cuda_exits_2_before_planning(tmp_path):
    result = CliRunner().invoke(main, ["build", str(RECIPE), "--dry-run", "--device", "cuda"])
    assert result.exit_code == 2 and "--device cuda: this machine has no cuda device" in result.output
    assert "Traceback" not in result.output


def test_the_plan_says_where_each_torch_stage_computes():
    result = CliRunner().invoke(main, ["build", str(RECIPE), "--dry-run"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("  torch stages: "))
    assert line.startswith("  torch stages: range, gate reference, gate candidate and device pass, package checks' "
                           "recorded calls on cpu (")


def test_an_accelerators_plan_says_the_gate_holds_a_parted_target_as_its_codes(tmp_path, monkeypatch):
    """On an accelerator the streamed gate's candidate computes views of the target held there as its codes, where
    it fits (``build.gate_loader``): the plan's stage line says so with the held bytes (the fixture's affine4 codes
    and tables, under its fp16 weights' 2 bytes each). The package checks' calls are recorded there where each part
    records its own (above ``CHAINED_RUN_PARAMETERS``), on the CPU where the parts run chained. Nothing here needs
    the device."""
    import re

    from convert.pipeline import plan_costs
    from convert.pipeline.partition import held_target_bytes
    from convert.pipeline.plan import torch_stages

    plan = _fixture_plan(tmp_path, 2, "  max_part_mb: 4\n  quantization: {method: affine4}\n")
    assert len(plan.parts) > 1
    stages = dict(torch_stages(dataclasses.replace(plan, torch_device=torch.device("cuda"))))
    (candidate,) = [name for name in stages if name.startswith("gate candidate and device pass")]
    shown = float(re.search(r"held there as its codes, about ([\d.]+) MB, where it fits", candidate).group(1))
    held = held_target_bytes(plan.args, plan.recipe.target, lean=True)
    assert shown == round(held / 1e6, 1) and held < 2 * plan.args.parameter_count
    assert stages[candidate] == torch.device("cuda")
    assert stages["package checks' recorded calls"] == torch.device("cpu")  # chained: the fixture's 11.8M parameters
    assert not any("held" in name for name, _ in torch_stages(plan))  # the CPU streams its pieces
    monkeypatch.setattr(plan_costs, "CHAINED_RUN_PARAMETERS", 0)
    cuda = dataclasses.replace(plan, torch_device=torch.device("cuda"))
    assert dict(torch_stages(cuda))["package checks' recorded calls"] == torch.device("cuda")


DRAFTER_PHASES = ("drafter stage: range, calibration, GPTQ, plain greedy, acceptance, economics, n-gram baseline, "
                  "A/B, device pass")


def _pair_plan(tmp_path: Path, samples: int = 4, tokens: int = 32):
    """The dense fixture with its trained DFlash2 drafter (``recipes/tiny_qwen3_dflash2.yaml``, lut4-gptq), its
    drafter's calibration (on the validation split) and acceptance cut to ``samples`` prompts of 64 tokens and
    ``tokens`` generated."""
    from convert.pipeline.plan import make_plan

    recipe = tmp_path / "pair.yaml"
    text = (ROOT / "recipes" / "tiny_qwen3_dflash2.yaml").read_text().replace("path:../fixtures",
                                                                              f"path:{ROOT / 'fixtures'}")
    cut = f"samples: {samples}, length: 64, tokens: {tokens}"
    # calibrated on the shipped validation split: the train split is this Python's stdlib, which the device
    # machine's Python 3.12 refuses to claim as the corpus the fixture's manifest names
    recipe.write_text(text.replace("{method: lut4-gptq}",
                                   f"{{method: lut4-gptq, calibration: {{corpus: 'fixture:validation', {cut}}}}}")
                      .replace("accept: {samples: 8, length: 64, tokens: 64}", f"accept: {{{cut}}}"))
    plan = make_plan(recipe, tmp_path / "out", tmp_path / "cache")
    assert plan.drafter.config.quantization.uses_gptq and plan.drafter.config.accept.samples == samples
    return plan


def test_a_pairs_plan_says_which_drafter_phases_compute_on_the_device(tmp_path):
    """The drafter stage's torch phases compute on the build's device, its package check's recorded calls (the CPU
    runtime's arithmetic) on the CPU; on the CPU both are said on the CPU. Nothing here needs the device."""
    from convert.inputs.recipe import DrafterQuantization
    from convert.pipeline.plan import torch_stages

    plan = _pair_plan(tmp_path)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    stages = dict(torch_stages(dataclasses.replace(plan, torch_device=cuda)))
    assert stages[DRAFTER_PHASES] == cuda and stages["drafter package check's recorded calls"] == cpu
    assert {device for _, device in torch_stages(plan)} == {cpu}
    unquantized = plan.drafter.config.model_copy(update={"quantization": DrafterQuantization(method="none")})
    recipe = plan.recipe.model_copy(update={"drafter": unquantized, "target": plan.recipe.target.model_copy(
        update={"rescale": False})})
    (name, _), _ = torch_stages(dataclasses.replace(plan, recipe=recipe, torch_device=cuda))[-2:]
    assert name == "drafter stage: plain greedy, acceptance, economics, n-gram baseline, device pass"


def test_the_drafter_stages_cache_keys_hold_the_torch_device(tmp_path):
    """The build cache keys of the drafter's GPTQ'd linears (``QUANTIZED_STAGE``) and of every journaled phase
    (``PhaseKeys``) differ between torch devices: a GPU's GPTQ may round a code the other way than the CPU's, and its
    fp32 sums in another order may decide a near tie, so neither restores the other's codes or prompts as its own.
    The CPU's keys are those they were (no device in them). Nothing here needs the device."""
    from convert.cache import BuildCache
    from convert.pipeline.drafter_build import PhaseKeys

    plan = _pair_plan(tmp_path)
    cache, prompts = BuildCache(tmp_path / "cache"), [[1, 2, 3], [4, 5, 6]]
    keys = {kind: PhaseKeys(dataclasses.replace(plan, torch_device=torch.device(kind)), cache, [], [])
            for kind in ("cpu", "cuda", "mps")}
    for phase in ("quantize", "calibrate", "greedy", "accept", "ngram", "ab-fp16"):
        assert len({k.key(phase, prompts, 32) for k in keys.values()}) == 3, phase
    assert "torch_device" not in keys["cpu"].base
    assert keys["cuda"].base == {**keys["cpu"].base, "torch_device": "cuda"}


# --- on a GPU --------------------------------------------------------------------------------------------------------

def _gate(plan, streamed: bool = False):
    from convert.pipeline.build import shipped_modules
    from convert.verify import gates
    from convert.weights.shipped import PartLoader

    if streamed:
        return gates.gate_streamed(plan, PartLoader(plan, None))
    modules, _ = shipped_modules(plan)
    return gates.gate_target(plan, modules)


def _same_gate(cpu, gpu, positions: int) -> None:
    """The same verdicts, greedy ids and flips; every statistic of the fp32 candidate within the order of
    summation's difference (a near tie may flip one position's argmax each way). The device pass computes in fp16,
    where another order of the fp32 sums rounds outputs to the neighbouring fp16 value, the size of the error it
    measures: its KL statistics agree within a factor 1.5 (measured on an H100: its largest KL 3.1e-5 against
    3.6e-5), the rest as the fp32 candidate's."""
    assert " on cuda" in gpu.candidate and " on cuda" not in cpu.candidate
    assert gpu.passed == cpu.passed
    for a, b in zip(cpu.metrics, gpu.metrics, strict=True):
        assert a.name == b.name and a.passed == b.passed
        tolerance = 0.05 * abs(a.value) + 1e-9 if a.name.startswith("kl_") else 1e-6
        if a.name in ("top1", "greedy_match"):
            tolerance = 2 / positions
        assert abs(a.value - b.value) <= tolerance, (a.name, a.value, b.value)
    assert [(f.sample, f.position) for f in cpu.flips] == [(f.sample, f.position) for f in gpu.flips]
    for a, b in zip(cpu.device.metrics, gpu.device.metrics, strict=True):
        assert a.name == b.name and a.passed == b.passed
        if a.name.startswith("kl_"):
            assert a.value / 1.5 <= b.value <= a.value * 1.5, (a.name, a.value, b.value)
        else:
            tolerance = 2 / 256 if a.name in ("top1", "greedy_match") else 1e-5
            assert abs(a.value - b.value) <= tolerance, (a.name, a.value, b.value)
    assert gpu.device.range.passed == cpu.device.range.passed


def _fixture_plan(tmp_path: Path, samples: int, extra: str = ""):
    from convert.pipeline.plan import make_plan

    recipe = tmp_path / "r.yaml"
    text = RECIPE.read_text().replace("path:../fixtures", f"path:{ROOT / 'fixtures'}")
    recipe.write_text(text.replace("samples: 16", f"samples: {samples}").replace("  context: 512",
                                                                                  f"{extra}  context: 512"))
    return make_plan(recipe, tmp_path / "out", tmp_path / "cache")


@CUDA
def test_the_fixture_gate_on_cuda_is_the_cpus(tmp_path):
    """The dense fixture's gate (4 windows of 256, the device pass on the first) on the CPU and on CUDA."""
    plan = _fixture_plan(tmp_path, 4)
    _same_gate(_gate(plan), _gate(dataclasses.replace(plan, torch_device=resolve("cuda"))), 4 * 256)


@CUDA
def test_the_streamed_gate_on_cuda_is_the_cpus(tmp_path):
    """The same fixture in parts, gated one piece at a time (the 27B's path): reference and candidates on CUDA."""
    plan = _fixture_plan(tmp_path, 2, "  max_part_mb: 4\n")
    assert len(plan.parts) > 1
    _same_gate(_gate(plan, True), _gate(dataclasses.replace(plan, torch_device=resolve("cuda")), True), 2 * 256)


@CUDA
@pytest.mark.parametrize("streamed", [False, True])
def test_the_range_scales_on_cuda_are_the_cpus(tmp_path, streamed):
    """The range stage's fp32 peaks (whole, and one piece at a time: the 27B's path, which took 6.5 min on the CPU of
    an H100 machine before it honoured the device) on CUDA: within 1e-4 of the CPU's, and the same scales."""
    from convert.pipeline import build
    from convert.pipeline.build import shipped_modules

    plan = _fixture_plan(tmp_path, 2, "  max_part_mb: 4\n" if streamed else "")
    gpu_plan = dataclasses.replace(plan, torch_device=resolve("cuda"))
    if streamed:
        (_, cpu_record), (_, gpu_record) = build.streamed_range_stage(plan), build.streamed_range_stage(gpu_plan)
    else:
        modules, _ = shipped_modules(plan)
        (_, cpu_record), (_, gpu_record) = build.range_stage(plan, modules), build.range_stage(gpu_plan, modules)
    assert (cpu_record.residual_scale, cpu_record.mlp_scales) == (gpu_record.residual_scale, gpu_record.mlp_scales)
    for a, b in zip(cpu_record.tightest, gpu_record.tightest, strict=True):
        assert (a.tensor, a.kind) == (b.tensor, b.kind) and abs(a.peak - b.peak) <= 1e-4 * abs(a.peak), (a, b)


@CUDA
def test_a_packs_unfold_on_cuda_is_the_cpus_bit_for_bit(tmp_path):
    """fp64 sums of a 2-bit pack's values are exact: the unfolded weights are the same bits on either device."""
    from convert.inputs import prism
    from tests.helpers.prism_packs import write_pack

    write_pack(tmp_path / "pack", tmp_path / "unfolded")
    pack = prism.read_pack(tmp_path / "pack")
    for module in pack.modules.values():
        cpu = prism.unfold(module)
        gpu = prism.unfold(module, device=torch.device("cuda"))
        assert gpu.device.type == "cuda" and torch.equal(cpu, gpu.cpu()), module.key


def _pack_plan(tmp_path: Path):
    """A tiny 2-bit pack (tests/helpers/prism_packs.py) in parts, the ane layout, and its plan on the CPU."""
    from convert.pipeline.plan import make_plan
    from tests.helpers.prism_packs import write_pack

    write_pack(tmp_path / "pack", tmp_path / "unfolded", seed=3, dense_dtype=torch.bfloat16)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""name: tiny-bonsai
target:
  source: path:{tmp_path / 'pack'}
  graphs: {{prefill: 16, decode: 1, verify: 8}}
  context: 128
  layout: ane
  max_part_mb: 0.06
  quantization: {{method: exact}}
  gate:
    data: {{samples: 4, length: 64}}
    greedy_tokens: 4
backends: [coreai]
""")
    plan = make_plan(recipe, tmp_path / "out", tmp_path / "cache")
    assert len(plan.parts) > 2
    return plan, dataclasses.replace(plan, torch_device=resolve("cuda"))


@CUDA
def test_the_streamed_gate_of_a_pack_held_on_cuda_is_the_cpus(tmp_path):
    """The pack gated as the 27B is on a GPU: the whole target held there as its codes (``build.gate_loader`` picks
    ``HeldTarget``), its states kept in memory; against the CPU's streamed gate."""
    from convert.pipeline import build
    from convert.verify import gates
    from convert.weights.shipped import HeldTarget, PartLoader

    plan, gpu_plan = _pack_plan(tmp_path)
    # the CPU's side held too (its gate is the loaded parts' bit for bit: tests/test_exact_build.py), which needs no
    # coreai-torch (the GPU machine has none; a loaded exact2 linear makes its packed module with it)
    cpu = gates.gate_streamed(plan, HeldTarget(PartLoader(plan, build.exact_result(plan)), torch.device("cpu")))
    loader = build.gate_loader(gpu_plan, build.exact_result(gpu_plan), None)
    assert isinstance(loader, HeldTarget) and gpu_plan.gate_state_room > 0
    assert {t.device.type for t in loader.whole.core.buffers() if t.dtype == torch.uint8} == {"cuda"}
    _same_gate(cpu, gates.gate_streamed(gpu_plan, loader), 4 * 64)


@CUDA
def test_the_parts_recorded_calls_on_cuda_are_the_cpus(tmp_path):
    """Each part's package-check calls (the short schedule) in the runtime's true fp16, the dense fixture's parts in
    the ane layout loaded as they are packaged, on the CPU and moved to CUDA, each part on the rows the CPU's previous
    part returned (what the package check replays is each part's calls on its own inputs). The products' order is
    fixed (``fp16.matmul``), so only the elementwise functions' last bits may differ: every output within 2e-3 of its
    largest magnitude. (Chained on CUDA's own rows, the parts' differences add up: 0.0156 at a largest 7.75 measured
    on an H100, docs/bench-logs/torch-device-tests-h100-2026-12-07-calls.log.)"""
    from convert.export.functions import compute_copy
    from convert.export.spec import SHIP_DTYPE
    from convert.pipeline import build
    from convert.verify.checks import part_calls
    from convert.weights.shipped import PartLoader

    plan = _fixture_plan(tmp_path, 2, "  max_part_mb: 4\n  layout: ane\n")
    assert len(plan.parts) > 2
    loader, device = PartLoader(plan, None), resolve("cuda")
    schedule = build.short_schedule_inputs(loader, plan.args.vocab_size)
    rows = [None] * len(schedule)
    for part in plan.parts:
        piece = compute_copy(loader.load([part])[0], SHIP_DTYPE, device=device)
        assert next(piece.core.parameters()).device.type == "cuda"
        gpu_calls, _ = part_calls(piece, schedule, rows, rounds=True)
        cpu_calls, rows = part_calls(loader.load([part])[0], schedule, rows, rounds=True)
        assert [c[0] for c in cpu_calls] == [c[0] for c in gpu_calls]
        for (_, _, want), (_, _, got) in zip(cpu_calls, gpu_calls, strict=True):
            for name, value in want.items():
                scale = max(1.0, float(abs(value.astype("float32")).max()))
                assert abs(got[name].astype("float32") - value.astype("float32")).max() <= 2e-3 * scale, name


# GPTQ's error feedback carries a code that rounds the other way along the rest of its row. Simulated on the CPU with
# this test's pair (its 20 linears, 2,236,416 codes): Hessians summed in fp64 instead of fp32 (apart by 2e-7 of their
# largest entry) moved 0.11% of the codes (21 of 6,176 rows), with the inputs perturbed by 1e-6 too 0.13%; every entry
# of each Hessian perturbed by a relative 1e-6 moved 0.23%, by 1e-5 2.4% (and then a tokens per round by 2%). The
# tables were the same, but for one entry (5e-4 apart) at 1e-5. A GPU's sums and its Cholesky differ from the CPU's
# about as the first: the bounds below leave a few times that.
CODES_APART = 0.01  # of the drafter's GPTQ'd codes at most
LUT_RTOL = 1e-2  # each lut4 table entry within
TOKENS_PER_ROUND_RTOL = 0.05  # the acceptance of drafters whose codes differ (identical where they do not)


def _drafter_stage(plan, target, shipped: tuple | None = None) -> dict:
    """The drafter stage's torch phases of ``plan`` with the shipped ``target`` as ``drafter_build.build_drafter`` runs
    them (no cache): the drafter's modules (shipped, and the A/B's fp16 ones), the quantized weights it ships,
    quantization record, acceptance (the economics, n-gram baseline and device pass in it) and A/B. ``shipped``:
    another run's (modules, fp16 modules), measured here in place of quantizing."""

    from convert.pipeline import drafter_accept, drafter_build

    target32 = drafter_build.stage_copy(plan, target)
    assert {t.device.type for t in [*target32.core.parameters(), *target32.states().values()]} == \
        {plan.torch_device.type}
    if shipped is None:
        modules, fp16, record = drafter_build.shipped_drafter(plan, target, target32)
    else:
        (modules, fp16), record = shipped, None
    # the shipped modules, which are packaged, stay on the CPU
    assert {t.device.type for t in [*modules.core.parameters(), *modules.core.buffers()]} == {"cpu"}
    held_out = drafter_build.held_out_prompts(plan)
    acceptance, ab = drafter_build.measure_held_out(plan, target, target32, modules, fp16, held_out)
    acceptance["device"] = drafter_accept.device_pass(plan, target, target32, modules, held_out[0][0],
                                                      plan.drafter.config.accept.tokens)
    # the codes and tables a package is made from (``packaged_from_codes`` would build coreai-torch's modules, which
    # a GPU machine may not have): the drafter's own quantized linears and the tables it borrows
    weights = {name: m.quantized_weight() for name, m in modules.core.named_modules() if hasattr(m, "quantized_weight")}
    return {"modules": (modules, fp16), "weights": weights, "record": record,
            "acceptance": acceptance, "ab": ab}


def _same_acceptance(cpu: dict, gpu: dict) -> None:
    """The acceptance of the same drafter: tokens per round, acceptance by position, lossless verdicts, the bytes each
    call reads (gathered rows follow the ids) and the n-gram baseline identical; the device pass's verdicts (its fp16
    outputs may round to the neighbouring value: its ids are not compared); the A/B identical."""
    for key in ("tokens_per_round", "acceptance_by_position", "lossless", "near_ties", "rounds", "economics", "ngram"):
        assert gpu["acceptance"][key] == cpu["acceptance"][key], key
    _same_verdicts(cpu, gpu)
    assert gpu["ab"] == cpu["ab"]


def _same_verdicts(cpu: dict, gpu: dict) -> None:
    assert gpu["acceptance"]["lossless"] == cpu["acceptance"]["lossless"] is True
    device, theirs = gpu["acceptance"]["device"], cpu["acceptance"]["device"]
    assert device["lossless"] == theirs["lossless"] is True
    assert device["range"]["over"] == theirs["range"]["over"] == [] and device["range"]["checked"] == theirs[
        "range"]["checked"]
    assert gpu["ab"]["significant_loss"] == cpu["ab"]["significant_loss"] is False


@CUDA
def test_the_drafter_stage_on_cuda_is_the_cpus(tmp_path):
    """The dense fixture pair's drafter stage (4 calibration prompts, 4 held-out prompts, 32 tokens each) on the CPU
    and on CUDA. The calibration's Hessians summed there and GPTQ run there may round a code the other way (at most
    ``CODES_APART`` of them) and the lut4 tables agree within ``LUT_RTOL``; the CPU's GPTQ'd drafter measured on CUDA
    accepts as on the CPU, identically (``_same_acceptance``); CUDA's own drafter has the same verdicts (lossless,
    device pass, A/B) and its tokens per round within ``TOKENS_PER_ROUND_RTOL`` (identical where its codes are)."""
    from convert.pipeline.build import shipped_modules

    plan = _pair_plan(tmp_path)
    gpu_plan = dataclasses.replace(plan, torch_device=resolve("cuda"))
    target, _ = shipped_modules(plan)  # one target for both (the stage leaves it as it is)
    cpu, gpu = _drafter_stage(plan, target), _drafter_stage(gpu_plan, target)
    assert cpu["weights"].keys() == gpu["weights"].keys() and len(cpu["weights"]) > 10
    codes = apart = 0
    for name, want in cpu["weights"].items():
        got = gpu["weights"][name]
        assert got.codes.device.type == "cpu" and (got.method, got.group_size) == (want.method, want.group_size)
        codes += want.codes.numel()
        apart += int((want.codes != got.codes).sum())
        assert torch.allclose(got.lut.float(), want.lut.float(), rtol=LUT_RTOL, atol=0), name
    assert apart <= CODES_APART * codes, f"{apart} of {codes} codes apart ({apart / codes:.3g})"
    assert [layer["name"] for layer in gpu["record"]["layers"]] == [layer["name"] for layer in cpu["record"]["layers"]]
    _same_acceptance(cpu, _drafter_stage(gpu_plan, target, cpu["modules"]))
    if apart == 0:
        _same_acceptance(cpu, gpu)
    else:
        _same_verdicts(cpu, gpu)
        want, got = cpu["acceptance"]["tokens_per_round"], gpu["acceptance"]["tokens_per_round"]
        assert abs(got - want) <= TOKENS_PER_ROUND_RTOL * want, (want, got, f"{apart} of {codes} codes apart")
