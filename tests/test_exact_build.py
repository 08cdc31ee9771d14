"""``target.quantization.method: exact`` end to end on a tiny Ternary Bonsai 2 pack (tests/helpers/prism_packs.py writes
it from the published layout, with its unfolded Hugging Face checkpoint): both formats ship the pack's own 2-bit codes
and scales with the Hadamard rotation in the graph; the gate against stock transformers on the unfolded weights is at
fp32 rounding level; ``generate`` gives transformers' greedy ids on the torch modules and the Core AI runtime; a
pack whose dense tensors are fp32 ships its norms and decay gate in fp32 and passes its gate; a malformed pack exits 2
with one line naming the tensor and leaves no bundle."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from convert.backends import coreai, coreml, mlir_bytecode
from convert.cli import main
from convert.export.hadamard import SignedHadamard, as_products
from convert.verify import gates
from tests.helpers.prism_packs import edit_json, edit_tensors, write_pack
from tests.helpers.recipes import gate, tiny_dflash2, tiny_target
from tests.helpers.recipes import recipe as write_recipe

NEW_TOKENS = 8
MIN_GAP = 0.1  # the prompt's greedy steps have no near tie: the two best logits at least this far apart
RECIPE = """name: tiny-bonsai
target:
  source: path:pack
  graphs: {prefill: 16, decode: 1, verify: 8}
  context: 128
  quantization: {method: exact}
  gate:
    data: {samples: 4, length: 64}
    greedy_tokens: 4
backends: [coreai, coreml]
"""


def _written(tmp_path_factory, name: str, dense_dtype: torch.dtype, recipe: str) -> Path:
    """A folder holding the seed-3 pack (its dense tensors in ``dense_dtype``), its unfolded twin and ``recipe``."""
    root = tmp_path_factory.mktemp(name)
    write_pack(root / "pack", root / "unfolded", seed=3, dense_dtype=dense_dtype)
    (root / "tiny-bonsai.yaml").write_text(recipe)
    return root


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    return _written(tmp_path_factory, "bonsai", torch.bfloat16, RECIPE)


@pytest.fixture(scope="module")
def bundle(written) -> Path:
    out = written / "bundle"
    result = CliRunner().invoke(main, ["build", str(written / "tiny-bonsai.yaml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_the_bundle_ships_the_packs_codes_at_under_a_fifth_of_fp16(bundle):
    m = _manifest(bundle)
    quant = m["quantization"]
    assert (quant["method"], quant["bits"], quant["group_size"]) == ("exact", 2, 128)
    assert {layer["method"] for layer in quant["layers"]} == {"exact2"} and len(quant["layers"]) == 15
    assert quant["kept_fp16"] == ["layers.0.linear_attn.in_proj_a", "layers.0.linear_attn.in_proj_b"]
    fp16_bytes = 2 * m["weights"]["parameter_count"]
    stored = {"coreai": coreai.stored_weight_bytes(bundle / "tiny-bonsai.aimodel"),
              "coreml": coreml.stored_weight_bytes(bundle / "tiny-bonsai.mlpackage")}
    assert all(size <= 0.2 * fp16_bytes for size in stored.values()), (stored, fp16_bytes)
    checks = {p["format"]: p["check"] for p in m["packages"]}
    assert checks["coreml"]["weights_bit_exact"] is True
    assert checks["coreai"]["max_output_delta"] <= 0.02 and checks["coreai"]["argmax_compared"] > 0


def test_the_gate_against_the_unfolded_transformers_model_is_at_rounding_level(bundle):
    metrics = _manifest(bundle)["gate"]["metrics"]
    assert metrics["kl_mean"] < 1e-5
    assert metrics["top1"] == 1.0


def _prompt() -> str:
    """A held-out text whose greedy continuation on the random tiny pack has no near tie (found by scanning the
    eval split; ``MIN_GAP`` is asserted): most prompts have a step whose two best logits are under 0.05 apart, where
    fp16 and fp32 may rightly pick different ids."""
    from fixtures.corpus import read_split

    return read_split("eval")[14].text[:120]


def _transformers_greedy(unfolded: Path) -> tuple[list[int], list[float]]:
    """transformers' greedy ids after the prompt and, at each step, the gap between its two largest logits."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(unfolded))
    model = gates.load_reference(unfolded)
    ids = tokenizer.encode(_prompt())
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.logits]
    return out.sequences[0, len(ids) :].tolist(), gaps


@pytest.mark.parametrize("runtime", ["torch", "coreai"])
def test_generate_gives_the_transformers_greedy_ids(bundle, written, runtime):
    """The bundle computes in fp16 and transformers in fp32, on a prompt without near ties: the same ids."""
    args = ["generate", str(bundle), "--prompt", _prompt(), "-n", str(NEW_TOKENS), "--runtime", runtime, "--json"]
    if runtime == "torch":
        args += ["-r", str(written / "tiny-bonsai.yaml")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    ids = json.loads(result.output.strip().splitlines()[-1])["generated_ids"]
    expected, gaps = _transformers_greedy(written / "unfolded")
    assert min(gaps) >= MIN_GAP, gaps
    assert ids == expected


# A pack whose dense tensors (norms, A_log, dt_bias, conv, in_proj_a / in_proj_b) are fp32, as the published pack's
# readers expect: its gate over 16 x 64 tokens (one flip in 256 positions is 0.4%, past a 0.99 bar's reach on a random
# pack's near ties; docs/benchmarks.md "Exact packs at fp32").
FP32_RECIPE = RECIPE.replace("samples: 4", "samples: 16")
KEPT_FP32 = ("norm.weight", "A_log", "dt_bias", "conv1d.weight")  # what ships in fp32 (convert/weights/precision.py)


@pytest.fixture(scope="module")
def written_fp32(tmp_path_factory) -> Path:
    return _written(tmp_path_factory, "bonsai-fp32", torch.float32, FP32_RECIPE)


def _unfolded(written: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in (written / "unfolded").glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors


def test_an_fp32_dense_pack_ships_its_norms_and_decay_gate_in_fp32_and_passes_its_gate(written_fp32):
    """The issue #40 failure held back: the pack's fp32 dense tensors rounded to fp16 cost its gate one top-1 id in
    256 (top-1 0.9961 < 0.999, the bar then; mean KL 4.8e-7). The norms' gains, A_log, dt_bias and the conv weight,
    which the core computes with in fp32, ship as the pack stores them (bit for bit the unfolded twin's); the gate
    against the twin passes ``exact``'s bars and its fp32 candidate is at the fp32 arithmetic's level, what fp16 still
    costs (in_proj_a / in_proj_b, the activations) being far smaller than the conv's was (mean KL 4.5e-7 with the conv
    in fp16, 3.6e-9 with it in fp32; top-1 0.9961 and 1.0); and the shipped modules, computing in fp16 on torch,
    give the twin's greedy ids."""
    from transformers import AutoTokenizer

    from convert.pipeline.build import shipped_modules
    from convert.pipeline.plan import make_plan
    from convert.runtime.host import module_driver
    from convert.weights import precision

    plan = make_plan(written_fp32 / "tiny-bonsai.yaml", cache_root=written_fp32 / "cache")
    modules, _ = shipped_modules(plan)
    twin = _unfolded(written_fp32)
    kept = precision.kept(modules.core)
    assert len(kept) == 11 and all(name.endswith(KEPT_FP32) for name in kept)
    assert "layers.0.linear_attn.conv1d.weight" in kept  # the one Gated DeltaNet layer's
    for name, param in modules.core.named_parameters():
        key = "model.language_model." + name
        if name in kept:
            assert param.dtype == torch.float32 and torch.equal(param, twin[key]), name
            assert not torch.equal(param.half().float(), twin[key]), name  # fp16 would have lost them
    report = gates.gate_target(plan, modules)
    metrics = {m.name: m.value for m in report.metrics}
    assert report.passed, report.failures()
    assert metrics["kl_mean"] < 1e-7 and metrics["top1"] == 1.0  # the conv in fp16: 4.5e-7 and 0.9961

    tokenizer = AutoTokenizer.from_pretrained(str(written_fp32 / "unfolded"))
    expected, gaps = _transformers_greedy(written_fp32 / "unfolded")
    assert min(gaps) >= MIN_GAP, gaps
    ids, _ = module_driver(modules).greedy(tokenizer.encode(_prompt()), NEW_TOKENS)
    assert ids == expected


@pytest.mark.heavy
def test_an_fp32_dense_packs_bundle_holds_its_fp32_constants_in_core_ai_and_runs_its_twins_ids(written_fp32):
    """The same pack built as ``spec-convert build`` does, both formats: the gate passes, both packages pass their
    checks; read back, the Core AI program holds the kept tensors as f32 constants (the norms' ``1 + w`` and the decay
    gate's ``-exp(A_log)`` folded in fp32, ``dt_bias``, the gated norm's ``w`` and the conv weight as they are), bit
    for bit the pack's; Core ML's fp16 program holds each as its fp16 rounding. On the Core AI runtime the
    bundle generates the twin's greedy ids."""
    out = written_fp32 / "bundle"
    result = CliRunner().invoke(main, ["build", str(written_fp32 / "tiny-bonsai.yaml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    m = _manifest(out)
    assert m["gate"]["passed"] and m["gate"]["thresholds"]["top1_min"] == 0.99
    assert {p["format"] for p in m["packages"]} == {"coreai", "coreml"}
    twin = {k.removeprefix("model.language_model."): v for k, v in _unfolded(written_fp32).items()
            if k.startswith("model.language_model.") and (v.dim() == 1 or "conv1d" in k)}
    folded = {name: (1.0 + t if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name ==
                     "norm.weight" else -torch.exp(t) if name.endswith("A_log") else t) for name, t in twin.items()}
    ai = _coreai_constants(out / "tiny-bonsai.aimodel")
    ml = [np.asarray(v) for v in coreml.function_constants(out / "tiny-bonsai.mlpackage", "decode").values()]
    for name, value in folded.items():
        want = value.reshape(-1).numpy().astype(np.float32)
        for function, constants in ai.items():
            found = [c for c in constants if c.size == want.size and np.array_equal(c.reshape(-1), want)]
            assert found and all(c.dtype == np.float32 for c in found), (name, function)
        assert any(c.dtype == np.float16 and c.size == want.size and np.array_equal(c.reshape(-1), want.astype(
            np.float16)) for c in ml), name
    args = ["generate", str(out), "--prompt", _prompt(), "-n", str(NEW_TOKENS), "--runtime", "coreai", "--json"]
    generated = CliRunner().invoke(main, args)
    assert generated.exit_code == 0, generated.output
    expected, _ = _transformers_greedy(written_fp32 / "unfolded")
    assert json.loads(generated.output.strip().splitlines()[-1])["generated_ids"] == expected


def _coreai_constants(path: Path) -> dict[str, list[np.ndarray]]:
    """Every float constant of each function of a Core AI program, read back from main.mlirb."""
    from convert.errors import PackageError

    module = coreai._mlir_module(coreai.AIModelAsset.load(path).program)
    blobs = mlir_bytecode.resource_blobs((path / "main.mlirb").read_bytes())
    found, decoded = {}, {}
    with module.context:
        for graph in module.body.operations:
            if graph.name != "coreai.graph":
                continue
            function = coreai.ir.StringAttr(graph.attributes["sym_name"]).value
            for op in graph.regions[0].blocks[0].operations:
                if op.name != "coreai.constant":
                    continue
                try:
                    value = coreai._constant(function, op.result, blobs, decoded)
                except PackageError:  # a constant of a type no weight has
                    continue
                if value.dtype in (np.float16, np.float32):
                    found.setdefault(function, []).append(value)
    return found


def _drop_signs(tensors):
    del tensors["language_model.model.layers.0.mlp.down_proj.signs"]


def _drop_matrix(tensors):
    for part in ("weight", "scales", "biases", "signs"):
        del tensors[f"language_model.model.layers.1.self_attn.o_proj.{part}"]


def _block_not_dividing(config):
    for record in config["modules"]:
        record["block"] = 256  # the tiny widths are 128 and 256: 256 does not divide 128


@pytest.mark.parametrize("break_pack, named", [
    (lambda pack: edit_tensors(pack, _drop_signs), "language_model.model.layers.0.mlp.down_proj.signs"),
    (lambda pack: edit_tensors(pack, _drop_matrix), "language_model.model.layers.1.self_attn.o_proj.weight"),
    (lambda pack: edit_json(pack / "config.json", _block_not_dividing), "block 256, which does not divide"),
    (lambda pack: (pack / "model.safetensors").rename(pack / "Ternary-Bonsai-2-27B-PQ2_0.gguf"),
     "GGUF packs are not read"),
], ids=["missing signs", "module list names a missing matrix", "block does not divide", "GGUF"])
def test_a_malformed_pack_exits_2_naming_the_tensor_and_leaves_no_bundle(written, tmp_path, break_pack, named):
    import shutil

    shutil.copytree(written / "pack", tmp_path / "pack")
    (tmp_path / "tiny-bonsai.yaml").write_text(RECIPE)
    if named.startswith("GGUF"):
        (tmp_path / "pack" / "config.json").unlink()
    break_pack(tmp_path / "pack")
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["build", str(tmp_path / "tiny-bonsai.yaml"), "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in result.output, result.output
    assert not out.exists() and not list(tmp_path.glob(".bundle*"))


def test_a_contract_pins_the_packs_rotation(written, tmp_path):
    """target.contract is checked against config.json and hadamard.json: a pack of another block is refused."""
    recipe = RECIPE.replace("source: path:pack", f"source: path:{written / 'pack'}").replace(
        "  quantization: {method: exact}\n",
        "  quantization: {method: exact}\n  contract: {schema_version: 2, prism.hadamard.block_size: 1024}\n")
    (tmp_path / "r.yaml").write_text(recipe)
    result = CliRunner().invoke(main, ["build", str(tmp_path / "r.yaml"), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "target.contract.prism.hadamard.block_size: the recipe pins 1024; config.json has 64" in result.output


def test_a_gated_deltanet_part_on_the_core_ai_runtime_computes_what_its_torch_part_does(written, tmp_path):
    """The rotation inside a layer, in fp16 on the runtime: the tiny pack built as parts, its Gated DeltaNet layer
    part's rows replayed on the Core AI runtime stay within the package check's bound (they were 3.7% off with the
    Kronecker form of the transform, convert/export/hadamard.py)."""
    from convert.pipeline.build import exact_result
    from convert.pipeline.packaging import package_formats
    from convert.pipeline.plan import make_plan
    from convert.verify.checks import recorded_calls
    from convert.weights.shipped import PartLoader

    recipe = RECIPE.replace("source: path:pack", f"source: path:{written / 'pack'}").replace(
        "  context: 128\n", "  context: 128\n  max_part_mb: 0.06\n")
    (tmp_path / "r.yaml").write_text(recipe)
    plan = make_plan(tmp_path / "r.yaml")
    assert [p.name for p in plan.parts] == ["embed", "layers-0-0", "layers-1-1", "head"]
    loader = PartLoader(plan, exact_result(plan))
    pieces = loader.load(plan.parts)
    calls = recorded_calls(plan.parts, pieces, [], loader.outline.contract, plan.args.vocab_size, False)
    (done,) = package_formats(["coreai"], pieces[1], tmp_path, "layers-0-0", calls[1], every_function=True)
    assert done.check["runtime_calls"] > 0 and done.check["max_output_delta"] < 0.02


def test_a_parted_build_gates_and_loads_the_same_from_the_packs_view(written, tmp_path, monkeypatch):
    """The streamed unfolding: the same parted build planned with the unfolded checkpoint written, and with only its
    view (as a pack over ``target.max_host_memory_gb`` is planned): the streamed gate's metrics are equal (and with
    its pieces views of the whole target held as its codes, ``HeldTarget``, as a GPU holds it), and every part loads
    the same tensors, bit for bit."""
    from convert.inputs import prism
    from convert.pipeline import plan as planning
    from convert.pipeline.build import exact_result
    from convert.weights.shipped import HeldTarget, PartLoader

    recipe = RECIPE.replace("source: path:pack", f"source: path:{written / 'pack'}").replace(
        "  context: 128\n", "  context: 128\n  max_part_mb: 0.06\n")
    (tmp_path / "r.yaml").write_text(recipe)
    stored = planning.make_plan(tmp_path / "r.yaml", cache_root=tmp_path / "cache")
    def over_the_limit(snapshot, quant, where, max_bytes, cache_root):
        return prism.unfolded_snapshot(snapshot, quant, where, 0.0, cache_root)

    monkeypatch.setattr(planning, "unfolded_snapshot", over_the_limit)
    viewed = planning.make_plan(tmp_path / "r.yaml", cache_root=tmp_path / "cache")
    assert (viewed.snapshot.directory / prism.VIEW_FILE).is_file()
    assert not (stored.snapshot.directory / prism.VIEW_FILE).exists()
    reports = [gates.gate_streamed(p, PartLoader(p, exact_result(p))) for p in (stored, viewed)]
    assert reports[0].metrics == reports[1].metrics and reports[1].passed
    held = HeldTarget(PartLoader(viewed, exact_result(viewed)), torch.device("cpu"))
    assert gates.gate_streamed(viewed, held).metrics == reports[0].metrics
    # as on an accelerator: one host, the weights dequantized once, the Hadamard rotations as products (fp32's
    # rounding of another order of sums: the same verdicts, each metric within 1e-4 of the in-step one's)
    monkeypatch.setattr(gates, "_in_step", lambda _device: False)
    rotations = []
    monkeypatch.setattr(gates, "as_products", lambda core: rotations.append(core) or as_products(core))
    products = gates.gate_streamed(viewed, HeldTarget(PartLoader(viewed, exact_result(viewed)), torch.device("cpu")))
    assert products.passed and rotations
    turned = [m for core in rotations for m in core.modules() if isinstance(m, SignedHadamard)]
    assert turned and all(m.form == "matmul" for m in turned)
    for got, want in zip(products.metrics, reports[0].metrics, strict=True):
        assert got.name == want.name and got.passed == want.passed
        assert abs(got.value - want.value) <= 1e-4 * max(1.0, abs(want.value)), (got, want)
    for a, b in zip(*(PartLoader(p, exact_result(p)).load(p.parts) for p in (stored, viewed)), strict=True):
        state_a, state_b = a.core.state_dict(), b.core.state_dict()
        assert state_a.keys() == state_b.keys()
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_a_drafter_reads_the_rotated_tables_embedding_rows_not_its_stored_rows(written, tmp_path):
    """An exact pack stores its embedding in the rotated basis (``W'``) and its lookups rotate each row: the anchor
    rows a DFlash2 drafter is fed and ``embeddings.safetensors`` are the rows the target's lookups return (in fp32
    and fp16 alike), the unfolded checkpoint's table (``S H W'``) to fp16 rounding, and not the stored ones."""
    from safetensors.torch import load_file

    from convert.export.functions import compute_copy
    from convert.pipeline.build import shipped_modules
    from convert.pipeline.drafter import anchor_table
    from convert.pipeline.plan import make_plan
    from convert.pipeline.record import write_drafter_interface as _write_drafter_interface

    (tmp_path / "r.yaml").write_text(RECIPE.replace("source: path:pack", f"source: path:{written / 'pack'}"))
    plan = make_plan(tmp_path / "r.yaml", cache_root=tmp_path / "cache")
    modules, _ = shipped_modules(plan)
    table = anchor_table(modules)  # computed a row at a time when read: no second table in memory
    rows = torch.from_numpy(np.asarray(table))
    assert all(np.array_equal(table[i], rows[i].numpy()) for i in (0, 3, 17, rows.shape[0] - 1))
    unfolded = {}
    for path in (written / "unfolded").glob("*.safetensors"):
        unfolded.update(load_file(path))
    logical = unfolded["model.language_model.embed_tokens.weight"]
    assert rows.dtype == torch.float16 and rows.shape == logical.shape
    torch.testing.assert_close(rows.float(), logical, rtol=2**-10, atol=2**-24)  # an fp16 rounding of W = S H W'
    stored = modules.core.embed_tokens.weight
    assert float((stored.float() - logical).abs().max()) > 100 * float((rows.float() - logical).abs().max())
    ids = torch.tensor([[3, 17, 250]])
    computed = compute_copy(modules, torch.float32).core.embed_tokens(ids)[0]  # how the gates and acceptance look up
    assert torch.equal(rows[ids[0]], computed.to(torch.float16))
    # the fp16 graph's lookups too: the rotation an fp32 island rounded once, as mlx-vlm's lookup (with the butterflies
    # in fp16, 39% of a table's values differed from these rows)
    assert torch.equal(rows[ids[0]], modules.core.embed_tokens(ids)[0])
    _write_drafter_interface(plan, modules, tmp_path)
    assert torch.equal(load_file(tmp_path / "embeddings.safetensors")["weight"], rows)


def pair_recipe(path: Path, pack: Path, drafter: Path, **target_fields) -> Path:
    """The Bonsai release pair's shape at a tiny size: the exact pack's target, a DFlash2 drafter quantized
    lut4-gptq, both formats."""
    target = tiny_target(pack, taps=[0, 1], quantization={"method": "exact"}, gate=gate(4, 64, greedy_tokens=4),
                         **target_fields)
    calibrated = {"method": "lut4-gptq", "calibration": {"samples": 2, "length": 24, "tokens": 16}}
    return write_recipe(path, "tiny-bonsai-pair", target=target, backends=["coreai", "coreml"],
                        drafter=tiny_dflash2(drafter, mask_scale=0.7, quantization=calibrated))


def tiny_pair(written: Path, tmp_path: Path, **target_fields) -> Path:
    """``pair_recipe`` over the tiny pack at ``tmp_path / "pair.yaml"``, with its tiny DFlash2 drafter (tapping layers
    0 and 1, a selector) written at ``tmp_path / "drafter"``."""
    from tests.helpers.dflash2_checkpoints import tiny_config, write_drafter

    draft = {"target_layer_ids": [0, 1], "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2,
             "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    write_drafter(tmp_path / "drafter", config=tiny_config(hidden_size=128, vocab_size=320, dflash_config=draft))
    return pair_recipe(tmp_path / "pair.yaml", written / "pack", tmp_path / "drafter", **target_fields)


@pytest.mark.heavy  # minutes on 2 cores: `make test-heavy` (the suite's 15-minute budget, docs/development.md)
def test_the_release_pairs_shape_builds_on_a_tiny_pack(written, tmp_path, monkeypatch):
    """The Bonsai release recipe's shape at a tiny size: an exact pack's target in parts with a DFlash2 drafter
    quantized lut4-gptq, both formats. The build exits 0 (the lossless acceptance and the pair check inside it; the
    drafter stage on the target's packed codes, its package borrowing the head from them), ``check-pair`` passes, and
    the drafter binds to the target's embedding rows as its lookups return them (the rotated table's)."""
    from safetensors.torch import load_file

    from convert.pipeline import build, drafter_build
    from convert.pipeline.drafter_build import build_drafter, package_formats
    from manifests import identity

    recipe = tiny_pair(written, tmp_path, max_part_mb=0.06)
    # a tiny pack's packages are mostly their fixed overhead (0.2 MB each), over any limit that parts its 118 KB of
    # weights: the size check is not what this test is about
    monkeypatch.setattr(build, "_check_part_size", lambda entry, max_part_mb: None)
    # the drafter is quantized (GPTQ) and packaged with the target's decoder layers let go: record how many it held
    targets, layers_when_quantized, layers_when_packaged = [], [], []
    quantize = drafter_build.drafter_calibration.quantize

    def spy_build_drafter(plan, target, *args, **kwargs):
        targets.append(target)
        return build_drafter(plan, target, *args, **kwargs)

    def spy_quantize(*args, **kwargs):
        layers_when_quantized.append(len(targets[0].core.layers))
        return quantize(*args, **kwargs)

    def spy_package_formats(*args, **kwargs):
        layers_when_packaged.append(len(targets[0].core.layers))
        return package_formats(*args, **kwargs)

    monkeypatch.setattr(build, "build_drafter", spy_build_drafter)
    monkeypatch.setattr(drafter_build.drafter_calibration, "quantize", spy_quantize)
    monkeypatch.setattr(drafter_build, "package_formats", spy_package_formats)
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["build", str(recipe), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert layers_when_quantized == [0] and layers_when_packaged == [0]
    check = CliRunner().invoke(main, ["check-pair", str(out / "drafter"), str(out / "target")])
    assert check.exit_code == 0, check.output
    drafter_manifest = json.loads((out / "drafter" / "manifest.json").read_text())
    assert drafter_manifest["acceptance"]["lossless"] is True
    assert drafter_manifest["quantization"]["method"] == "lut4-gptq"
    assert len(json.loads((out / "target" / "manifest.json").read_text())["parts"]) > 1
    rows = load_file(out / "target" / "embeddings.safetensors")["weight"]
    unfolded = {}
    for path in (written / "unfolded").glob("*.safetensors"):
        unfolded.update(load_file(path))
    torch.testing.assert_close(rows[3].float(), unfolded["model.language_model.embed_tokens.weight"][3],
                               rtol=2**-10, atol=2**-24)
    assert drafter_manifest["target"]["mask_row_sha256"] == identity.embedding_row_sha256(
        out / "target" / "embeddings.safetensors", 3)


@pytest.mark.heavy  # minutes on 2 cores: `make test-heavy` (the suite's 15-minute budget, docs/development.md)
def test_the_target_pool_beside_the_drafter_stage_gives_the_sequential_bundle(written, tmp_path, monkeypatch):
    """The release pair's shape in parts, its target's packaging pool (``--jobs 2``) run in the background while the
    drafter stage computes (``build._overlaps``: by default where that stage runs on an accelerator; here on the CPU):
    the drafter stage began before the pool was done, its packages were made one format after the other in the build
    process (no fork beside the pool's thread), and the target's manifest was made after both; the bundle, both
    manifests included, is the build one part after the other's, byte for byte but the run-to-run files."""
    import time

    from convert.pipeline import build, drafter_build
    from tests.helpers.bundle_files import comparable_manifest, files

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    recipe = tiny_pair(written, tmp_path, max_part_mb=0.06)
    monkeypatch.setattr(build, "_check_part_size", lambda entry, max_part_mb: None)
    times: dict[str, list[float]] = {"drafter stage": [], "pool done": [], "target manifest": []}
    jobs, stage_copy, finish_target = build.package_jobs, drafter_build.stage_copy, build._finish_target
    formats, side_by_side = drafter_build.package_formats, []

    def spy_formats(*args, **kwargs):
        side_by_side.append(kwargs.get("side_by_side"))
        return formats(*args, **kwargs)

    monkeypatch.setattr(drafter_build, "package_formats", spy_formats)

    def timed(name, function):
        def call(*args, **kwargs):
            value = function(*args, **kwargs)
            times[name].append(time.monotonic())
            return value
        return call

    monkeypatch.setattr(build, "package_jobs", timed("pool done", jobs))
    monkeypatch.setattr(drafter_build, "stage_copy", timed("drafter stage", stage_copy))
    monkeypatch.setattr(build, "_finish_target", timed("target manifest", finish_target))
    monkeypatch.setattr(build, "_overlaps", lambda plan: True)
    beside = CliRunner().invoke(main, ["build", str(recipe), "-o", str(tmp_path / "beside"), "--jobs", "2"])
    assert beside.exit_code == 0, beside.output
    assert len(times["pool done"]) == 1 and len(times["target manifest"]) == 1
    assert times["drafter stage"][0] < times["pool done"][0] < times["target manifest"][0]
    assert side_by_side == [False]
    monkeypatch.setattr(build, "_overlaps", lambda plan: False)
    for found in times.values():
        found.clear()
    sequential = CliRunner().invoke(main, ["build", str(recipe), "-o", str(tmp_path / "sequential"), "--jobs", "1"])
    assert sequential.exit_code == 0, sequential.output
    assert times["pool done"] == [] and times["target manifest"][0] < times["drafter stage"][0]
    assert side_by_side == [False, True]
    assert files(tmp_path / "beside") == files(tmp_path / "sequential")
    assert sum(v != "varies" for v in files(tmp_path / "beside").values()) > 20
    for half in ("target", "drafter"):
        assert comparable_manifest(tmp_path / "beside" / half) == comparable_manifest(tmp_path / "sequential" / half)


@pytest.mark.heavy  # minutes on 2 cores: `make test-heavy` (the suite's 15-minute budget, docs/development.md)
def test_a_drafter_stage_that_fails_beside_the_pool_stops_it_and_publishes_nothing(written, tmp_path, monkeypatch,
                                                                                  capfd):
    """The same pair with the pool beside the drafter stage, whose first phase refuses while the pool's jobs run:
    exit 1 naming the refusal, no bundle and no staging folder beside where it would be, no pool process left, and
    fewer jobs ended than the pool had (it was stopped, not waited for)."""
    import multiprocessing
    import re

    from convert.errors import GateError
    from convert.pipeline import build, drafter_build

    recipe = tiny_pair(written, tmp_path, max_part_mb=0.06)
    monkeypatch.setattr(build, "_check_part_size", lambda entry, max_part_mb: None)
    monkeypatch.setattr(build, "_overlaps", lambda plan: True)

    def refuse(*_args):
        raise GateError("the drafter stage refused (a test)")

    monkeypatch.setattr(drafter_build, "stage_copy", refuse)
    out = tmp_path / "out" / "bundle"
    result = CliRunner().invoke(main, ["build", str(recipe), "-o", str(out), "--jobs", "2", "--no-cache"])
    assert result.exit_code == 1, result.output
    assert "the drafter stage refused (a test)" in result.output
    assert not out.exists() and list((tmp_path / "out").iterdir()) == []
    assert multiprocessing.active_children() == []
    jobs = int(re.search(r"package (\d+) jobs \(", result.output).group(1))
    ended = capfd.readouterr().err.count("✓ package job: part ")
    assert jobs >= 4 and ended < jobs


@pytest.mark.heavy  # minutes on 2 cores: `make test-heavy` (the suite's 15-minute budget, docs/development.md)
def test_a_lean_target_gives_the_drafter_stage_the_dense_targets_results(written, tmp_path):
    """The drafter stage of a parted target runs it from its packed codes (``PartLoader.load(lean=True)``: each
    quantized linear a ``CodesLinear``): the quantized drafter, its acceptance and A/B, the bytes each call reads and
    the calls its package check replays are the dense target's, bit for bit, and the lean target holds its quantized
    weights at their shipped bits (2 a weight and the scales here), the fp32 compute copy sharing them."""
    from convert.export.functions import compute_copy
    from convert.export.quantized import CodesLinear, quantized_weights
    from convert.models.part import Part
    from convert.pipeline import drafter_build
    from convert.pipeline.build import exact_result, shipped_modules
    from convert.pipeline.plan import make_plan
    from convert.weights.shipped import PartLoader

    tiny_pair(written, tmp_path)
    plan = make_plan(tmp_path / "pair.yaml", cache_root=tmp_path / "cache")
    dense, _ = shipped_modules(plan)
    lean = PartLoader(plan, exact_result(plan)).load([Part.whole(plan.args)], lean=True)[0]
    codes = [m for m in lean.core.modules() if isinstance(m, CodesLinear)]
    assert len(codes) == 15 and {m.method for m in codes} == {"exact2"}
    assert sum(m.words.nbytes for m in codes) * 4 == sum(m.shape[0] * m.shape[1] for m in codes)
    lean32 = compute_copy(lean, torch.float32)
    shared = {m.words.data_ptr() for m in lean32.core.modules() if isinstance(m, CodesLinear)}
    assert shared == {m.words.data_ptr() for m in codes}

    results, layers_in_gptq = [], []

    def reload_layers():  # as a parted build loads the layers again after GPTQ, which ran without them
        layers_in_gptq.append(len(lean.core.layers))
        return PartLoader(plan, exact_result(plan)).load([Part.whole(plan.args)], lean=True)[0].core.layers

    for target in (dense, lean):
        target32 = compute_copy(target, torch.float32)
        modules, fp16, record = drafter_build.shipped_drafter(plan, target, target32,
                                                              reload_layers if target is lean else None)
        target32 = compute_copy(target, torch.float32)
        acceptance, ab = drafter_build.measure_held_out(plan, target, target32, modules, fp16,
                                                        drafter_build.held_out_prompts(plan))
        calls = drafter_build.packaged_calls(plan, target, modules, drafter_build.held_out_prompts(plan))
        results.append((modules, record, acceptance, ab, calls))
    assert layers_in_gptq == [0] and len(lean.core.layers) == len(dense.core.layers) == 2
    (dense_drafter, *dense_rest), (lean_drafter, *lean_rest) = results
    record, acceptance, ab, calls = lean_rest
    assert record == dense_rest[0] and ab == dense_rest[2]
    assert json.dumps(acceptance, sort_keys=True, default=str) == json.dumps(dense_rest[1], sort_keys=True, default=str)
    assert acceptance["economics"]["verify_cost"] > 0
    assert len(calls) == len(dense_rest[3]) and all(
        a[0] == b[0] and all(np.array_equal(a[2][k], b[2][k]) for k in a[2])
        for a, b in zip(calls, dense_rest[3], strict=True))
    mine, theirs = quantized_weights(lean_drafter.core), quantized_weights(dense_drafter.core)
    assert mine.keys() == theirs.keys() and "lm_head" in mine
    for name in mine:
        assert torch.equal(mine[name].codes, theirs[name].codes), name


RESIDUAL_FACTOR = 2.0**16  # the random pack's residual stream peaks near 1.4: x 65536 takes it near 1.9e5


def _residual_scaled_pack(root: Path, out: Path, factor: float) -> Path:
    """The pack of ``root`` at ``out`` with its residual stream times ``factor``, function-preserving up to the norms'
    eps: the embedding's and every residual writer's group scales (and biases, ``-scales``) times it, as ``rescaled``
    does to a dense checkpoint; the unfolded twin scaled the same way beside it (the reference of the ids)."""
    import shutil

    from tests.helpers.rescaled import RESIDUAL_WRITERS, residual_scaled

    shutil.copytree(root / "pack", out / "pack")
    writers = tuple(w.removesuffix(".weight") + ".scales" for w in RESIDUAL_WRITERS) + ("embed_tokens.scales",)

    def scale(tensors):
        for key in [k for k in tensors if k.endswith(writers)]:
            tensors[key] = (tensors[key].float() * factor).half()
            tensors[key.removesuffix(".scales") + ".biases"] = -tensors[key]

    edit_tensors(out / "pack", scale)
    residual_scaled(root / "unfolded", out / "unfolded", factor)
    return out


@pytest.mark.parametrize("rescale", [True, False])
def test_a_pack_at_real_magnitudes_ships_folded_scales_or_fails_naming_the_tensor(written_fp32, rescale):
    """Issue #40: the fp32-norm pack with its residual stream past 1e5 (``_residual_scaled_pack``). The range stage
    folds a power of two into the writers' group scales (the pack's codes untouched, each scale exact in fp16); the
    gate against the scaled pack's own unfolded view passes with its device pass in range, and the shipped modules
    in the GPU's arithmetic give the scaled twin's transformers greedy ids, which are the unscaled twin's. With
    ``target.rescale: false`` the device pass fails (``GateError``, exit 1 in the CLI) naming the tensor past fp16."""
    from convert.errors import GateError
    from convert.fp16 import device_arithmetic
    from convert.pipeline.build import shipped_modules
    from convert.pipeline.plan import make_plan
    from convert.runtime.host import module_driver
    from convert.verify import gates as gate_module

    root = written_fp32 / f"rescale-{rescale}"
    root.mkdir()
    scaled = _residual_scaled_pack(written_fp32, root / "scaled", RESIDUAL_FACTOR)
    recipe = root / "tiny-bonsai.yaml"
    recipe.write_text(FP32_RECIPE.replace("path:pack", f"path:{scaled / 'pack'}")
                      .replace("  quantization:", f"  rescale: {str(rescale).lower()}\n  quantization:"))
    plan = make_plan(recipe, cache_root=root / "cache")
    modules, quant = shipped_modules(plan)
    if not rescale:
        over = r"range \(gpu\): target\.layers\.\d+\S* \((port|output)\): peak \d+ > limit 65504"
        with pytest.raises(GateError, match=over):
            gate_module.gate_target(plan, modules).raise_if_failed()
        return
    record = modules.rescale
    assert record.residual_scale <= 2.0**-3, record  # past 1e5 / 16,376 (fp16's limit over the headroom)
    assert max(e.peak for e in record.tightest) >= 1e5, record
    # the table's rows are multiplied after the lookup: the stored table keeps the pack's magnitudes, in fp16's range
    assert all(e.scaled <= e.limit / (1 if e.tensor == "target.embed_tokens" else record.headroom)
               for e in record.tightest), record
    assert quant["method"] == "exact"
    report = gate_module.gate_target(plan, modules)
    assert report.passed, report.failures()
    expected, gaps = _transformers_greedy(scaled / "unfolded")
    assert expected == _transformers_greedy(written_fp32 / "unfolded")[0]
    tokenizer_ids = __import__("transformers").AutoTokenizer.from_pretrained(str(scaled / "unfolded")).encode(_prompt())
    with device_arithmetic("gpu"):
        ids, _ = module_driver(modules).greedy(tokenizer_ids, NEW_TOKENS)
    assert ids == expected


@pytest.mark.heavy
@pytest.mark.parametrize("parted", [False, True])
def test_a_pack_at_real_magnitudes_builds_in_both_formats_and_generates_its_twins_ids(written_fp32, tmp_path, parted,
                                                                                     monkeypatch):
    """The scaled pack built as ``spec-convert build`` does, whole and in parts (the parts read each packed matrix's
    folded scales from the same ``exact_result``): exit 0, the manifest records the fold, both packages pass their
    checks, and the Core AI program generates the unscaled twin's greedy ids. (The parted build failed its chained
    artifact check, a state 2.07-2.56% off, until that check's torch side computed as this CPU's runtime does, as
    every other package check's: the runtime rounds every partial sum; torch's kernels did not.)"""
    from convert.pipeline import build

    # a tiny pack's packages are mostly their fixed overhead, over any limit that parts it (as in the release pair's)
    monkeypatch.setattr(build, "_check_part_size", lambda entry, max_part_mb: None)
    scaled = _residual_scaled_pack(written_fp32, tmp_path / "scaled", RESIDUAL_FACTOR)
    recipe = tmp_path / "tiny-bonsai.yaml"
    text = FP32_RECIPE.replace("path:pack", f"path:{scaled / 'pack'}")
    recipe.write_text(text.replace("  context: 128\n", "  context: 128\n  max_part_mb: 0.06\n") if parted else text)
    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["build", str(recipe), "-o", str(out)])
    assert result.exit_code == 0, result.output
    m = _manifest(out)
    assert m["rescale"]["residual_scale"] <= 2.0**-3 and m["gate"]["passed"]
    assert (m["parts"] is not None and len(m["parts"]) > 1) == parted
    args = ["generate", str(out), "--prompt", _prompt(), "-n", str(NEW_TOKENS), "--runtime", "coreai", "--json"]
    generated = CliRunner().invoke(main, args)
    assert generated.exit_code == 0, generated.output
    expected, _ = _transformers_greedy(written_fp32 / "unfolded")
    assert json.loads(generated.output.strip().splitlines()[-1])["generated_ids"] == expected
