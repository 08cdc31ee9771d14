"""convert/inputs/prism.py against a tiny pack that tests/helpers/prism_packs.py writes from the published layout with
its own packing code: the reader gives back the writer's codes, scales and signs; the unfolded weights equal the
writer's logical weights and compute what mlx-vlm's formulas (dequantize, then rotate the activations) compute; and each
malformed pack is refused with one line naming the file and the tensor."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from convert.errors import InputError
from convert.inputs import prism
from quant.types import hadamard, walsh_hadamard
from tests.helpers.prism_packs import edit_json, edit_tensors, write_pack

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOWN = "language_model.model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("prism")
    return root, write_pack(root / "pack", root / "unfolded", seed=3)


@pytest.fixture(scope="module")
def pack(written):
    return prism.read_pack(written[0] / "pack")


@pytest.fixture
def broken(written, tmp_path):
    """A fresh copy of the pack for a test to break."""
    target = tmp_path / "pack"
    shutil.copytree(written[0] / "pack", target)
    return target


def mlx_dequantize(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """``mx.dequantize(w, scales, biases, group_size=128, bits=2)`` as MLX's CPU kernel (``_qmm_t``) reads the words:
    their bytes in memory order (little-endian), four codes a byte, low bits first; w = scale * q + bias."""
    raw = words.numpy().view(np.uint8)
    q = np.stack([(raw >> (2 * p)) & 3 for p in range(4)], axis=-1).reshape(words.shape[0], -1, 128)
    w = torch.from_numpy(q.astype(np.float32)) * scales.float()[..., None] + biases.float()[..., None]
    return w.reshape(words.shape[0], -1)


def mlx_hadamard_transform(x: torch.Tensor, block: int, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """mlx-vlm's ``hadamard_transform`` in fp32: the signs first (or last, ``inverse``), and ``mx.hadamard_transform``
    over blocks with scale 1/sqrt(block) as MLX's ``hadamard_n`` butterfly computes it (pairs j, j + h)."""
    x = x.float() if inverse else x.float() * signs
    y = x.reshape(-1, block)
    h = 1
    while h < block:
        pairs = y.reshape(-1, block // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).reshape(-1, block)
        h *= 2
    y = (y * (1 / math.sqrt(block))).reshape(x.shape)
    return y * signs if inverse else y


def pack_parts(pack_dir, key: str) -> tuple[torch.Tensor, ...]:
    with safe_open(str(pack_dir / "model.safetensors"), framework="pt") as f:
        return tuple(f.get_tensor(f"{key}.{part}") for part in ("weight", "scales", "biases", "signs"))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_reader_returns_the_writers_codes_scales_and_signs(written, pack):
    _, expected = written
    assert list(pack.modules) == list(expected.codes)
    assert pack.block == expected.block == 64
    for path, module in pack.modules.items():
        assert module.embedding == (path == "model.embed_tokens")
        assert module.block == expected.block
        codes = prism.codes(module)
        assert codes.dtype == torch.uint8 and codes.shape == (module.rows, module.width)
        assert torch.equal(codes, expected.codes[path]), path
        assert torch.equal(module.scales, expected.scales[path]), path
        assert torch.equal(module.biases, -expected.scales[path]), path
        assert torch.equal(module.signs, expected.signs[module.width]), path
    assert sorted({m.width for m in pack.modules.values()}) == [128, 256]


def test_the_vision_tower_is_present_and_ignored(written, pack):
    root, expected = written
    with safe_open(str(root / "pack" / "model.safetensors"), framework="pt") as f:
        assert set(expected.vision_keys) <= set(f.keys())
    assert len(expected.vision_keys) > 10
    assert not any(m.key.startswith("vision_tower.") for m in pack.modules.values())


def test_unpack_codes_reads_the_lowest_bits_first():
    codes = [(3 * k + 1) % 4 for k in range(32)]  # every code 0..3, in no symmetric order
    words = [sum(c << (2 * k) for k, c in enumerate(codes[w * 16 : (w + 1) * 16])) for w in range(2)]
    packed = torch.from_numpy(np.array([words], dtype=np.uint32))
    assert prism.unpack_codes(packed).tolist() == [codes]


def test_hadamard_is_the_normalised_sylvester_matrix():
    h = hadamard(16)
    i = torch.arange(16)
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in range(16)] for a in range(16)], dtype=torch.float64)
    assert torch.equal(h * 4, 1 - 2 * parity)
    assert torch.allclose(h @ h, torch.eye(16, dtype=torch.float64), atol=1e-15)
    assert torch.equal(h, h.T) and h[i, 0].eq(0.25).all()


@pytest.mark.parametrize("block", [1, 2, 64, 512, 1024])
def test_the_fast_transform_is_the_matrix_product(block):
    """``walsh_hadamard`` (the butterfly the unfolding uses) against rows times the block-diagonal matrix, in fp64:
    equal to rounding (relative 1e-14), and a pack's values (fp16 scale times -1, 0, 1, 2) come out bit for bit where
    the block is a power of four (the scale 1/sqrt(block) is then exact)."""
    x = torch.randn(5, 3 * block, dtype=torch.float64, generator=torch.Generator().manual_seed(block))
    product = (x.reshape(5, 3, block) @ hadamard(block)).reshape(5, -1)
    assert (walsh_hadamard(x, block) - product).abs().max() <= 1e-14 * product.abs().max()
    if math.log2(block) % 2 == 0:
        values = (torch.randint(-1, 3, (5, 3 * block)) * torch.rand(5, 3 * block).half()).double()
        assert torch.equal(walsh_hadamard(values, block).float(),
                           (values.reshape(5, 3, block) @ hadamard(block)).reshape(5, -1).float())


def test_unfold_equals_the_writers_logical_weights(written, pack):
    """Both sides compute W' H S in fp64 and round once to fp32; only the order of the fp64 sums differs (their
    difference is below 1e-15 relative), so at most a value that falls on an fp32 rounding boundary can differ, by
    one ulp."""
    root, expected = written
    unfolded = load_file(str(root / "unfolded" / "model.safetensors"))
    for path, module in pack.modules.items():
        logical = prism.embedding_table(module) if module.embedding else prism.unfold(module)
        assert torch.equal(unfolded[expected.unfolded_keys[path]], expected.logical[path])
        torch.testing.assert_close(logical, expected.logical[path], rtol=2**-23, atol=1e-30, msg=path)
    embedding = pack.modules["model.embed_tokens"]
    assert torch.equal(prism.embedding_table(embedding), prism.unfold(embedding))


def test_dequantize_is_mlx_affine_dequantize(written, pack):
    for module in pack.modules.values():
        words, scales, biases, _ = pack_parts(written[0] / "pack", module.key)
        assert torch.equal(prism.dequantize(module), mlx_dequantize(words, scales, biases)), module.path


def test_unfolded_linears_compute_mlx_vlms_rotated_matmul(written, pack):
    """y = W' . H(s * x) (mlx-vlm: dequantize, rotate the activations; fp32) against unfold(W) . x (fp32). Both
    are fp32 evaluations of the same product: the rotation adds log2(64) = 6 butterfly roundings and the dot
    products sum at most 256 terms, so with fp32's unit roundoff u = 6e-8 the expected relative difference is about
    sqrt(256) u ~ 1e-6. 1e-5 leaves a tenfold margin; a wrong sign, block, bit order or transform gives O(1)."""
    generator = torch.Generator().manual_seed(0)
    for module in pack.modules.values():
        if module.embedding:
            continue
        words, scales, biases, signs = pack_parts(written[0] / "pack", module.key)
        x = torch.randn(8, module.width, generator=generator)
        direct = mlx_hadamard_transform(x, module.block, signs) @ mlx_dequantize(words, scales, biases).T
        assert relative_error(x @ prism.unfold(module).T, direct) < 1e-5, module.path


def test_embedding_table_is_mlx_vlms_lookup(written, pack):
    """h = s * H(row) (mlx-vlm: dequantize the rows, cast to fp16, rotate back; fp32) against the table's rows. The
    only fp32 roundings are the 6 butterfly stages and the scale (the dequantized values are exact in fp16), so the
    rows agree to within about 7 u ~ 4e-7 relative; 1e-6 is the bound."""
    module = pack.modules["model.embed_tokens"]
    words, scales, biases, signs = pack_parts(written[0] / "pack", module.key)
    ids = torch.tensor([0, 5, 17, 255, 319])
    rows = mlx_dequantize(words[ids], scales[ids], biases[ids]).to(torch.float16)
    direct = mlx_hadamard_transform(rows, module.block, signs, inverse=True)
    assert relative_error(prism.embedding_table(module)[ids], direct) < 1e-6


def _drop_matrix(tensors):
    for part in ("weight", "scales", "biases", "signs"):
        del tensors[f"language_model.model.layers.1.mlp.up_proj.{part}"]


def _set(key, index, value):
    def edit(tensors):
        tensors[key][index] = value
    return edit


def _modules(edit):
    return lambda config: edit(config["modules"])


def _block(path, block):
    def edit(records):
        next(r for r in records if r["path"] == path)["block"] = block
    return _modules(edit)


TENSOR_CASES = {
    "missing signs": (lambda t: t.pop(DOWN + ".signs"),
                      r"model\.safetensors: tensor '" + DOWN + r"\.signs' is missing"),
    "missing matrix": (_drop_matrix, r"config\.json: modules names 'model\.layers\.1\.mlp\.up_proj', but the pack has "
                                     r"no tensor 'language_model\.model\.layers\.1\.mlp\.up_proj\.weight'"),
    "infinite scale": (lambda t: (_set(DOWN + ".scales", (2, 1), float("inf"))(t),
                                  _set(DOWN + ".biases", (2, 1), float("-inf"))(t)),
                       r"model\.safetensors: tensor '" + DOWN + r"\.scales' has inf at row 2, group 1"),
    "signs not +-1": (_set(DOWN + ".signs", 5, 0.5), r"tensor '" + DOWN + r"\.signs' has 0\.5 at 5"),
    "biases not -scales": (_set(DOWN + ".biases", (1, 0), 0.0), r"tensor '" + DOWN + r"\.biases' is 0\.0 at row 1"),
    "short words": (lambda t: t.update({DOWN + ".weight": t[DOWN + ".weight"][:, :-1].contiguous()}),
                    r"tensor '" + DOWN + r"\.weight' has 15 words a row"),
}
CONFIG_CASES = {
    "block does not divide": (_block("model.layers.0.mlp.down_proj", 512),
                              r"config\.json: modules entry 'model\.layers\.0\.mlp\.down_proj' has block 512, which "
                              r"does not divide the input width 256 of tensor '" + DOWN + r"\.weight'"),
    "block not a power of two": (_block("model.layers.0.mlp.down_proj", 96),
                                 r"config\.json: modules\[\d+\]: 'model\.layers\.0\.mlp\.down_proj' has block 96"),
    "module listed twice": (_modules(lambda records: records.append(dict(records[0]))), r"is listed twice"),
    "a packed matrix left out": (_modules(lambda records: records.remove(
                                     next(r for r in records if r["path"] == "lm_head"))),
                                 r"tensor 'language_model\.lm_head\.\w+' is packed, but config\.json's modules "
                                 r"does not list 'lm_head'"),
    "wrong schema": (lambda config: config.update(schema_version=1), r"config\.json: schema_version is 1"),
}
HADAMARD_CASES = {
    "signs disagree": (lambda h: h["prism.hadamard.sign_values"].__setitem__(0, -h["prism.hadamard.sign_values"][0]),
                       r"hadamard\.json: prism\.hadamard\.sign_values declares .* at 0 of width \d+, "
                       r"but tensor '.*\.signs' has"),
    "a rotated matrix left out": (lambda h: h["prism.hadamard.weight_names"].remove(DOWN + ".weight"),
                                  r"hadamard\.json: prism\.hadamard\.weight_names leaves out '" + DOWN + r"\.weight'"),
    "block size differs": (lambda h: h.update({"prism.hadamard.block_size": 32}),
                           r"hadamard\.json: prism\.hadamard\.block_size is 32, but modules gives"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_malformed_tensors_are_refused_naming_the_tensor(broken, case):
    edit, match = TENSOR_CASES[case]
    edit_tensors(broken, edit)
    with pytest.raises(InputError, match=match) as raised:
        prism.read_pack(broken)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_malformed_configs_are_refused_naming_the_field(broken, case):
    edit, match = CONFIG_CASES[case]
    edit_json(broken / "config.json", edit)
    with pytest.raises(InputError, match=match) as raised:
        prism.read_pack(broken)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("case", list(HADAMARD_CASES))
def test_a_hadamard_json_that_disagrees_is_refused(broken, case):
    edit, match = HADAMARD_CASES[case]
    edit_json(broken / "hadamard.json", edit)
    with pytest.raises(InputError, match=match) as raised:
        prism.read_pack(broken)
    assert "\n" not in str(raised.value)


def test_gguf_packs_are_refused_by_name(tmp_path):
    gguf = tmp_path / "Ternary-Bonsai-2-27B-PQ2_0.gguf"
    gguf.write_bytes(b"GGUF")
    refusal = r"Ternary-Bonsai-2-27B-PQ2_0\.gguf: GGUF packs are not read; use the MLX pack " \
              r"prism-ml/Ternary-Bonsai-2-27B-mlx-2bit instead"
    with pytest.raises(InputError, match=refusal):
        prism.read_pack(gguf)
    with pytest.raises(InputError, match=refusal):
        prism.read_pack(tmp_path)


def test_a_sharded_pack_reads_the_same(written, pack, tmp_path):
    """Each tensor is read from the shard that holds it (here a module's parts are spread over two shards)."""
    tensors = load_file(str(written[0] / "pack" / "model.safetensors"))
    sharded = tmp_path / "pack"
    shutil.copytree(written[0] / "pack", sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    shards = {name: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, name in enumerate(sorted(tensors))}
    for shard in set(shards.values()):
        save_file({n: t for n, t in tensors.items() if shards[n] == shard}, str(sharded / shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    again = prism.read_pack(sharded)
    assert len({m.file for m in again.modules.values()}) == 2
    for path, module in again.modules.items():
        assert torch.equal(prism.unfold(module), prism.unfold(pack.modules[path])), path


def test_the_unfolded_checkpoint_is_the_stock_hf_form_of_the_pack(written, pack, tmp_path):
    """``write_unfolded`` gives back the writer's unfolded checkpoint: every tensor bit for bit (the logical weights,
    conv1d as [C, 1, K], the vision tower) but the zero-centred norms, whose multiplier 1 + w (what transformers
    computes with, in fp32) is the writer's bit for bit: the pack stores fl(1 + w), whose w is not recoverable, and
    fl(1 + (s - 1)) = s; and its config.json."""
    root, _ = written
    out = prism.write_unfolded(pack, tmp_path / "unfolded")
    expected, found = load_file(str(root / "unfolded" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(found) == sorted(expected)
    offset_norms = [k for k in expected if k.endswith(prism.OFFSET_NORMS) and expected[k].dim() == 1]
    assert len(offset_norms) == 2 * 2 + 1 + 2  # two norms a layer, the final norm, one attention layer's q/k norms
    for key, tensor in expected.items():
        assert found[key].dtype == tensor.dtype, key
        if key in offset_norms:
            assert torch.equal(1.0 + found[key], 1.0 + tensor), key
        else:
            assert torch.equal(found[key], tensor), key
    assert json.loads((out / "config.json").read_text()) == json.loads((root / "unfolded" / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (root / "pack" / "tokenizer.json").read_bytes()


def test_the_view_reads_what_the_unfolded_checkpoint_stores(written, pack, tmp_path):
    """A pack too large to unfold in memory is read through its view: every tensor ``UnfoldedPack`` computes (whole,
    or a range of rows) is ``write_unfolded``'s bit for bit, with the same names and shapes; the view writes no
    weights, and one whose pack is gone is refused naming the view."""
    from convert.inputs.checkpoint import checkpoint_shapes, open_checkpoint
    from convert.inputs.sources import tensor_shapes

    stored = prism.write_unfolded(pack, tmp_path / "unfolded")
    view = prism.write_view(pack, tmp_path / "view")
    assert not list(view.glob("*.safetensors"))
    assert (view / "config.json").read_text() == (stored / "config.json").read_text()
    expected = load_file(str(stored / "model.safetensors"))
    assert checkpoint_shapes(view) == tensor_shapes(stored) == {k: tuple(t.shape) for k, t in expected.items()}
    reader = open_checkpoint(view)
    assert isinstance(reader, prism.UnfoldedPack)
    for key, tensor in expected.items():
        assert torch.equal(reader.get(key), tensor), key
        assert torch.equal(reader.rows(key, 1, 3), tensor[1:3]), key
    moved = tmp_path / "moved"
    shutil.copytree(view, moved)
    (moved / prism.VIEW_FILE).write_text(json.dumps({"pack": str(tmp_path / "nowhere")}))
    with pytest.raises(InputError, match=f"{moved / prism.VIEW_FILE}: the pack it unfolds"):
        open_checkpoint(moved)


def test_a_pack_over_the_memory_limit_is_unfolded_as_a_view(written, tmp_path):
    """``unfolded_snapshot`` writes the full unfolded checkpoint when its fp32 weights fit ``max_bytes``, else the view;
    the pack stays the snapshot's source either way."""
    from convert.inputs.recipe import Quantization
    from convert.inputs.sources import Snapshot

    snapshot = Snapshot("path:pack", written[0] / "pack")
    quant = Quantization(method="exact")
    whole = prism.unfolded_snapshot(snapshot, quant, "r.yaml", 1e12, tmp_path / "cache")
    viewed = prism.unfolded_snapshot(snapshot, quant, "r.yaml", 1e3, tmp_path / "cache")
    assert (whole.directory / "model.safetensors").is_file() and not (whole.directory / prism.VIEW_FILE).exists()
    assert (viewed.directory / prism.VIEW_FILE).is_file() and not list(viewed.directory.glob("*.safetensors"))
    assert whole.source == viewed.source == written[0] / "pack"
