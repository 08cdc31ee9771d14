"""fp16 as the package checks and the devices compute it (``convert/fp16.py``): the check's torch side is this CPU's
Core AI runtime's arithmetic bit for bit, and every package kind's functions stay within the package check's own
bounds when they compute as the device of their layout does (or in true fp16, the runtime's), against fp32, on any
CPU; the seeded hybrids that do not are strict xfails with what was measured (docs/fp16.md)."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from convert.errors import PackageError
from convert.export.functions import FunctionModule, compute_copy
from convert.export.spec import FunctionSpec, TensorSpec
from convert.fp16 import device_arithmetic, matmul, true_fp16
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models.qwen3 import Qwen3Args
from convert.pipeline import drafter, drafter_build, drafter_calibration
from convert.pipeline.build import shipped_modules
from convert.pipeline.plan import make_plan
from convert.runtime.host import ModuleFunctions
from convert.verify import checks, gates
from convert.weights.target import build_modules
from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.dflash2_checkpoints import tiny_config as drafter_config
from tests.helpers.dflash2_checkpoints import write_drafter
from tests.helpers.mtp_checkpoints import write_target_with_head
from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

ROOT = Path(__file__).resolve().parent.parent


def test_every_product_and_partial_sum_is_rounded_to_fp16():
    # 2048 + 1 is 2049, which fp16 rounds to 2048 (its spacing there is 2): fp16 accumulation never leaves 2048,
    # torch's fp32 accumulator reaches 2056, and fp16 holds that exactly
    a = torch.tensor([[2048.0] + [1.0] * 8], dtype=torch.float16)
    b = torch.ones(9, 1, dtype=torch.float16)
    assert (a @ b).item() == 2056.0
    with true_fp16():
        assert (a @ b).item() == 2048.0
        assert torch.nn.functional.linear(a, b.T).item() == 2048.0
        assert torch.bmm(a[None], b[None]).item() == 2048.0
    assert matmul(a, b).item() == 2048.0
    # fp32 operands are left to torch
    with true_fp16():
        assert (a.float() @ b.float()).item() == 2056.0


class Products(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(256, 64, bias=True)

    def forward(self, x, q):
        return {"linear": self.linear(x), "scores": q @ q.transpose(1, 2)}


@pytest.mark.slow
def test_the_checks_torch_side_is_the_runtime_bit_for_bit(tmp_path):
    """The package check's torch side (``checks.like_the_runtime``) computes an fp16 linear and batched matmul as this
    CPU's Core AI runtime does, bit for bit. Where the runtime rounds every partial sum (measured: an Intel Xeon with
    AVX512-FP16, and an AMD EPYC with AVX-512 but without AVX512-FP16), that is true fp16, which torch's own kernels
    are not: a check comparing the runtime with torch's kernels there failed the VL hybrid's states by 27%."""
    from convert.backends import coreai

    torch.manual_seed(0)
    core = Products().half().eval()
    for p in core.parameters():
        p.requires_grad_(False)
    spec = FunctionSpec("f", (TensorSpec("x", (8, 256), "float16"), TensorSpec("q", (4, 8, 128), "float16")),
                        (TensorSpec("linear", (8, 64), "float16"), TensorSpec("scores", (4, 8, 8), "float16")))
    coreai.package({"f": (FunctionModule(core, spec, {}), spec)}, tmp_path / "p.aimodel")
    x, q = (torch.randn(8, 256) * 3).half(), (torch.randn(4, 8, 128) * 2).half()
    with coreai.open_session(tmp_path / "p.aimodel") as session:
        got = session.call("f", {"x": x.numpy(), "q": q.numpy()})
    with torch.no_grad():
        plain = core(x, q)
        with checks.like_the_runtime():
            checked = core(x, q)
        with true_fp16():
            emulated = core(x, q)
    rounds = checks.runtime_rounds_partial_sums()
    for name in ("linear", "scores"):
        assert np.array_equal(got[name], checked[name].numpy()), name
        if rounds:
            assert np.array_equal(got[name], emulated[name].numpy()), name
            assert not np.array_equal(got[name], plain[name].numpy()), name  # torch's fp32 accumulator differs


def _aligned_attention(directory: Path, gain: float) -> None:
    """Every query head the same projection as its key head and large q/k norm gains: a token's score with itself
    is head_dim x gain^2 before the 1/sqrt(head_dim) scale."""
    tensors = load_file(str(directory / "model.safetensors"))
    for key in list(tensors):
        if key.endswith("q_norm.weight") or key.endswith("k_norm.weight"):
            tensors[key] = torch.full_like(tensors[key], gain)
        if key.endswith("k_proj.weight"):
            q = tensors[key.replace("k_proj", "q_proj")]
            kv_rows = tensors[key].shape[0]
            tensors[key.replace("k_proj", "q_proj")] = tensors[key].repeat(q.shape[0] // kv_rows, 1)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_attention_scores_stay_finite_in_fp16(tmp_path):
    # head_dim 64, gain 40: a token's unscaled score with itself is 64 x 40^2 = 102400, past fp16's 65504
    write_checkpoint(tmp_path / "ckpt", num_key_value_heads=4, head_dim=64)
    _aligned_attention(tmp_path / "ckpt", 40.0)
    args = Qwen3Args.from_config(read_json(tmp_path / "ckpt" / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=64)
    tensors = load_tensors(tmp_path / "ckpt")
    fp32, fp16 = (build_modules(args, target, tensors, dtype) for dtype in (torch.float32, torch.float16))
    tokens = torch.randint(4, args.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    want = fp32.call("prefill", tokens, list(range(16)))["logits"]
    with true_fp16():
        got = fp16.call("prefill", tokens, list(range(16)))["logits"].float()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() / want.abs().max() < 0.02


def _computing(modules, arithmetic, returned: tuple[str, ...] | None = None):
    """Functions over ``modules`` whose calls compute under ``arithmetic()`` (``true_fp16``: the Core AI runtime's
    arithmetic; ``device_arithmetic(device)``: a device's), standing in for the package in the check's comparisons;
    ``returned``: the outputs a package returns (its functions' outputs and these), default every one."""
    functions = ModuleFunctions(modules)

    class Computing:
        def reset(self):
            functions.reset()

        def states(self):
            return functions.states()

        def call(self, name, inputs):
            with arithmetic():
                out = functions.call(name, inputs)
            if returned is None:
                return out
            kept = {o.name for o in modules.functions[name][1].outputs} | set(returned)
            return {k: v for k, v in out.items() if k in kept}

    return Computing()


TARGET = """\
name: t
target:
  source: path:{source}
  graphs: {{prefill: 16, decode: 1, verify: 8}}
  context: 128
  gate: {{data: {{samples: 2, length: 64}}, greedy_tokens: 8}}
{extra}
backends: [coreai]
"""


def _plan(tmp: Path, source: Path, extra: str = ""):
    recipe = tmp / "recipe.yaml"
    recipe.write_text(TARGET.format(source=source, extra=extra))
    return make_plan(recipe, str(tmp / "out"))


# measured (docs/fp16.md, ``python -m bench.hybrid_fp16``): the seeded VL hybrid is over the check's 2% against fp32
# whatever the device or the form: its fp32 modules with nothing but each projection's input stored in fp16 (the
# ``floor`` mode, eight realisations of that rounding) are 0.97-8.50% off their own fp32 outputs, over 2% in 5 of 8;
# the trained hybrid fixture's floor is 0.05-0.11%
VL_FLOOR = ("the seeded VL hybrid's fp32 function moves by more than the check's 2% when only its projections' inputs "
            "are stored in fp16 (0.97-8.50% over 8 realisations, median 3.40%; stateful layout): no graph form can "
            "hold it within 2% of fp32 on an fp16 device, and the device's arithmetic lands inside that spread "
            "({})")
VL_GPU_GAP = pytest.mark.xfail(strict=True, raises=PackageError, reason=VL_FLOOR.format("GPU mode, stateful: 2.16%"))
VL_ANE_GAP = pytest.mark.xfail(strict=True, raises=PackageError, reason=VL_FLOOR.format(
    "ANE mode, ane layout: 6.46%; its floor there 1.10-5.89%, median 3.47%"))


@pytest.mark.parametrize(("kind", "layout"), [
    ("dense", "stateful"), ("dense", "ane"), ("hybrid", "stateful"), ("trained-hybrid", "ane"),
    ("hybrid", "ane"), pytest.param("hybrid-conditional", "stateful", marks=VL_GPU_GAP),
    pytest.param("hybrid-conditional", "ane", marks=VL_ANE_GAP)])
def test_targets_in_the_devices_arithmetic_are_within_the_checks_bounds(tmp_path, kind, layout):
    """The package check's run (prefill, decodes, a rollback or partial accept) with the fp16 modules computing as the
    device of their layout computes (``ane``: the Neural Engine's; ``stateful``: the GPU's) in place of the runtime,
    against the fp32 modules: ids equal but for near ties, logits and states within the check's fp16 bounds. (The
    hybrids in true fp16, the runtime's CPU arithmetic, are over them: docs/fp16.md.)"""
    if kind == "dense":
        write_checkpoint(tmp_path / "ckpt", hidden_size=128, intermediate_size=384, num_hidden_layers=4)
    elif kind != "trained-hybrid":
        write_hybrid(tmp_path / "ckpt", conditional=kind == "hybrid-conditional")
    source = ROOT / "fixtures" / "stdlib-qwen3_5" if kind == "trained-hybrid" else tmp_path / "ckpt"
    modules, _ = shipped_modules(_plan(tmp_path, source, f"  layout: {layout}\n  logits: true"))
    fp32 = compute_copy(modules, torch.float32)
    device = gates.DEVICE_OF_LAYOUT[layout]
    stats = checks.lockstep(_computing(modules, lambda: device_arithmetic(device)), ModuleFunctions(fp32),
                            modules.widths, modules.contract, modules.core.args.vocab_size)
    assert stats["argmax_compared"] >= 16
    assert stats["max_output_delta"] <= checks.FP16_OUTPUT_BOUND
    assert stats["max_state_delta"] <= checks.FP16_STATE_BOUND


@pytest.mark.parametrize("kind", ["hybrid-conditional", "trained-hybrid"])
def test_the_seeded_vl_hybrid_is_over_the_bound_at_the_floor_of_fp16_storage(tmp_path, monkeypatch, kind):
    """Why the VL xfails above are the checkpoint's and not a form's: its fp32 modules with nothing but each
    projection's input stored in fp16 (``StoredInputs``, four realisations of that rounding) are over the check's 2%
    against their own fp32 outputs in most realisations (measured: 4 of 4 here, 2.1-3.7%; 5 of 8 in docs/fp16.md),
    where the trained hybrid fixture's stay under 0.2%."""
    from convert.fp16 import StoredInputs

    if kind == "trained-hybrid":
        source = ROOT / "fixtures" / "stdlib-qwen3_5"
    else:
        source = tmp_path / "ckpt"
        write_hybrid(source, conditional=True)
    modules, _ = shipped_modules(_plan(tmp_path, source, "  logits: true"))
    bound = checks.FP16_OUTPUT_BOUND
    monkeypatch.setattr(checks, "FP16_OUTPUT_BOUND", float("inf"))
    monkeypatch.setattr(checks, "FP16_STATE_BOUND", float("inf"))
    reference = compute_copy(modules, torch.float32)
    deltas = []
    for dither in range(4):
        stored = compute_copy(modules, torch.float32)
        stats = checks.lockstep(_computing(stored, lambda d=dither: StoredInputs(d)), ModuleFunctions(reference),
                                modules.widths, modules.contract, modules.core.args.vocab_size)
        deltas.append(stats["max_output_delta"])
    if kind == "trained-hybrid":
        assert max(deltas) < 0.002, deltas
    else:
        assert sum(d > bound for d in deltas) >= 3 and max(deltas) < 0.1, deltas


def test_a_dense_target_in_true_fp16_is_within_the_checks_bounds(tmp_path):
    """The same run with the dense target's fp16 modules in true fp16 (the runtime's CPU arithmetic)."""
    write_checkpoint(tmp_path / "ckpt", hidden_size=128, intermediate_size=384, num_hidden_layers=4)
    modules, _ = shipped_modules(_plan(tmp_path, tmp_path / "ckpt", "  logits: true"))
    stats = checks.lockstep(_computing(modules, true_fp16), ModuleFunctions(compute_copy(modules, torch.float32)),
                            modules.widths, modules.contract, modules.core.args.vocab_size)
    assert stats["argmax_compared"] >= 16
    assert stats["max_output_delta"] <= checks.FP16_OUTPUT_BOUND
    assert stats["max_state_delta"] <= checks.FP16_STATE_BOUND


@pytest.mark.slow
def test_the_vl_hybrids_core_ai_package_passes_its_check(tmp_path):
    """The held-back failure of #40: the vision-language hybrid's .aimodel against its fp16 modules on this CPU's
    runtime. On an AMD EPYC without AVX512-FP16 the runtime rounds every partial sum; a torch side in torch's own
    kernels there failed the check (value_cache 0.268, key_cache 0.192 on this recipe; 0.179 through the CLI at
    prefill 64); computing as the runtime does, the two agree within 0.6% (docs/fp16.md)."""
    from convert.backends import coreai

    write_hybrid(tmp_path / "ckpt", conditional=True)
    modules, _ = shipped_modules(_plan(tmp_path, tmp_path / "ckpt"))
    coreai.package(modules.functions, tmp_path / "t.aimodel")
    check = checks.check_package("coreai", tmp_path / "t.aimodel", modules)
    assert check["argmax_compared"] >= 16
    assert check["max_state_delta"] <= checks.FP16_STATE_BOUND


@pytest.mark.heavy  # about 100 s on 2 cores: `make test-heavy`
def test_the_vl_hybrid_builds_in_both_formats_on_its_default_bars(tmp_path):
    """The held-back failure of #40 end to end: the seeded vision-language hybrid built by ``spec-convert build`` with
    the default bars (2 windows of 256). Its device pass flipped 3 of 256 top-1 ids, each to an id the fp32
    reference scores within 0.08 of its best (measured: gaps 0.0027, 0.0765, 0.0001), which stopped the build at the
    bar of 0.99 before any package was checked; beyond near ties its top-1 is 1.0. Both packages then pass their
    checks: the Core AI runtime against the modules, the Core ML program's weights bit for bit."""
    from click.testing import CliRunner

    from convert.cli import main
    from tests.helpers.recipes import gate, recipe

    write_hybrid(tmp_path / "ckpt", conditional=True)
    target = {"source": f"path:{tmp_path / 'ckpt'}", "graphs": {"prefill": 64, "decode": 1, "verify": 8},
              "context": 512, "gate": gate(2, 256)}
    path = recipe(tmp_path, "vl", target=target, backends=["coreai", "coreml"])
    result = CliRunner().invoke(main, ["build", str(path), "-o", str(tmp_path / "bundle")])
    assert result.exit_code == 0, result.output
    m = read_json(tmp_path / "bundle" / "manifest.json")
    device = m["gate"]["device"]["metrics"]
    assert device["top1"] < 0.99 <= device["top1_beyond_near_ties"] and m["gate"]["device"]["passed"]
    checks_of = {p["format"]: p["check"] for p in m["packages"]}
    assert checks_of["coreai"]["argmax_compared"] >= 16
    assert checks_of["coreai"]["max_state_delta"] <= checks.FP16_STATE_BOUND
    assert checks_of["coreml"]["weights_bit_exact"] is True


DRAFTER = """\
  taps: {taps}
  hidden: {hidden}
drafter:
  kind: {kind}
  {source}
  quantization: {{method: lut4}}
  accept: {{samples: 1, length: 24, tokens: 12}}
"""


def _dflash2_plan(tmp: Path, drafter_extra: str = ""):
    """A pair plan of a 4-layer target and a DFlash2 drafter with a candidate selector, tapping layers 0, 2 and 3;
    ``drafter_extra``: more of the recipe's drafter section."""
    write_checkpoint(tmp / "ckpt", hidden_size=64, num_hidden_layers=4)
    draft = {"target_layer_ids": [0, 2, 3], "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2,
             "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    write_drafter(tmp / "drafter", config=drafter_config(vocab_size=4096, dflash_config=draft))
    source = f"source: path:{tmp / 'drafter'}\n  context_update: 16\n  ring: 64{drafter_extra}"
    return _plan(tmp, tmp / "ckpt", DRAFTER.format(taps=[0, 2, 3], hidden="false", kind="dflash2", source=source))


@pytest.mark.parametrize("kind", ["dflash2", "mtp"])
def test_drafters_in_true_fp16_are_within_the_checks_bounds(tmp_path, kind):
    """A drafter's package-check replay with its fp16 modules computing in true fp16 in place of the runtime, against
    the calls of the fp32 modules: ids equal but for near ties (the top-2 and top-k edge gaps), floats within the
    check's bound."""
    if kind == "dflash2":
        plan = _dflash2_plan(tmp_path)
    else:
        write_target_with_head(tmp_path / "ckpt")
        plan = _plan(tmp_path, tmp_path / "ckpt", DRAFTER.format(taps=[], hidden="true", kind=kind, source=""))
    target, _ = shipped_modules(plan)
    target32 = compute_copy(target, torch.float32)
    modules, _, _ = drafter_build.shipped_drafter(plan, target, target32)
    prompt = drafter_build.held_out_prompts(plan)[0][0][:drafter_build.CHECK_PROMPT_TOKENS]
    calls = drafter_calibration.recorded_calls(kind, target32, compute_copy(modules, torch.float32), prompt,
                                   drafter_build.CHECK_GENERATED, drafter.anchor_table(target32))
    stats = checks.replay_coreai(_computing(modules, true_fp16, returned=("logits",)), calls)
    assert stats["ids_compared"] >= 20
    assert stats["max_output_delta"] <= checks.FP16_OUTPUT_BOUND
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("layout", ["ane", "stateful"])
def test_the_drafter_checks_calls_are_the_packaged_modules_own(tmp_path, monkeypatch, layout):
    """The calls a DFlash2 drafter's package check replays (``drafter_build.packaged_calls``) are its modules' outputs
    as packaged, in this CPU's runtime arithmetic, bit for bit: replayed on those modules, no output moves. Its
    modules before packaging (each quantized linear a ``CodesLinear``) compute the ane layout's 1x1 convolutions as
    row products, which the runtime's true fp16 rounds at every partial sum: they miss the recorded outputs there
    (here by 0.03, at the 27B drafter's width its selector projection by 0.41: both past the check's 0.02), and
    match them in the stateful layout, where the package multiplies rows too."""
    plan = _dflash2_plan(tmp_path, f"\n  layout: {layout}")
    target, _ = shipped_modules(plan)
    target32 = compute_copy(target, torch.float32)
    modules, _, _ = drafter_build.shipped_drafter(plan, target, target32)
    unpackaged, _, _ = drafter_build.shipped_drafter(plan, target, target32)
    calls = drafter_build.packaged_calls(plan, target, modules, drafter_build.held_out_prompts(plan))
    assert sum(function == "draft" for function, *_ in calls) >= drafter_build.CHECK_GENERATED // 2
    assert checks.replay_coreai(_computing(modules, checks.like_the_runtime), calls)["max_output_delta"] == 0.0
    monkeypatch.setattr(checks, "FP16_OUTPUT_BOUND", float("inf"))  # the distance itself, not the check's verdict
    before = checks.replay_coreai(_computing(unpackaged, checks.like_the_runtime), calls)["max_output_delta"]
    assert (before > 0.0) if layout == "ane" else (before == 0.0)
    shutil.rmtree(tmp_path)


def test_the_drafters_range_watches_its_own_calls_alone(tmp_path, monkeypatch):
    """``drafter.range_scale`` notes the drafter's calls alone (the target's every op watched too kept an H100 busy
    4.9 s a round on the 27B pair): its record is the same as with the whole speculative run watched, from fewer
    notes."""
    from convert.fp16 import Peaks
    from convert.runtime import speculative

    plan = _dflash2_plan(tmp_path, "\n  layout: ane")
    target, _ = shipped_modules(plan)
    target32 = compute_copy(target, torch.float32)
    modules = drafter.build_modules(plan.drafter, plan.recipe, target, torch.float16)
    prompt = drafter_build.held_out_prompts(plan)[0][0]
    notes = {"count": 0}
    note = Peaks.note

    def counted(self, kind, value, where=None):
        notes["count"] += isinstance(value, torch.Tensor)
        return note(self, kind, value, where)

    monkeypatch.setattr(Peaks, "note", counted)
    own, record = drafter.range_scale(plan, target, target32, modules, prompt, 32)
    alone = notes["count"]
    notes["count"] = 0
    whole = speculative.speculate

    def watched(target_driver, drafter_driver, *args):  # the whole run in one watch, as before
        peaks = drafter_driver.functions.peaks
        drafter_driver.functions = drafter_driver.functions.functions
        with device_arithmetic(None, peaks):
            return whole(target_driver, drafter_driver, *args)

    monkeypatch.setattr(speculative, "speculate", watched)
    assert drafter.range_scale(plan, target, target32, modules, prompt, 32) == (own, record)
    assert 0 < alone < notes["count"], (alone, notes["count"])  # 4,091 of 6,533 here: the target has 4 layers
