"""Parts: a target split into packages (embedding, layer chunks, vocabulary-split head) computes, chained, what the
whole target computes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from convert.errors import InputError
from convert.export.functions import compute_copy
from convert.export.quantized import apply_quantized
from convert.inputs.recipe import Graphs, Quantization, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models import read_args
from convert.models.part import Part
from convert.pipeline import partition as parts_module
from convert.pipeline.partition import part_bytes, piece_sizes, plan_parts
from convert.runtime.chain import module_chain
from convert.runtime.host import TargetDriver, module_driver
from convert.weights.shipped import part_modules
from convert.weights.target import build_modules
from quant.affine import quantize_affine
from quant.lut import quantize_lut
from tests.helpers.checkpoints import write_checkpoint as write_dense
from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

FP32_BOUND = 1e-5
GROUPS = {"lut4": 8, "affine4": 32}  # divide every width of the tiny models (the hybrid's in_proj_qkv has 136 rows)


def _target(limit: float, taps, method: str = "none", layout: str = "stateful") -> Target:
    return Target(source="path:x", graphs=Graphs(prefill=16, verify=4), context=64, taps=taps, logits=True,
                  hidden=True, max_part_mb=limit, layout=layout,
                  quantization=Quantization(method=method, group_size=GROUPS.get(method)))


def _limit_for(args, taps, method: str, layout: str = "stateful") -> float:
    """A limit that splits the tables along the vocabulary and the layers into several chunks."""
    sizes = piece_sizes(args, _target(1e6, taps, method, layout))
    return (2 * max(sizes.layers) + sizes.layer_constants) / 1e6


def _quantize(modules, method: str) -> None:
    """Round every 2-D weight of the core to ``method`` (the tables too: their vocabulary splits slice codes)."""
    rounding = {"lut4": lambda w: quantize_lut(w.float(), GROUPS["lut4"]),
                "affine4": lambda w: quantize_affine(w.float(), GROUPS["affine4"])}
    weights = {name: rounding[method](m.weight.detach()) for name, m in modules.core.named_modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and "in_proj_a" not in name
               and "in_proj_b" not in name}
    apply_quantized(modules.core, weights)


def _modules(tmp_path, kind: str, taps, method: str, layout: str = "stateful"):
    directory = tmp_path / kind
    if kind == "dense":
        write_dense(directory, num_hidden_layers=4)
    else:
        write_hybrid(directory, seed=1, num_hidden_layers=6, layer_types=["linear_attention"] * 2 + [
            "full_attention", "linear_attention", "full_attention", "linear_attention"])
    args = read_args(read_json(directory / "config.json"))
    target = _target(_limit_for(args, taps, method, layout), taps, method, layout)
    modules = build_modules(args, target, load_tensors(directory), torch.float16)
    if method != "none":
        _quantize(modules, method)
    return args, target, modules


def _calls(widths: dict[str, int], rollback: str, vocab: int):
    """A session's calls: a prompt over two prefill chunks (the last padded), decodes, a verify block, a rollback
    (a partial accept on a commit-next-call target) and the next verify and decode."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, vocab, (widths["prefill"] + 5,), generator=g).tolist()
    k = widths["verify"]
    yield "prefill", prompt[: widths["prefill"]], 0
    yield "prefill", prompt[widths["prefill"]:], widths["prefill"]
    p = len(prompt)
    for step in range(3):
        yield "decode", [prompt[step]], p + step
    p += 3
    yield "verify", prompt[:k], p
    kept = 1 if rollback == "positional" else k // 2
    yield "verify", prompt[k : 2 * k], p + kept
    yield "decode", [prompt[0]], p + kept + 1


@pytest.mark.parametrize(("kind", "taps", "method", "layout"), [
    ("dense", [2, 0], "affine4", "stateful"), ("hybrid", [4, 1], "lut4", "stateful"),
    ("hybrid", None, "none", "stateful"), ("dense", [2, 0], "affine4", "ane"), ("hybrid", [4, 1], "lut4", "ane")])
def test_the_chained_parts_compute_what_the_whole_target_computes(tmp_path, kind, taps, method, layout):
    """Parted equals whole in fp32; in the ane layout the host looks the first part's rows up (no embedding part),
    takes the argmax over the split head's logits and holds each part's history."""
    args, target, modules = _modules(tmp_path, kind, taps, method, layout)
    parts = plan_parts(args, target)
    layer_parts = [p for p in parts if p.layer_indices]
    tables = [p for p in parts if p.embedding]
    assert len(layer_parts) >= 2 and [p for p in parts if p.splits_head], [p.name for p in parts]
    if layout == "ane":
        assert tables == [parts[0]] == layer_parts[:1] and parts[0].embedding == (0, args.vocab_size)
    else:
        assert len(tables) >= 2, [p.name for p in parts]
    assert [i for p in layer_parts for i in p.layer_indices] == list(range(args.num_hidden_layers))
    for name in ("embedding", "head"):
        rows = [getattr(p, name) for p in parts if getattr(p, name)]
        assert rows[0][0] == 0 and rows[-1][1] == args.vocab_size
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))

    whole32 = compute_copy(modules, torch.float32)
    pieces32 = [compute_copy(m, torch.float32) for m in part_modules(modules, target, parts)]
    whole = module_driver(whole32)
    chained = TargetDriver(module_chain(parts, pieces32, taps), whole32.widths, whole32.contract)
    whole.reset()
    chained.reset()
    compared = 0
    for function, tokens, p0 in _calls(whole32.widths, modules.contract["rollback"], args.vocab_size):
        want, got = whole.run(function, tokens, p0), chained.run(function, tokens, p0)
        assert set(got) == set(want) - ({"taps"} if not taps else set()), sorted(got)
        np.testing.assert_array_equal(got["argmax_ids"], want["argmax_ids"])
        for name in ("logits", "hidden", *(("taps",) if taps else ())):
            assert np.abs(got[name] - want[name]).max() <= FP32_BOUND, (function, name)
        compared += len(tokens)
    assert compared == whole32.widths["prefill"] + 5 + 3 + 2 * whole32.widths["verify"] + 1
    # every state (or host buffer) of the whole target is the parts' of their own layers, in order
    states, held = whole.functions.states(), chained.functions.states()
    assert states
    for name, state in states.items():
        pieces = [held[f"{p.name}/{name}"] for p in layer_parts if f"{p.name}/{name}" in held]
        assert np.abs(np.concatenate(pieces) - state).max() <= FP32_BOUND, name


def test_an_ane_head_part_has_at_most_65536_rows():
    """The ane head returns logits, a dim per vocabulary row: past the ANE's 65,536 the head is split even when the
    whole target fits the part limit (the stateful one ships whole)."""
    from convert.models.qwen3 import Qwen3Args
    from tests.helpers.checkpoints import tiny_config

    args = Qwen3Args.from_config(tiny_config(vocab_size=150_000).to_dict())
    assert plan_parts(args, _target(2000, None)) == [Part.whole(args)]
    parts = plan_parts(args, _target(2000, None, layout="ane"))
    heads = [p.head for p in parts if p.head]
    assert [p.name for p in parts] == ["layers-0-2", "head-1of3", "head-2of3", "head-3of3"]
    assert heads[0][0] == 0 and heads[-1][1] == 150_000 and max(b - a for a, b in heads) <= 65_536
    assert all(a[1] == b[0] for a, b in zip(heads, heads[1:], strict=False))


def test_parts_respect_the_limit_and_hold_the_same_weights(tmp_path):
    args, target, modules = _modules(tmp_path, "hybrid", [4, 1], "lut4")
    limit = target.max_part_mb * 1e6
    sizes = piece_sizes(args, target)
    parts = plan_parts(args, target)
    built = part_modules(modules, target, parts)
    from convert.export.quantized import shipped_nbytes

    for part, m in zip(parts, built, strict=True):
        assert part_bytes(part, sizes) <= limit, part.name
        # the planned size is what the part's modules hold (weights packed, constants as stored)
        assert shipped_nbytes(m.core, set()) == part_bytes(part, sizes), part.name
    # one weight copy: a layer part computes with the whole core's tensors, not copies of them
    layer = next(m for p, m in zip(parts, built, strict=True) if p.layer_indices)
    first = next(p for p in parts if p.layer_indices).layers[0]
    whole_layer = modules.core.layers[first]
    assert layer.core.layers[0].mlp.down_proj is whole_layer.mlp.down_proj


def test_a_target_under_the_limit_is_one_whole_part(tmp_path):
    write_dense(tmp_path / "d", num_hidden_layers=2)
    args = read_args(read_json(tmp_path / "d" / "config.json"))
    assert plan_parts(args, _target(2000, None)) == [Part.whole(args)]


def test_a_layer_over_the_limit_is_refused_by_name(tmp_path):
    write_dense(tmp_path / "d", num_hidden_layers=2)
    args = read_args(read_json(tmp_path / "d" / "config.json"))
    sizes = piece_sizes(args, _target(1e6, None))
    with pytest.raises(InputError, match="target.max_part_mb: .* below decoder layer 0"):
        plan_parts(args, _target(sizes.layers[0] / 2e6, None))


def test_parts_are_sized_for_packaging_within_the_host_memory_budget(tmp_path):
    write_hybrid(tmp_path / "h", seed=1, num_hidden_layers=4)
    args = read_args(read_json(tmp_path / "h" / "config.json"))
    sizes = piece_sizes(args, _target(2000, None))
    layer = parts_module.PACKAGING_BYTES_PER_LAYER_WEIGHT * max(sizes.layer_weights)
    table = parts_module.PACKAGING_BYTES_PER_TABLE_WEIGHT * args.vocab_size * args.hidden_size
    room = 1.5 * layer  # packaging room for one and a half decoder layers
    assert table > 2 * room  # and less than half a vocabulary table
    # a budget over the whole target's in-memory build (its base is one process's) but a part limit just under its
    # size: parted, the room decides how finely
    budget = (parts_module.PARTED_BASE_BYTES + room) / 1e9
    whole_mb = sizes.total(args.vocab_size, args.tie_word_embeddings) / 1e6
    target = _target(0.99 * whole_mb, None).model_copy(update={"max_host_memory_gb": budget})
    assert abs(parts_module.packaging_room(target) - room) <= 1
    parts = plan_parts(args, target)
    assert all(parts_module.packaging_bytes(p, sizes) <= room for p in parts), [p.name for p in parts]
    assert [len(p.layer_indices) for p in parts if p.layer_indices] == [1] * args.num_hidden_layers
    row_cost = parts_module.PACKAGING_BYTES_PER_TABLE_WEIGHT * args.hidden_size
    rows = int(room // row_cost) // parts_module.ROW_ALIGN * parts_module.ROW_ALIGN
    assert len([p for p in parts if p.embedding]) == len([p for p in parts if p.head]) == \
        math.ceil(args.vocab_size / rows) >= 3


def test_a_host_memory_budget_below_the_base_is_refused_by_name(tmp_path):
    write_dense(tmp_path / "d", num_hidden_layers=2)
    args = read_args(read_json(tmp_path / "d" / "config.json"))
    target = _target(2000, None).model_copy(update={"max_host_memory_gb": 1})
    with pytest.raises(InputError, match="target.max_host_memory_gb: 1 GB is below"):
        plan_parts(args, target)
