"""Bytes read per call (``convert.runtime.economics``): the meter against tensors whose reads are known, a real target's
decode call against its shipped sizes, and the cost model's arithmetic."""

import math

import pytest
import torch

from convert.export.functions import compute_copy
from convert.export.quantized import apply_quantized, shipped_nbytes
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models import read_args
from convert.runtime.economics import (
    MeteredFunctions,
    Priced,
    _ReadMeter,
    cost_model,
    ngram_speedup,
    round_drafter_bytes,
)
from convert.runtime.host import TargetDriver
from convert.weights.quantize import round_to_nearest
from convert.weights.target import build_modules
from tests.helpers.qwen3_5_checkpoints import write_small_target

STATE_BYTES = {"float16": 2, "float32": 4}


def metered(priced: dict, fn) -> dict[str, int]:
    with _ReadMeter({t.untyped_storage().data_ptr(): p for t, p in priced.items()}) as meter:
        fn()
    return meter.bytes_read()


def test_a_gather_reads_only_its_distinct_rows():
    table = torch.randn(100, 8)
    ids = torch.tensor([[3, 7, 3, 99]])
    read = metered({table: Priced("weights", 0.5)}, lambda: torch.nn.functional.embedding(ids, table))
    assert read == {"weights": 3 * 8 * 0.5, "states": 0}
    read = metered({table: Priced("weights", 2)}, lambda: table[torch.tensor([5, 5, 6])])
    assert read["weights"] == 2 * 8 * 2


def test_a_matmul_reads_the_whole_weight_and_a_slice_only_its_elements():
    weight, state = torch.randn(16, 8), torch.randn(4, 10)
    read = metered({weight: Priced("weights", 2)}, lambda: torch.nn.functional.linear(torch.randn(1, 8), weight))
    assert read["weights"] == 16 * 8 * 2
    read = metered({state: Priced("states", 4)}, lambda: state[:, 2:5].sum())
    assert read == {"weights": 0, "states": 4 * 3 * 4}


def test_blocks_of_rows_are_counted_as_spans_and_other_views_in_a_mask():
    weight = torch.randn(64, 8)
    address = weight.untyped_storage().data_ptr()
    with _ReadMeter({address: Priced("weights", 2)}) as meter:
        for lo in range(0, 48, 16):  # F.linear reads each block transposed: rows lo..lo+15 in another order
            torch.nn.functional.linear(torch.randn(1, 8), weight[lo : lo + 16])
        weight[40:56].sum()  # overlaps the last block by 8 rows
        torch.index_select(weight, 0, torch.tensor([60, 60]))
    assert address not in meter.masks and meter.elements_read(address) == 57 * 8
    assert meter.bytes_read()["weights"] == 57 * 8 * 2
    with _ReadMeter({address: Priced("weights", 2)}) as meter:
        weight[:16].sum()
        weight[:, 2:5].sum()  # strided: a mask, counted once with the span
    assert address in meter.masks and meter.elements_read(address) == 16 * 8 + 48 * 3


def test_a_write_is_not_a_read():
    state = torch.zeros(4, 10)

    def write():
        state[0:1] = torch.ones(1, 10)
        state.index_copy_(0, torch.tensor([2]), torch.ones(1, 10))

    assert metered({state: Priced("states", 2)}, write) == {"weights": 0, "states": 0}


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def shipped(request, tmp_path_factory):
    """A target's fp16 shipping modules, one linear LUT4-quantized (priced packed: 4-bit codes plus its tables)."""
    directory = tmp_path_factory.mktemp("econ") / "t"
    write_small_target(directory, request.param)
    args = read_args(read_json(directory / "config.json"))
    spec = Target(source="path:x", graphs=Graphs(prefill=8, verify=5), context=96, taps=[0, 1])
    modules = build_modules(args, spec, load_tensors(directory), torch.float16)
    down = modules.core.layers[0].mlp.down_proj
    apply_quantized(modules.core, {"layers.0.mlp.down_proj": round_to_nearest("lut4", down.weight.detach(), 16)})
    return modules


def test_a_decode_call_reads_every_weight_as_shipped_but_the_unused_table_rows(shipped):
    compute = compute_copy(shipped, torch.float32)
    log: list = []
    functions = MeteredFunctions(compute, shipped, "target", log)
    target = TargetDriver(functions, compute.widths, compute.contract)
    target.greedy([5, 6, 7, 8, 9, 10, 11], 3)
    assert [function for _, function, _ in log] == ["prefill", "decode", "decode"]
    assert log[1][2] == log[2][2]
    down = compute.core.layers[0].mlp.down_proj.weight
    packed = shipped.core.layers[0].mlp.down_proj.shipped_nbytes()
    assert functions.priced[down.untyped_storage().data_ptr()].bytes_per_element == packed / down.numel()
    with _ReadMeter(functions.priced) as meter:
        compute.call("decode", **target.inputs("decode", [3], 9))  # after 7 + 2 positions
    embed = compute.core.embed_tokens.weight
    for name, weight in compute.core.named_parameters():  # the checkpoint's tensors: all read but one table
        read = meter.elements_read(weight.untyped_storage().data_ptr())
        assert read == (embed.shape[1] if weight is embed else weight.numel()), name
    _, spec = next(iter(shipped.functions.values()))
    states = sum(math.prod(s.shape) * STATE_BYTES[s.dtype] for s in spec.states)  # a static graph reads them all
    assert meter.bytes_read()["states"] == log[1][2]["states"] == states


@pytest.mark.parametrize("shipped", ["dense"], indirect=True)  # its only buffers are the rotary tables
def test_a_dense_decode_call_reads_the_shipped_bytes_less_the_unused_rows(shipped):
    core = shipped.core
    compute = compute_copy(shipped, torch.float32)
    log: list = []
    target = TargetDriver(MeteredFunctions(compute, shipped, "target", log), compute.widths, compute.contract)
    target.greedy([5, 6, 7], 2)
    embed, cos, sin = core.embed_tokens.weight, core.rope_cos, core.rope_sin
    # one token: one row of the embedding table and of each rotary table (by position); all else in full
    expected = (shipped_nbytes(core, set()) - embed.nbytes - cos.nbytes - sin.nbytes
                + embed[0].nbytes + cos[0].nbytes + sin[0].nbytes)
    assert log[1][2]["weights"] == expected


def test_cost_model_arithmetic():
    read = {"weights": 900, "states": 100}
    log = [("target", "prefill", read), ("drafter", "context_update", {"weights": 30, "states": 0}),
           ("drafter", "draft", {"weights": 40, "states": 10}), ("target", "verify", {"weights": 900, "states": 150}),
           ("drafter", "context_append", {"weights": 30, "states": 0}),
           ("drafter", "draft", {"weights": 40, "states": 10}), ("target", "verify", {"weights": 900, "states": 150}),
           ("drafter", "context_append", {"weights": 10, "states": 0}),
           ("drafter", "draft", {"weights": 40, "states": 10}), ("target", "verify", {"weights": 900, "states": 150}),
           ("target", "decode", read)]
    assert round_drafter_bytes(log) == ((80 + 60) / 2, {"context_append": 1, "draft": 1})
    model = cost_model(log, tokens_per_round=3.0)
    assert model["verify_cost"] == 1.05 and model["draft_cost"] == 0.07
    assert model["predicted_speedup"] == pytest.approx(3.0 / 1.12)
    assert model["bytes_per_call"]["target.verify"] == {"calls": 3, "weights": 900, "states": 150, "total": 1050}
    stats = {"tokens": 30, "verify_calls": 8, "decode_calls": 6}
    assert ngram_speedup(stats, 1.05) == pytest.approx(30 / (8 * 1.05 + 6))
