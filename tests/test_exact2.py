"""exact2 (quant/types.py, convert/export/quantized.py): 2-bit codes and fp16 scales shipped as they are, bit for bit.

``Exact2Core`` holds three exact2 weights in groups of 128 columns, as Ternary Bonsai 2 packs store theirs: an
embedding [64, 384], a linear [256, 384] with a bias and a head [64, 256]. Their codes are seeded ternary (0, 1, 2,
plus one 3 each) with zero point 1, but the head's codes and zero points vary over 0..3 (Core ML's offset form); their
scales are random fp16 of both signs. Two functions (1 and 4 tokens) share them.

Measured here against the fp16 bytes of the same parameters (279,040: the three matrices and the bias), both
functions in each package: Core AI's weight blobs 36,992 bytes (0.133: codes at 2 bits, the bias, the linear's
scales, the head's zero points at 2 bits; the embedding's and the head's scales, 384 and 256 bytes, sit inline in
each function, and uniform zero points are splats), main.mlirb 41,666 (0.149); Core ML's weight.bin 38,208 (0.137:
codes, scales, bias and the head's int8 offsets; the three 4-entry tables inline), the whole package 50,619
(0.181). A lone [256, 512] linear with zero point 1 stores 2.127 bits a weight in Core AI and 2.137 in Core ML (one
fp16 table per group, which both could also store, measured 2.50 and 2.51).
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from coremltools.converters.mil.mil import types as mil_types
from torch import nn

from convert.backends import coreai, coreml, mlir_bytecode
from convert.backends.stored import difference, fingerprint
from convert.errors import PackageError
from convert.export.functions import FunctionModule
from convert.export.hadamard import SignedHadamard
from convert.export.quantized import (
    CodesLinear,
    HalfLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    RowParts,
    apply_quantized,
    embedding_rows,
    exact2_parameters,
    exact2_tables,
    packaged_from_codes,
    row_blocks,
    shipped_nbytes,
)
from convert.export.spec import FunctionSpec, TensorSpec
from convert.verify import checks
from quant.types import QuantizedWeight, Rotation

VOCAB, HIDDEN, INNER, GROUP = 64, 384, 256, 128
WEIGHT_BIN = "Data/com.apple.CoreML/weights/weight.bin"
FP16_SHARE_BOUND = 0.2


def seeded_exact2(shape: tuple[int, int], seed: int, varied_zero_points: bool = False) -> QuantizedWeight:
    """Seeded exact2 codes 0..2 with zero point 1 (codes 0..3 over zero points 0..3 when ``varied_zero_points``), one
    code 3, and fp16 scales of both signs in +-[0.001, 0.021]."""
    g = torch.Generator().manual_seed(seed)
    rows, columns = shape
    groups = (rows, columns // GROUP)
    codes = torch.randint(0, 4 if varied_zero_points else 3, shape, generator=g, dtype=torch.uint8)
    codes[rows // 2, columns // 3] = 3
    sign = torch.randint(0, 2, groups, generator=g) * 2 - 1
    scale = ((torch.rand(groups, generator=g) * 0.02 + 0.001) * sign).half()
    if varied_zero_points:
        zero_point = torch.randint(0, 4, groups, generator=g, dtype=torch.uint8)
    else:
        zero_point = torch.ones(groups, dtype=torch.uint8)
    return QuantizedWeight("exact2", codes, GROUP, scale=scale, zero_point=zero_point)


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


class Exact2Core(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, INNER)
        self.head = nn.Linear(INNER, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids[0].long())
        return {"logits": self.head(torch.relu(self.proj(h)))[None]}


def exact2_functions() -> tuple[Exact2Core, dict[str, QuantizedWeight], dict]:
    core = Exact2Core().half().eval().requires_grad_(False)
    with torch.no_grad():
        core.proj.bias.copy_(torch.linspace(-0.5, 0.5, INNER))
    weights = {"embed": seeded_exact2((VOCAB, HIDDEN), 0), "proj": seeded_exact2((INNER, HIDDEN), 1),
               "head": seeded_exact2((VOCAB, INNER), 2, varied_zero_points=True)}
    apply_quantized(core, weights)
    functions = {}
    for name, width in {"one": 1, "four": 4}.items():
        spec = FunctionSpec(name, (TensorSpec("input_ids", (1, width), "int32"),),
                            (TensorSpec("logits", (1, width, VOCAB), "float16"),))
        functions[name] = (FunctionModule(core, spec, {}), spec)
    return core, weights, functions


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The core packaged in both formats."""
    out = tmp_path_factory.mktemp("exact2")
    core, weights, functions = exact2_functions()
    coreai.package(functions, out / "q2.aimodel")
    coreml.package(functions, out / "q2.mlpackage")
    return SimpleNamespace(core=core, weights=weights, functions=functions,
                           paths={"coreai": out / "q2.aimodel", "coreml": out / "q2.mlpackage"})


def test_dequantize_is_one_rounding_of_scale_times_code_minus_zero_point():
    codes = torch.tensor([[0, 1, 2, 3] * (GROUP // 4)], dtype=torch.uint8)
    s = torch.tensor([[0.0123]]).half()
    hand = QuantizedWeight("exact2", codes, GROUP, scale=s, zero_point=torch.ones(1, 1, dtype=torch.uint8))
    expected = torch.cat([-s, 0 * s, s, 2 * s], dim=1).repeat(1, GROUP // 4)  # -s, 0, s, 2s exactly
    assert torch.equal(as_bits(hand.dequantize()), as_bits(expected))
    for quantized in (seeded_exact2((8, 2 * GROUP), 3), seeded_exact2((8, 3 * GROUP), 4, varied_zero_points=True)):
        scale = quantized.scale.double().repeat_interleave(GROUP, 1)
        zero_point = quantized.zero_point.double().repeat_interleave(GROUP, 1)
        once = ((quantized.codes.double() - zero_point) * scale).half()  # the exact product, rounded once
        assert torch.equal(as_bits(quantized.dequantize()), as_bits(once))
    assert hand.bits_per_weight == 2 + 18 / GROUP
    rows = quantized.rows(2, 5)
    assert (rows.method, rows.group_size, rows.shape) == ("exact2", GROUP, (3, 3 * GROUP))
    assert torch.equal(as_bits(rows.dequantize()), as_bits(quantized.dequantize()[2:5]))


def test_tables_hold_each_codes_weight_and_give_back_scale_and_zero_point():
    quantized = seeded_exact2((16, 3 * GROUP), 5, varied_zero_points=True)
    tables = exact2_tables(quantized.scale, quantized.zero_point)
    assert tables.shape == (16, 3, 4)
    for code in range(4):  # entry k is the weight of a code k, bit for bit
        constant = replace(quantized, codes=torch.full_like(quantized.codes, code))
        assert torch.equal(as_bits(tables[:, :, code].repeat_interleave(GROUP, 1)), as_bits(constant.dequantize()))
    scale, zero_point = exact2_parameters(tables)
    assert torch.equal(as_bits(scale), as_bits(quantized.scale)) and torch.equal(zero_point, quantized.zero_point)
    nudged = tables.clone()
    nudged.view(torch.int16)[3, 1, (int(zero_point[3, 1]) + 2) % 4] += 1  # one ulp off, not the zero entry
    assert exact2_parameters(nudged) is None  # not scale * (k - z) for any scale
    assert exact2_parameters(tables * 0) is None  # no single zero entry


def test_layers_compute_with_the_dequantized_weight_bit_for_bit():
    quantized = seeded_exact2((INNER, HIDDEN), 6)
    dense = quantized.dequantize()
    bias = nn.Parameter(torch.linspace(-1, 1, INNER).half(), requires_grad=False)
    layer = QuantizedLinear("proj", quantized, bias)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7)).half()
    assert torch.equal(as_bits(layer.weight), as_bits(dense))
    assert torch.equal(as_bits(layer.packed()), as_bits(dense))  # the Core AI form, uint2 data
    assert torch.equal(layer(x), nn.functional.linear(x, dense, bias))
    shipped = layer.quantized_weight()
    assert shipped.method == "exact2" and shipped.codes is layer.packed.quantized_data
    assert fingerprint(shipped) == fingerprint(quantized)
    groups = INNER * HIDDEN // GROUP
    assert layer.shipped_nbytes() == INNER * HIDDEN // 4 + 2 * groups + groups // 4 + 2 * INNER
    table = QuantizedEmbedding("embed", quantized)
    ids = torch.tensor([0, 5, 255, 5])
    assert torch.equal(as_bits(table(ids)), as_bits(dense[ids]))


@pytest.mark.parametrize("name", ["coreai", "coreml"])
def test_packages_read_back_codes_scales_and_dense_weights_bit_for_bit_in_every_function(built, name):
    backend = {"coreai": coreai, "coreml": coreml}[name]
    shipped = backend.compressed_weights(built.paths[name])
    assert sorted(shipped) == ["four", "one"]
    for found in shipped.values():
        by_fingerprint = {s.fingerprint: s for s in found}
        assert len(found) == 3
        for expected in built.weights.values():
            stored = by_fingerprint[fingerprint(expected)]
            weight = stored.weight
            assert (weight.method, weight.group_size, weight.shape) == ("exact2", GROUP, expected.shape)
            assert torch.equal(weight.codes, expected.codes)
            assert torch.equal(as_bits(weight.scale), as_bits(expected.scale))
            assert torch.equal(weight.zero_point, expected.zero_point)
            assert torch.equal(as_bits(torch.from_numpy(stored.dense)), as_bits(expected.dequantize()))
            assert difference(expected, stored) is None
    result = checks.quantized_constants(name, built.paths[name], built.weights)
    assert result == {"quantized_weights_compared": 6, "quantized_bit_exact": True}


def test_core_ai_stores_2_bit_codes_through_blockwise_shift_scale(built):
    program = str(coreai._mlir_module(coreai.AIModelAsset.load(built.paths["coreai"]).program))
    for rows, columns in ((VOCAB, HIDDEN), (INNER, HIDDEN), (VOCAB, INNER)):
        assert f"tensor<{rows}x{columns}xui2>" in program and f"tensor<{rows}x{columns // GROUP}xui2>" in program
    types = coreai.operation_types(built.paths["coreai"])["one"]
    assert "blockwise_shift_scale" in types and "lut_to_dense" not in types


def test_core_ml_stores_2_bit_codes_through_one_int8_table_into_blockwise_shift_scale(built):
    _, program = coreml._load_program(built.paths["coreml"])
    chains = [op for op in program.functions["one"].operations if op.op_type == "constexpr_blockwise_shift_scale"]
    forms = {}
    for op in chains:
        codes_op = op.data.op
        assert codes_op.op_type == "constexpr_lut_to_dense" and codes_op.indices.dtype == mil_types.uint2
        table = codes_op.lut.val
        forms[op.data.shape] = (table.dtype, table.reshape(-1).tolist(), None if op.offset is None else op.offset.shape)
    first = int(built.weights["head"].zero_point[0, 0])  # the head's table; its other zero points are offsets
    assert forms == {(VOCAB, HIDDEN): (np.int8, [-1, 0, 1, 2], None), (INNER, HIDDEN): (np.int8, [-1, 0, 1, 2], None),
                     (VOCAB, INNER): (np.int8, [k - first for k in range(4)], (VOCAB, INNER // GROUP))}


def test_packages_take_at_most_0_2x_the_fp16_bytes_and_store_the_weights_once_at_2_bits(built):
    """Whole packages, both functions' programs included (measured: see the module docstring)."""
    fp16 = 2 * sum(p.numel() for p in built.core.parameters())
    whole = {name: sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) for name, path in built.paths.items()}
    assert fp16 == 279_040 and all(size <= FP16_SHARE_BOUND * fp16 for size in whole.values()), whole
    _, sections = mlir_bytecode.bytecode_sections((built.paths["coreai"] / "main.mlirb").read_bytes())
    weights = {"coreai": sum(len(data) for section, data, _ in sections if section == mlir_bytecode.RESOURCE),
               "coreml": (built.paths["coreml"] / WEIGHT_BIN).stat().st_size}
    shipped = shipped_nbytes(built.functions["one"][0], skip=set())  # codes at 2 bits, for one function
    assert all(size < 1.02 * shipped for size in weights.values()), (weights, shipped)


def test_aimodel_runs_like_the_torch_modules(built):
    ids = np.array([[3, 60, 17, 42]], np.int32)
    with coreai.open_session(built.paths["coreai"]) as session:
        got = session.call("four", {"input_ids": ids})["logits"].astype(np.float64)
    with torch.no_grad():
        (logits,) = built.functions["four"][0](torch.from_numpy(ids))
    reference = logits.double().numpy()
    assert np.abs(got - reference).max() / np.abs(reference).max() < checks.FP16_OUTPUT_BOUND
    assert np.array_equal(got.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize(("name", "payload"), [("coreai", "main.mlirb"), ("coreml", WEIGHT_BIN)])
def test_an_altered_code_in_a_package_fails_the_check_naming_the_tensor(built, tmp_path, name, payload):
    altered = tmp_path / built.paths[name].name
    shutil.copytree(built.paths[name], altered)
    codes = built.weights["proj"].codes.numpy().reshape(-1, 4)
    packed = (codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6).astype(np.uint8).tobytes()
    content = bytearray((altered / payload).read_bytes())
    at = content.find(packed)  # both formats: four codes a byte, the first in the low bits
    assert at >= 0 and content.find(packed, at + 1) < 0
    content[at] ^= 0x01
    (altered / payload).write_bytes(bytes(content))
    with pytest.raises(PackageError, match="quantized weight proj .*codes: 1 of 98304 entries differ"):
        checks.quantized_constants(name, altered, built.weights)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("code 4", "'proj': codes go up to 4, above the 2-bit maximum 3"),
        ("inf scale", "'proj': a scale is zero, inf or NaN"),
        ("nan scale", "'proj': a scale is zero, inf or NaN"),
        ("zero scale", "'proj': a scale is zero, inf or NaN"),
        ("group 100", "'proj': 384 columns do not split into groups of 100"),
        ("zero point 4", "'proj': a zero point is 4; Core AI stores exact2 zero points as uint2"),
        ("overflow", "'proj': scale \\* \\(code - zero_point\\) overflows fp16"),
        ("scale shape", "'proj': scale must be torch.float16 \\[256, 3\\], got torch.float16 \\[256, 2\\]"),
    ],
)
def test_malformed_exact2_weights_are_refused_naming_the_weight(change, message):
    good = seeded_exact2((INNER, HIDDEN), 8)
    scale = good.scale.clone()
    scale[4, 1] = {"inf scale": float("inf"), "nan scale": float("nan"), "zero scale": 0.0,
                   "overflow": 40000.0}.get(change, float(scale[4, 1]))
    bad = {
        "code 4": replace(good, codes=torch.where(good.codes == 3, 4, good.codes).to(torch.uint8)),
        "group 100": replace(good, group_size=100),
        "zero point 4": replace(good, zero_point=good.zero_point + 3),
        "scale shape": replace(good, scale=good.scale[:, :2]),
    }.get(change, replace(good, scale=scale))
    core = nn.Module()
    core.proj = nn.Linear(HIDDEN, INNER)
    with pytest.raises(PackageError, match=f"quantized weight {message}"):
        apply_quantized(core, {"proj": bad})


class Palettized(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(GROUP, 8, bias=False)

    def forward(self, x):
        return (self.lin(x),)


def test_core_ml_refuses_a_2_bit_table_that_is_not_an_exact2_weights():
    """A 2-bit palettization the conversion pass cannot ship as codes and scales stops the conversion, naming it."""
    lut = torch.tensor([0.1, 0.2, 0.3, 0.4]).half().reshape(1, 1, 4, 1)
    module = Palettized()
    with torch.no_grad():
        module.lin.weight.copy_(lut.reshape(-1)[torch.arange(8 * GROUP) % 4].reshape(8, GROUP).float())
    module.lin.register_buffer("_COREML_/weight/compression_type", torch.tensor([2]))
    module.lin.register_buffer("_COREML_/weight/lut", lut)
    module.register_buffer("_COREML_/metadata_version", torch.tensor(1))
    spec = FunctionSpec("main", (TensorSpec("x", (1, GROUP), "float32"),), (TensorSpec("y", (1, 8), "float32"),))
    with pytest.raises(PackageError, match=r"MIL op lin\.weight.*: a 2-bit table \[1, 1, 4, 1\] .* that is not"):
        coreml.convert_function("main", module, spec)


def _seeded_codes(method: str, rows: int, columns: int, generator: torch.Generator) -> QuantizedWeight:
    """Random codes of ``method`` with lut4 tables of 16 rows, or scales and zero points a group of ``GROUP``."""
    top = 3 if method == "exact2" else 16
    codes = torch.randint(0, top, (rows, columns), dtype=torch.uint8, generator=generator)
    if method == "lut4":
        return QuantizedWeight("lut4", codes, 16, lut=torch.randn(rows // 16, 16, generator=generator).half())
    groups = (rows, columns // GROUP)
    return QuantizedWeight(method, codes, GROUP, scale=(torch.rand(groups, generator=generator) * 0.1).half(),
                           zero_point=torch.randint(0, top, groups, dtype=torch.uint8, generator=generator))


@pytest.mark.parametrize("method", ["exact2", "affine4", "lut4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_codes_linear_computes_a_quantized_linears_outputs_bit_for_bit(method, dtype):
    # a matrix 5120 wide, as the 27B models' are: blocks of 204 rows and a tail of 4 joined to the last (lut4: 208)
    # (under MIN_BLOCK_ROWS a GEMM sums in another order), each block's product the whole GEMM's rows bit for bit
    rows, columns = 1024, 5120
    generator = torch.Generator().manual_seed(11)
    quantized = _seeded_codes(method, rows, columns, generator)
    if method == "exact2":
        quantized = replace(quantized, rotation=Rotation(
            torch.where(torch.rand(columns, generator=generator) < 0.5, -1.0, 1.0), 1024))
    bias = nn.Parameter(torch.linspace(-1, 1, rows).half(), requires_grad=False)
    dense, lean = QuantizedLinear("proj", quantized, bias).to(dtype), CodesLinear("proj", quantized, bias).to(dtype)
    assert len(lean.row_blocks()) == 5 and lean.row_blocks()[-1] == ((832, 1024) if method == "lut4" else (816, 1024))
    for width in (1, 8, 64):
        x = torch.randn(1, width, columns, generator=generator).to(dtype)
        assert torch.equal(as_bits(lean(x)), as_bits(dense(x))), width
    assert torch.equal(as_bits(lean.dense_rows(8, 12, torch.float16)), as_bits(quantized.dequantize()[8:12]))
    assert lean.words.numel() == rows * columns * (2 if method == "exact2" else 4) // 8  # the codes, bit-packed


@pytest.mark.parametrize("method", ["exact2", "affine4", "lut4"])
def test_a_codes_linears_row_parts_are_views_computing_its_rows_bit_for_bit(method):
    # an ane drafter's head past the ANE's largest dim shares a lean target's head in row parts (RowParts.split):
    # views of its codes and tables, whose outputs side by side are the whole one's, bit for bit, and which package
    # as the quantized weight's rows
    rows, columns = 1024, 5120
    generator = torch.Generator().manual_seed(15)
    quantized = _seeded_codes(method, rows, columns, generator)
    lean = CodesLinear("lm_head", quantized)
    ranges = [(0, 400), (400, 800), (800, 1024)]
    parts = RowParts.split(lean, ranges)
    assert all(part.words.untyped_storage().data_ptr() == lean.words.untyped_storage().data_ptr()
               for part in parts.parts)
    x = torch.randn(1, 8, columns, generator=generator)
    assert torch.equal(parts(x), lean(x))
    holder = nn.Module()
    holder.lm_head = parts
    packaged_from_codes(holder)
    for (lo, hi), part in zip(ranges, holder.lm_head.parts, strict=True):
        assert type(part) is QuantizedLinear and part.name == f"lm_head[{lo}:{hi}]"
        assert fingerprint(part.quantized_weight()) == fingerprint(quantized.rows(lo, hi))
    if method == "lut4":
        with pytest.raises(ValueError, match="lut4 rows 8..400 split a table of 16 rows"):
            lean.rows(8, 400)


def test_a_half_linear_computes_the_fp32_linears_outputs_bit_for_bit():
    # the fp16 weight shared, upcast a block of rows at a time (5 blocks at this width) into a reused workspace
    rows, columns = 1024, 5120
    generator = torch.Generator().manual_seed(12)
    weight = (torch.randn(rows, columns, generator=generator) * 0.02).half()
    bias = nn.Parameter(torch.linspace(-1, 1, rows), requires_grad=False)
    lean = HalfLinear(weight, bias)
    dense = nn.Linear(columns, rows)
    dense.weight.data, dense.bias.data = weight.float(), bias.data
    assert len(row_blocks(rows, columns)) == 5
    for width in (1, 8, 64):
        x = torch.randn(1, width, columns, generator=generator)
        assert torch.equal(lean(x), dense(x)), width
    assert lean.weight.data_ptr() == weight.data_ptr() and copy.deepcopy(lean).weight is lean.weight


def test_a_codes_tables_rows_are_the_quantized_tables_rows_after_their_rotation():
    # embedding_rows: each row S H W' computed in fp32 and rounded once, from the codes or from the dense table
    quantized = replace(seeded_exact2((4096, HIDDEN), 13), rotation=Rotation(
        torch.where(torch.rand(HIDDEN, generator=torch.Generator().manual_seed(14)) < 0.5, -1.0, 1.0), 128))
    from_codes = embedding_rows(CodesLinear("embed", quantized, embedding=True))
    from_table = embedding_rows(QuantizedEmbedding("embed", quantized))
    assert torch.equal(as_bits(from_codes), as_bits(from_table))
    stored = quantized.dequantize()
    rotated = SignedHadamard(quantized.rotation.signs, 128, inverse=True)(stored[:3].float()).half()
    assert torch.equal(as_bits(from_codes[:3]), as_bits(rotated)) and not torch.equal(from_codes[:3], stored[:3])
