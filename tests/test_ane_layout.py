"""The ane layout (``layout: ane``): functions without states over the host's history, the host's buffers
(``convert.runtime.host.HostOwned``), and arithmetic that stays finite in fp16."""

import numpy as np
import pytest
import torch

from convert.export.ane import rms_norm
from convert.export.spec import FunctionSpec, TensorSpec
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models.qwen3 import Qwen3Args
from convert.models.qwen3.core import RMSNorm
from convert.runtime.host import HostOwned, ModuleFunctions, TargetDriver, host_owned, table_lookup
from convert.weights.target import build_modules
from manifests.schema import HostContract
from tests.helpers.checkpoints import write_checkpoint


def _modules(tmp_path, layout: str, dtype=torch.float32, **variant):
    write_checkpoint(tmp_path / "ckpt", **variant)
    args = Qwen3Args.from_config(read_json(tmp_path / "ckpt" / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=64, taps=[1, 0], layout=layout)
    return build_modules(args, target, load_tensors(tmp_path / "ckpt"), dtype)


def test_ane_functions_keep_no_state_and_return_their_rows(tmp_path):
    modules = _modules(tmp_path, "ane")
    args = modules.core.args
    HostContract.model_validate(modules.contract)
    assert set(modules.contract["buffers"]) == {"key_history", "value_history"}
    assert modules.contract["positions"] == {"rope_theta": args.rope_theta, "rotary_dim": args.head_dim, "first_row": 0}
    history = (args.num_hidden_layers, args.num_key_value_heads, 64, args.head_dim)
    for name, (_, spec) in modules.functions.items():
        assert spec.states == ()
        inputs = {t.name: t.shape for t in spec.inputs}
        outputs = {t.name: t.shape for t in spec.outputs}
        assert inputs["key_history"] == inputs["value_history"] == history
        assert "position_ids" not in inputs and inputs["history_mask"] == (1, 64)  # positions: the host's
        assert inputs["rope_cos"] == inputs["rope_sin"] == (spec.width, args.head_dim // 2)
        assert "input_ids" not in inputs and inputs["hidden_states"] == (1, spec.width, args.hidden_size)  # looked up
        assert "argmax_ids" not in outputs and outputs["logits"] == (1, spec.width, args.vocab_size)  # host's argmax
        rows = (args.num_hidden_layers, args.num_key_value_heads, spec.width, args.head_dim)
        assert outputs["key_rows"] == outputs["value_rows"] == rows, name


def test_ane_greedy_equals_stateful_and_its_history_the_states(tmp_path):
    """Through the host (prefill chunks, decode, a verify rolled back to 3 accepted): the same ids, logits within
    fp32 rounding, and the host's history equal to the stateful package's KV states."""
    stateful, ane = (ModuleFunctions(_modules(tmp_path / layout, layout)) for layout in ("stateful", "ane"))
    widths = {"prefill": 16, "decode": 1, "verify": 8}
    contracts = [f.modules.contract for f in (stateful, ane)]
    drivers = [TargetDriver(f, widths, c) for f, c in zip((stateful, ane), contracts, strict=True)]
    prompt = list(range(5, 25))
    greedy = [d.greedy(prompt, 12)[0] for d in drivers]
    assert greedy[0] == greedy[1]
    for d in drivers:
        d.run("verify", [greedy[0][-1], 7, 8, 9, 10, 11, 12, 13], len(prompt) + 11)
    outs = [d.run("verify", [3, 4, 5, 6], len(prompt) + 14) for d in drivers]  # accepted 3 of 8
    assert np.array_equal(outs[0]["argmax_ids"], outs[1]["argmax_ids"])
    states, history = stateful.states(), ane.states()
    used = len(prompt) + 18
    for state, buffer in (("key_cache", "key_history"), ("value_cache", "value_history")):
        assert np.abs(states[state][:, :, :used] - history[buffer][:, :, :used]).max() < 1e-5


@pytest.mark.parametrize("on", [None, torch.device("cpu")], ids=["numpy", "tensors"])
def test_host_buffers_write_rows_at_positions_and_ring_slots(on):
    """``on``: the buffers held as tensors (``HostOwned.on``), the rows returned as tensors."""
    spec = FunctionSpec("step", (TensorSpec("position_ids", (1, 3), "int32"), TensorSpec("ring", (1, 4, 2), "float32")),
                        (TensorSpec("ring_rows", (1, 3, 2), "float32"),))

    class Echo:
        def call(self, function, inputs):
            rows = np.arange(6, dtype=np.float32).reshape(1, 3, 2) + 100 * inputs["position_ids"][0, 0]
            return {"ring_rows": rows if on is None else torch.from_numpy(rows)}

        def reset(self):
            pass

    host = HostOwned(Echo(), {"step": spec}, {"buffers": {"ring": {"rows": "ring_rows", "axis": 1, "ring": 4}}}, on=on)
    assert host.call("step", {"position_ids": np.array([[3, 4, 5]], np.int32)}) == {}
    assert isinstance(host.buffers["ring"], np.ndarray if on is None else torch.Tensor)
    ring = host.states()["ring"][0]
    assert ring.tolist() == [[302, 303], [304, 305], [0, 0], [300, 301]]  # slots 3, 0, 1 = positions mod 4
    flat = HostOwned(Echo(), {"step": spec}, {"buffers": {"ring": {"rows": "ring_rows", "axis": 1}}}, on=on)
    flat.call("step", {"position_ids": np.array([[2, 3, 4]], np.int32)})
    assert flat.states()["ring"][0].tolist() == [[0, 0], [0, 0], [200, 201], [202, 203]]  # position 4: past, dropped
    plain = Echo()  # a part without layers takes no buffer: driven as it is
    assert host_owned(plain, {"step": spec}, {"buffers": {"kv": {"rows": "kv_rows", "axis": 2}}}) is plain


def test_the_host_looks_up_embedding_rows_and_takes_the_argmax():
    """A package that takes the host's rows gets the table's rows of the call's ids; its head's logits come back with
    the argmax a package computes (the first of equal maxima; a split head's counted from its first row, with its best
    logit)."""
    spec = FunctionSpec("step", (TensorSpec("hidden_states", (1, 3, 2), "float16"),),
                        (TensorSpec("logits", (1, 3, 4), "float16"),))
    seen = {}

    class Head:
        def call(self, function, inputs):
            seen.update(inputs)
            return {"logits": np.array([[[0, 5, 5, 1], [2, 0, 0, 0], [0, 0, 1, 3]]], np.float16)}

        def reset(self):
            pass

    table = np.arange(20, dtype=np.float16).reshape(10, 2)
    contract = {"embedding": {"input": "hidden_states", "file": "embeddings.safetensors"}, "argmax": "host"}
    host = host_owned(Head(), {"step": spec}, contract, table_lookup(table), split_head=(100, 104))
    rows_ids = np.array([[7, 0, 7]], np.int32)
    out = host.call("step", {"input_ids": rows_ids, "position_ids": np.zeros((1, 3), np.int32)})
    assert set(seen) == {"hidden_states"} and seen["hidden_states"].tolist() == [[[14, 15], [0, 1], [14, 15]]]
    assert out["argmax_ids"].tolist() == [[101, 100, 103]] and out["argmax_ids"].dtype == np.int32
    assert out["max_logit"].tolist() == [[5, 2, 3]]
    whole = host_owned(Head(), {"step": spec}, contract, table_lookup(table)).call("step", {"input_ids": rows_ids})
    assert whole["argmax_ids"].tolist() == [[1, 0, 3]] and "max_logit" not in whole
    rows = np.ones((1, 3, 2), np.float16)  # a later part: the previous part's rows, not a lookup
    host.call("step", {"hidden_states": rows, "input_ids": np.zeros((1, 3), np.int32)})
    assert seen["hidden_states"] is rows
    with pytest.raises(ValueError, match="no embedding table"):
        host_owned(Head(), {"step": spec}, contract).call("step", {"input_ids": np.zeros((1, 3), np.int32)})


def test_the_host_writes_leading_rows_whole_buffers_and_commit_inputs():
    """A hybrid's buffers: pending rows at the leading rows, the committed state replacing the buffer; the commit
    inputs from a count: a mask of the rows below it and the one-hot rows of the conv history after them."""
    from convert.runtime.host import commit_inputs, write

    pending = np.zeros((1, 4, 2), np.float32)
    write(pending, np.ones((1, 2, 2), np.float32), {"axis": 1, "write": "leading"}, None)
    assert pending[0].tolist() == [[1, 1], [1, 1], [0, 0], [0, 0]]
    state = np.zeros((2, 2), np.float32)
    write(state, np.full((2, 2), 3, np.float32), {"axis": 0, "write": "whole"}, None)
    assert state.tolist() == [[3, 3], [3, 3]]
    spec = FunctionSpec("verify", (TensorSpec("commit_mask", (1, 4), "float16"),
                                   TensorSpec("commit_select", (2, 6), "float16")), ())
    got = commit_inputs(spec, {"mask": "commit_mask", "select": "commit_select"}, 3)
    assert got["commit_mask"].tolist() == [[1, 1, 1, 0]] and got["commit_mask"].dtype == np.float16
    assert got["commit_select"].tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0]]  # window rows 3 and 4


def test_hybrid_ane_functions_match_the_stateful_ones(tmp_path):
    """The hybrid target in both layouts through the host (prefill chunks, decodes, verifies kept 3, 0 and all 8 by
    the next call): the same ids, logits within fp32 rounding, and the host's buffers equal to the stateful states."""
    from convert.models import read_args
    from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

    write_hybrid(tmp_path / "ckpt")
    args = read_args(read_json(tmp_path / "ckpt" / "config.json"))
    functions = {}
    for layout in ("stateful", "ane"):
        target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=128, taps=[1, 0], logits=True,
                        layout=layout)
        functions[layout] = ModuleFunctions(build_modules(args, target, load_tensors(tmp_path / "ckpt"),
                                                          torch.float32))
    spec = functions["ane"].modules.functions["verify"][1]
    assert spec.states == () and {"conv_state", "commit_select", "hidden_states"} <= {t.name for t in spec.inputs}
    assert "recurrent_state_next" in {t.name for t in spec.outputs}
    widths = {"prefill": 16, "decode": 1, "verify": 8}
    drivers = {k: TargetDriver(f, widths, f.modules.contract) for k, f in functions.items()}
    ids = torch.randint(4, args.vocab_size, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    script = [("prefill", ids[0:16], 0), ("prefill", ids[16:21], 16), *(("decode", [ids[p]], p) for p in (21, 22)),
              ("verify", ids[23:31], 23), ("verify", ids[26:34], 26), ("verify", ids[26:34], 26),
              ("decode", [ids[40]], 34)]
    worst = 0.0
    for function, tokens, p0 in script:
        out = {k: d.run(function, tokens, p0) for k, d in drivers.items()}
        assert np.array_equal(out["stateful"]["argmax_ids"], out["ane"]["argmax_ids"]), (function, p0)
        worst = max(worst, float(np.abs(out["stateful"]["logits"] - out["ane"]["logits"]).max()))
    assert worst < 1e-4, worst
    states, buffers = functions["stateful"].states(), functions["ane"].states()
    names = {"key_cache": "key_history", "value_cache": "value_history"}
    assert len(states) == len(buffers) == 6
    for name, state in states.items():
        assert np.abs(state - buffers[names.get(name, name)]).max() < 1e-4, name


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("tensors", [False, True], ids=["numpy", "tensors"])
def test_a_ladder_entry_computes_what_the_full_context_computes(tmp_path, kind, tensors):
    """``ladder: [32]`` under context 64: the host calls the 32-row entries while a call's rows fit them (passing the
    buffers' leading rows) and the full ones after; logits and the host's buffers equal the single-context modules'.
    ``tensors``: the laddered host holds its buffers as tensors where the modules compute (``ModuleFunctions``'s on an
    accelerator), here on the CPU against the numpy host."""
    from convert.models import read_args
    from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

    (write_checkpoint if kind == "dense" else write_hybrid)(tmp_path / "ckpt")
    args = read_args(read_json(tmp_path / "ckpt" / "config.json"))
    called, functions = [], {}
    for ladder in ([], [32]):
        target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=64, logits=True, layout="ane",
                        ladder=ladder)
        modules = build_modules(args, target, load_tensors(tmp_path / "ckpt"), torch.float32)
        functions[len(ladder)] = ModuleFunctions(modules, tensors=tensors and bool(ladder))
    assert all(isinstance(b, torch.Tensor) == tensors for b in functions[1].host_buffers().values())
    laddered = functions[1].modules
    assert {"prefill_32", "decode_32", "verify_32"} <= set(laddered.functions)
    assert laddered.contract["ladder"] == [32] and laddered.functions["verify_32"][1].width == 8
    calls = functions[1].driven.functions
    original = calls.call
    calls.call = lambda name, given: called.append(name) or original(name, given)
    widths = {"prefill": 16, "decode": 1, "verify": 8}
    drivers = [TargetDriver(f, widths, f.modules.contract) for f in (functions[0], functions[1])]
    ids = torch.randint(4, args.vocab_size, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    script = [("prefill", ids[0:16], 0), ("prefill", ids[16:20], 16), ("verify", ids[20:28], 20),
              ("verify", ids[22:30], 22), ("decode", [ids[30]], 30), ("verify", ids[31:39], 31), ("decode", [7], 39)]
    for function, tokens, p0 in script:
        plain, rung = (d.run(function, tokens, p0) for d in drivers)
        assert np.abs(plain["logits"] - rung["logits"]).max() < 1e-5, (function, p0)
    assert called == ["prefill_32", "prefill_32", "verify_32", "verify_32", "decode_32", "verify", "decode"]
    for name, buffer in functions[0].states().items():
        assert np.abs(buffer - functions[1].states()[name]).max() < 1e-5, name


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_host_buffers_held_as_tensors_compute_what_numpy_buffers_compute(tmp_path, kind):
    """The host's buffers as tensors where the modules compute (what ``ModuleFunctions`` holds on an accelerator) and
    as numpy arrays: through prefill chunks, decodes and verifies rolled back, the same logits and ids, bit for bit,
    and the same buffers."""
    from convert.models import read_args
    from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

    (write_checkpoint if kind == "dense" else write_hybrid)(tmp_path / "ckpt")
    args = read_args(read_json(tmp_path / "ckpt" / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=64, logits=True, layout="ane")
    modules = build_modules(args, target, load_tensors(tmp_path / "ckpt"), torch.float32)
    hosts = [ModuleFunctions(modules, tensors=tensors) for tensors in (False, True)]
    drivers = [TargetDriver(h, modules.widths, modules.contract) for h in hosts]
    ids = torch.randint(4, args.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    script = [("prefill", ids[0:16], 0), ("prefill", ids[16:21], 16), ("decode", [ids[21]], 21),
              ("verify", ids[22:30], 22), ("verify", ids[25:33], 25), ("decode", [ids[33]], 33)]
    for function, tokens, p0 in script:
        numpy_out, tensor_out = (d.run(function, tokens, p0) for d in drivers)
        assert set(numpy_out) == set(tensor_out) and all(isinstance(v, np.ndarray) for v in tensor_out.values())
        for name, value in numpy_out.items():
            assert np.array_equal(value, tensor_out[name]), (function, p0, name)
    numpy_buffers, tensor_buffers = (h.states() for h in hosts)
    assert len(numpy_buffers) == (2 if kind == "dense" else 6)
    for name, buffer in numpy_buffers.items():
        assert np.array_equal(buffer, tensor_buffers[name]), name


def test_a_ladder_is_the_ane_layouts_and_lies_below_the_context():
    for ladder, layout, message in (([32], "stateful", "ladder is the ane layout"), ([64], "ane", "ladder: 64 is not"),
                                    ([4], "ane", "ladder: 4 is not"), ([48, 32], "ane", "smallest first")):
        with pytest.raises(ValueError, match=message):
            Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=64, layout=layout, ladder=ladder)


def test_the_economics_count_the_host_buffers_as_states(tmp_path):
    """What a call reads (``accept``'s cost model): in the ane layout the host's buffers the call takes are its states'
    bytes (the history a stateful call reads from its states), priced as the shipped fp16 functions take them while
    an fp32 compute copy runs."""
    from convert.export.functions import compute_copy
    from convert.runtime.economics import MeteredFunctions

    modules, log = _modules(tmp_path, "ane", torch.float16), []
    compute = compute_copy(modules, torch.float32, share_weights=True)
    driver = TargetDriver(MeteredFunctions(compute, modules, "target", log), modules.widths, modules.contract)
    driver.prefill(list(range(5, 25)))
    driver.run("verify", list(range(30, 38)), 20)
    history = sum(t.nbytes for t in modules.functions["verify"][1].inputs if t.name in ("key_history", "value_history"))
    assert [(side, function, read["states"]) for side, function, read in log] == [
        ("target", "prefill", history), ("target", "prefill", history), ("target", "verify", history)]
    assert all(read["weights"] > 0 for _, _, read in log)


def test_ane_rms_norm_stays_finite_in_fp16():
    """A hidden row of values near 400: their squares pass fp16's 65504, so a norm that squares them in fp16 gives
    0; the ane form divides by the row's largest magnitude first and matches the fp32 norm."""
    norm = RMSNorm(256, 1e-6)
    norm.weight.data.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(0))
    x = torch.empty(1, 256, 1, 4).uniform_(-420, 420, generator=torch.Generator().manual_seed(1))
    naive = x.half() * torch.rsqrt(x.half().pow(2).mean(1, keepdim=True) + 1e-6)
    assert not torch.isfinite(x.half().pow(2).mean(1)).all() and (naive == 0).all()
    want = norm(x.transpose(1, 3)).transpose(1, 3)  # the stateful norm in fp32 over the channels
    got = rms_norm(norm.half(), x.half()).float()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() / want.abs().max() < 2e-3




def test_the_placement_lint_names_states_ops_dtypes_and_dims():
    from convert.verify.placement import lint

    history = TensorSpec("key_history", (2, 4, 65_530, 64), "float16")
    verify = FunctionSpec("verify", (TensorSpec("position_ids", (1, 8), "int32"), history),
                          (TensorSpec("logits", (1, 8, 70_000), "float16"),))
    decode = FunctionSpec("decode", (TensorSpec("position_ids", (1, 1), "int32"),),
                          (TensorSpec("hidden", (1, 1, 64), "float32"),),
                          (TensorSpec("key_cache", (2, 4, 64, 8), "float16"),))
    placed = {"conv2d", "softmax", "broadcasting_batch_matmul", "lut_to_dense", "constant", "output"}
    assert lint("coreai", {"verify": verify}, {"verify": placed}) == [
        "verify: logits [1, 8, 70000] has a dim over the ANE's 65,536"]
    found = lint("coreai", {"verify": verify, "decode": decode},
                 {"verify": placed, "decode": placed | {"scatter_nd", "gather_nd"}}, ("key_history",))
    assert len(found) == 6, found
    assert found[1].startswith("verify: key_history's rows and the call's (65,538) are one attention axis")
    assert found[2].startswith("decode: keeps 1 states (key_cache)")
    assert found[3].startswith("decode: op gather_nd: a lookup")
    assert found[4].startswith("decode: op scatter_nd: a state or buffer write")
    assert found[5] == "decode: hidden is float32 (forge's programs are fp16 throughout)"
    assert lint("coreml", {"decode": decode}, {"decode": {"conv", "clip", "inverse", "const"}})[1:] == [
        "decode: hidden is float32 (forge's programs are fp16 throughout)"]
    # each op explained by a word of its name, not a fragment ("broadcasting" holds "cast")
    explained = lint("coreai", {"verify": verify}, {"verify": placed | {"broadcasting_greater", "cast", "stack"}})
    assert explained[:3] == ["verify: op broadcasting_greater: an integer comparison (forge passes masks as fp16 "
                             "inputs)", "verify: op cast: a dtype conversion (forge's graphs are fp16 throughout, with "
                             "no integer arithmetic)", "verify: op stack: not an op of forge's program"]
