"""Quantized weights into both packages, compressed and bit-exact (convert/export/quantized.py).

``LinearToyCore`` is the toy of tests/helpers/toymodel.py with ``nn.Linear`` projections, an MLP and the scatter KV
write that both backends convert, sized so that its linears hold 315,392 of its 319,616 parameters. Its linears
get random ``QuantizedWeight``s: lut4 (groups of 16 rows) for k_proj, up_proj and lm_head, affine4 (groups of
64 columns) for v_proj, o_proj and down_proj.

Measured here (2 CPU cores): weight bytes of the quantized packages against the same toy's fp16 packages
(which store 639,168 and 644,288 bytes for 639,232 bytes of fp16 parameters): Core AI 173,664 / 639,168
(0.272; main.mlirb 207,476 / 666,914 = 0.311 with its 3 functions' program), Core ML weight.bin
179,328 / 644,288 (0.278). On the Core AI runtime against the torch modules carrying the same dequantized weights
(prefill, decodes, verify and a rollback verify on carried states), argmax identical everywhere; max |delta logits|
relative to the largest |logit| (~2.0): fp32 1.0e-6, so the runtime computes with exactly these weights (one code
one step off moves the fp32 logits by 3.2e-3); fp16 5.4e-3 (~5 fp16 ulps, within checks.FP16_OUTPUT_BOUND).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from convert.backends import coreai, coreml, mlir_bytecode
from convert.backends.stored import difference
from convert.errors import PackageError
from convert.export.functions import FunctionModule
from convert.export.quantized import (
    QuantizedLinear,
    apply_quantized,
    quantized_weights,
    release_dense_weights,
    shipped_nbytes,
)
from convert.export.spec import FunctionSpec, TensorSpec
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors
from convert.models.qwen3 import Qwen3Args
from convert.verify import checks
from convert.weights.target import build_modules
from quant.types import QuantizedWeight

VOCAB, HIDDEN, INTER, LAYERS, KV_HEADS, HEAD_DIM, CONTEXT = 32, 128, 512, 2, 2, 32, 32
LUT_LAYERS = ("k_proj", "up_proj", "lm_head")
FP32_RELATIVE_BOUND = 1e-5  # measured 1.0e-6
WEIGHT_BIN = "Data/com.apple.CoreML/weights/weight.bin"


class ToyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        kv = KV_HEADS * HEAD_DIM
        self.k_proj = nn.Linear(HIDDEN, kv)
        self.v_proj = nn.Linear(HIDDEN, kv, bias=False)
        self.o_proj = nn.Linear(kv, HIDDEN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)


class LinearToyCore(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(ToyLayer() for _ in range(LAYERS))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.register_buffer("slots", torch.arange(CONTEXT, dtype=torch.int32), persistent=False)
        self.register_buffer("kv_heads", torch.arange(KV_HEADS, dtype=torch.int32)[:, None], persistent=False)

    def forward(self, input_ids, position_ids, key_cache, value_cache):
        s = input_ids.shape[1]
        h = self.embed(input_ids[0].long())
        bias = torch.where(self.slots[None, :] <= position_ids[0][:, None], 0.0, -1e4).to(h.dtype)
        rows = position_ids[0][None, :].expand(KV_HEADS, -1)
        heads = self.kv_heads.expand_as(rows)
        for i, layer in enumerate(self.layers):
            k = layer.k_proj(h).view(s, KV_HEADS, HEAD_DIM).transpose(0, 1)
            v = layer.v_proj(h).view(s, KV_HEADS, HEAD_DIM).transpose(0, 1)
            index = (torch.full_like(rows, i), heads, rows)
            key_cache.index_put_(index, k.to(key_cache.dtype))
            value_cache.index_put_(index, v.to(value_cache.dtype))
            scores = k @ key_cache[i].to(h.dtype).transpose(1, 2) / HEAD_DIM**0.5 + bias
            attn = torch.softmax(scores, dim=-1) @ value_cache[i].to(h.dtype)
            h = h + layer.o_proj(attn.transpose(0, 1).reshape(s, KV_HEADS * HEAD_DIM))
            h = h + layer.down_proj(nn.functional.silu(layer.up_proj(h)))
        logits = self.lm_head(h)[None]
        return {"argmax_ids": logits.argmax(-1).to(torch.int32), "logits": logits}


def toy_functions(dtype: torch.dtype = torch.float16) -> tuple[LinearToyCore, dict]:
    core = LinearToyCore().to(dtype).eval().requires_grad_(False)
    shape, fdtype = (LAYERS, KV_HEADS, CONTEXT, HEAD_DIM), "float16" if dtype == torch.float16 else "float32"
    states = {name: torch.zeros(shape, dtype=dtype) for name in ("key_cache", "value_cache")}
    functions = {}
    for name, s in {"prefill": 8, "decode": 1, "verify": 4}.items():
        inputs = (TensorSpec("input_ids", (1, s), "int32"), TensorSpec("position_ids", (1, s), "int32"))
        outputs = (TensorSpec("argmax_ids", (1, s), "int32"), TensorSpec("logits", (1, s, VOCAB), fdtype))
        spec = FunctionSpec(name, inputs, outputs, tuple(TensorSpec(n, shape, fdtype) for n in states))
        functions[name] = (FunctionModule(core, spec, states), spec)
    return core, functions


def random_quantized(shape: tuple[int, int], method: str, seed: int) -> QuantizedWeight:
    """Random codes and tables; each lut4 table has distinct entries (see compress: Core ML needs them)."""
    g = torch.Generator().manual_seed(seed)
    rows, columns = shape
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    if method == "lut4":
        step = torch.rand(rows // 16, 1, generator=g) * 0.02 + 0.01
        lut = (step * (torch.arange(-8, 8) + 0.3 * torch.rand(rows // 16, 16, generator=g))).half()
        return QuantizedWeight("lut4", codes, 16, lut=lut)
    scale = (torch.rand(rows, columns // 64, generator=g) * 0.02 + 0.005).half()
    zero_point = torch.randint(0, 16, (rows, columns // 64), generator=g, dtype=torch.uint8)
    return QuantizedWeight("affine4", codes, 64, scale=scale, zero_point=zero_point)


def toy_weights(core: nn.Module) -> dict[str, QuantizedWeight]:
    linears = [(name, m) for name, m in core.named_modules() if isinstance(m, nn.Linear)]
    return {
        name: random_quantized(tuple(m.weight.shape), "lut4" if name.endswith(LUT_LAYERS) else "affine4", seed)
        for seed, (name, m) in enumerate(linears)
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The fp16 toy quantized in place and packaged in both formats."""
    out = tmp_path_factory.mktemp("compress")
    core, functions = toy_functions()
    weights = toy_weights(core)
    apply_quantized(core, weights)
    coreai.package(functions, out / "q4.aimodel")
    coreml.package(functions, out / "q4.mlpackage")
    return SimpleNamespace(core=core, functions=functions, weights=weights, out=out)


def resource_bytes(asset) -> int:
    _, sections = mlir_bytecode.bytecode_sections((asset / "main.mlirb").read_bytes())
    return sum(len(data) for section, data, _ in sections if section == mlir_bytecode.RESOURCE)


def test_quantized_linear_computes_with_the_dequantized_weight_bit_for_bit():
    for method, shape in (("lut4", (32, 64)), ("affine4", (16, 128))):
        quantized = random_quantized(shape, method, seed=1)
        bias = nn.Parameter(torch.randn(shape[0]).half(), requires_grad=False)
        layer = QuantizedLinear("probe", quantized, bias)
        x = torch.randn(3, shape[1]).half()
        dense = quantized.dequantize()
        assert torch.equal(layer.weight.view(torch.int16), dense.view(torch.int16))
        assert torch.equal(layer.packed().view(torch.int16), dense.view(torch.int16))  # the Core AI form
        assert torch.equal(layer(x), nn.functional.linear(x, dense, bias))
        unbiased = QuantizedLinear("probe", quantized)  # an fp32 input computes on the exact fp32 copy
        assert torch.equal(unbiased(x.float()), nn.functional.linear(x.float(), dense.float()))


def test_torch_export_computes_the_weight_with_coreai_ops():
    for method, op in (("lut4", "coreai.lut_to_dense"), ("affine4", "coreai.constexpr_blockwise_shift_scale")):
        layer = QuantizedLinear("probe", random_quantized((32, 128), method, seed=2))
        x = torch.randn(2, 128).half()
        program = torch.export.export(layer, (x,))
        assert any(str(node.target).startswith(op) for node in program.graph.nodes)
        assert torch.equal(program.module()(x), layer(x))


def test_apply_quantized_swaps_a_shared_linear_under_every_name():
    core = nn.Module()
    core.a = nn.Linear(128, 32, bias=False)
    core.b = core.a
    quantized = random_quantized((32, 128), "affine4", seed=3)
    apply_quantized(core, {"b": quantized})
    assert isinstance(core.a, QuantizedLinear) and core.a is core.b
    assert quantized_weights(core).keys() == {"a"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("tied", "lm_head.weight is tied to embed.weight.*keep 'lm_head' unquantized"),
        ("two weights", "'b' and 'a' are one shared linear given two different quantized weights"),
        ("unknown", "'nope' is not a module of the export core"),
        ("not linear", "'norm' is a LayerNorm; only nn.Linear and nn.Embedding weights are quantized"),
        ("tied embedding", "embed.weight is tied to lm_head.weight.*keep 'embed' unquantized"),
        ("shape", "'a' is \\[64, 128\\] but the linear's weight is \\[32, 128\\]"),
        ("zero scale", "'a': a scale is zero"),
        ("code range", "'a': codes go up to 16"),
    ],
)
def test_apply_quantized_refuses_what_cannot_ship_exactly(change, message):
    core = nn.Module()
    core.embed = nn.Embedding(32, 128)
    core.lm_head = nn.Linear(128, 32, bias=False)
    core.lm_head.weight = core.embed.weight
    core.a = nn.Linear(128, 32, bias=False)
    core.b = core.a
    core.norm = nn.LayerNorm(128)
    good = random_quantized((32, 128), "affine4", seed=4)
    weights = {
        "tied": {"lm_head": good},
        "two weights": {"a": good, "b": random_quantized((32, 128), "affine4", seed=5)},
        "unknown": {"nope": good},
        "not linear": {"norm": good},
        "tied embedding": {"embed": good},
        "shape": {"a": random_quantized((64, 128), "affine4", seed=6)},
        "zero scale": {"a": replace(good, scale=good.scale * 0)},
        "code range": {"a": replace(good, codes=good.codes + 1)},
    }[change]
    with pytest.raises(PackageError, match=message):
        apply_quantized(core, weights)


def test_core_ml_ships_codes_at_a_later_equal_lut_entry_as_they_are(tmp_path):
    """The codes are the quantizer's, not derived from the dense weight (which would pick the first equal entry)."""
    quantized = random_quantized((16, 64), "lut4", seed=7)
    quantized.lut[0, 9] = quantized.lut[0, 2]
    quantized.codes[quantized.codes == 9] = 0
    quantized.codes[3, 5] = 9
    core = nn.Sequential(QuantizedLinear("0", quantized))
    spec = FunctionSpec("main", (TensorSpec("x", (2, 64), "float32"),), (TensorSpec("y", (2, 16), "float32"),), ())
    coreml.package({"main": (core, spec)}, tmp_path / "equal.mlpackage")
    (shipped,) = coreml.compressed_weights(tmp_path / "equal.mlpackage")["main"]
    assert int(shipped.weight.codes[3, 5]) == 9
    assert difference(quantized, shipped) is None


def test_released_dense_weights_change_no_output_and_no_package_byte(built, tmp_path):
    """A part's packaging releases the dense weights (release_dense_weights): the packages are made from the codes."""
    core, functions = toy_functions()
    apply_quantized(core, toy_weights(core))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3)).half()
    before = core.layers[0].k_proj(x)
    release_dense_weights(core)
    layers = [m for m in core.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 11 and all(m.weight.untyped_storage().nbytes() == 2 for m in layers)  # one fp16 zero each
    assert torch.equal(core.layers[0].k_proj(x).view(torch.int16), before.view(torch.int16))
    coreml.package(functions, tmp_path / "q4.mlpackage")
    coreai.package(functions, tmp_path / "q4.aimodel")
    for name in ("q4.mlpackage", "q4.aimodel"):
        assert coreml.stable_hash(tmp_path / name) == coreml.stable_hash(built.out / name)


def test_core_ml_constants_are_the_quantizers_bit_for_bit_in_every_function(built):
    path = built.out / "q4.mlpackage"
    shipped = coreml.compressed_weights(path)
    assert list(shipped) == ["prefill", "decode", "verify"]
    assert all(len(found) == len(built.weights) for found in shipped.values())
    result = checks.quantized_constants("coreml", path, built.weights)
    assert result == {"quantized_weights_compared": 3 * len(built.weights), "quantized_bit_exact": True}
    # the build's plain-constant check: the weights that are not quantized (none here but the embedding) bit for bit
    assert checks.coreml_constants(path, built)["weights_bit_exact"] is True


def test_core_ai_constants_are_the_quantizers_bit_for_bit_in_every_function(built):
    path = built.out / "q4.aimodel"
    shipped = coreai.compressed_weights(path)
    assert sorted(shipped) == ["decode", "prefill", "verify"]
    assert all(len(found) == len(built.weights) for found in shipped.values())
    result = checks.quantized_constants("coreai", path, built.weights)
    assert result == {"quantized_weights_compared": 3 * len(built.weights), "quantized_bit_exact": True}


def test_quantized_weights_are_stored_once_and_under_0_3x_fp16(built):
    """Against the fp16 bytes of the same weights, which is what the fp16 packages store (measured: see above)."""
    shipped = shipped_nbytes(built.functions["decode"][0], skip={"key_cache", "value_cache"})
    fp16 = 2 * sum(p.numel() for p in built.core.parameters())
    q4_coreai = resource_bytes(built.out / "q4.aimodel")
    q4_coreml = (built.out / "q4.mlpackage" / WEIGHT_BIN).stat().st_size
    assert q4_coreai < 1.1 * shipped and q4_coreml < 1.1 * shipped  # three functions, weights once
    assert q4_coreai < 0.3 * fp16 and q4_coreml < 0.3 * fp16, (q4_coreai, q4_coreml, fp16)


def runtime_against_torch(path, functions) -> list[tuple[float, bool]]:
    """Prefill, two decodes, a verify, then a rollback verify on carried states: (relative delta, argmax equal)."""
    calls = [("prefill", [3, 10, 17, 24, 31, 5, 6, 7], range(8)), ("decode", [9], [8]), ("decode", [1], [9]),
             ("verify", [7, 5, 9, 17], range(10, 14)), ("verify", [1, 2, 3, 4], range(9, 13))]
    results = []
    with coreai.open_session(path) as session:
        for name, ids, positions in calls:
            inputs = {"input_ids": np.array([ids], np.int32), "position_ids": np.array([list(positions)], np.int32)}
            got = session.call(name, inputs)
            with torch.no_grad():
                argmax_ids, logits = functions[name][0](*(torch.from_numpy(v) for v in inputs.values()))
            reference = logits.double().numpy()
            delta = np.abs(got["logits"].astype(np.float64) - reference).max() / np.abs(reference).max()
            results.append((float(delta), bool(np.array_equal(got["argmax_ids"], argmax_ids.numpy()))))
    return results


def test_quantized_aimodel_runs_like_the_torch_modules(built, tmp_path):
    fp16 = runtime_against_torch(built.out / "q4.aimodel", built.functions)
    core, functions = toy_functions(torch.float32)
    apply_quantized(core, built.weights)
    coreai.package(functions, tmp_path / "q4-fp32.aimodel")
    fp32 = runtime_against_torch(tmp_path / "q4-fp32.aimodel", functions)
    assert all(same for _, same in fp16 + fp32)
    assert max(delta for delta, _ in fp16) < checks.FP16_OUTPUT_BOUND
    assert max(delta for delta, _ in fp32) < FP32_RELATIVE_BOUND


def test_a_mismatching_quantized_weight_fails_the_check_naming_it(built):
    codes = built.weights["layers.0.o_proj"].codes.clone()
    codes[5, 7] ^= 1
    scale = built.weights["layers.1.down_proj"].scale.clone()
    scale[0, 0] += 1
    for name, path in (("coreai", built.out / "q4.aimodel"), ("coreml", built.out / "q4.mlpackage")):
        for tensor, changed, problem in (
            ("layers.0.o_proj", {"codes": codes}, "codes: 1 of 8192 entries differ"),
            ("layers.1.down_proj", {"scale": scale}, "scale: 1 of 1024 entries differ"),
        ):
            weights = {**built.weights, tensor: replace(built.weights[tensor], **changed)}
            with pytest.raises(PackageError, match=f"function prefill: quantized weight {tensor} .*{problem}"):
                checks.quantized_constants(name, path, weights)


@pytest.mark.parametrize(("name", "payload"), [("coreai", "main.mlirb"), ("coreml", WEIGHT_BIN)])
def test_an_altered_code_in_the_package_fails_the_check_naming_the_tensor(built, tmp_path, name, payload):
    source = built.out / f"q4.{'aimodel' if name == 'coreai' else 'mlpackage'}"
    altered = tmp_path / source.name
    shutil.copytree(source, altered)
    codes = built.weights["layers.1.up_proj"].codes.numpy().reshape(-1)
    packed = (codes[0::2] | codes[1::2] << 4).astype(np.uint8).tobytes()  # both formats: low nibble first
    content = bytearray((altered / payload).read_bytes())
    at = content.find(packed)
    assert at >= 0 and content.find(packed, at + 1) < 0
    content[at] ^= 0x01
    (altered / payload).write_bytes(bytes(content))
    with pytest.raises(PackageError, match="quantized weight layers.1.up_proj .*codes: 1 of 65536 entries differ"):
        checks.quantized_constants(name, altered, built.weights)


def test_tiny_qwen3_quantized_passes_the_build_checks(tiny_checkpoint, tmp_path):
    """The real export core through the build's own checks (read-back, bit-exact constants, runtime lockstep)."""
    args = Qwen3Args.from_config(json.loads((tiny_checkpoint / "config.json").read_text()))
    target = Target(source="path:.", graphs=Graphs(prefill=8, verify=4), context=32, logits=True)
    modules = build_modules(args, target, load_tensors(tiny_checkpoint), torch.float16)
    linears = [(name, m) for name, m in modules.core.named_modules() if isinstance(m, nn.Linear)]
    weights = {
        name: random_quantized(shape, "affine4" if i % 2 == 0 and shape[1] % 64 == 0 else "lut4", seed=i)
        for i, (name, shape) in enumerate((name, tuple(m.weight.shape)) for name, m in linears)
    }
    apply_quantized(modules.core, weights)
    for name, backend, suffix in (("coreai", coreai, ".aimodel"), ("coreml", coreml, ".mlpackage")):
        path = tmp_path / f"tiny{suffix}"
        backend.package(modules.functions, path)
        result = checks.check_package(name, path, modules)
        assert result["quantized_bit_exact"] is True
        assert result["quantized_weights_compared"] == 3 * len(weights)
    assert result["weights_bit_exact"] is True
