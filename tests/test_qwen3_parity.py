"""The export modules against transformers' own forward, in fp32, through prefill, decode, verify and rollback."""

import numpy as np
import pytest
import torch

from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models.qwen3 import Qwen3Args
from convert.runtime.host import ModuleFunctions
from convert.weights.target import build_modules
from tests.helpers.checkpoints import write_checkpoint

PREFILL, VERIFY, CONTEXT = 16, 8, 128
TAPS = (1, 0)  # recipe order, deliberately not sorted


def _script(vocab: int):
    """(function, tokens, first position): prefills, decodes, verify, rollback + re-verify, rollback + decode."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(4, vocab, (96,), generator=g).tolist()
    b = torch.randint(4, vocab, (96,), generator=g).tolist()
    calls = [("prefill", a[0:16], 0), ("prefill", a[16:32], 16)]
    calls += [("decode", [a[p]], p) for p in range(32, 40)]
    calls += [("verify", a[40:48], 40)]
    calls += [("verify", b[43:51], 43)]  # accepted 3 of 8: rewind to 43, rows 48..50 rewritten
    calls += [("decode", [b[p]], p) for p in range(51, 60)]
    calls += [("decode", [a[55]], 55)]  # rewind to 55: rows 56..59 stale, masked
    calls += [("verify", b[56:64], 56), ("decode", [a[64]], 64), ("verify", a[65:73], 65)]
    return calls


def _call(functions: ModuleFunctions, name: str, tokens: list[int], p0: int) -> dict[str, torch.Tensor]:
    """One call through the host (``ModuleFunctions``: the ane layout's buffers kept and written by the host)."""
    inputs = {"input_ids": np.asarray([tokens], np.int32),
              "position_ids": np.arange(p0, p0 + len(tokens), dtype=np.int32)[None]}
    return {k: torch.as_tensor(v) for k, v in functions.call(name, inputs).items()}


@pytest.mark.parametrize("layout", ["stateful", "ane"])
@pytest.mark.parametrize(
    "variant",
    [
        dict(),  # v5 config, untied, GQA 4/2, head_dim 24 != 64/4
        dict(tie_word_embeddings=True),
        dict(v4_config=True),
        dict(num_key_value_heads=4, head_dim=16),  # MHA, head_dim == hidden/heads
    ],
    ids=["v5-untied-gqa", "tied", "v4-config", "mha"],
)
def test_export_modules_match_transformers(tmp_path, variant, layout):
    hf = write_checkpoint(tmp_path / "ckpt", **variant)
    args = Qwen3Args.from_config(read_json(tmp_path / "ckpt" / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=PREFILL, verify=VERIFY), context=CONTEXT, taps=list(TAPS),
                    layout=layout)
    modules = ModuleFunctions(build_modules(args, target, load_tensors(tmp_path / "ckpt"), torch.float32))

    committed: list[int] = []
    positions_checked = 0
    worst_logits = worst_taps = 0.0
    for name, tokens, p0 in _script(args.vocab_size):
        committed = committed[:p0] + tokens
        out = _call(modules, name, tokens, p0)
        with torch.no_grad():
            ref = hf(torch.tensor([committed]), output_hidden_states=True)
        rows = slice(p0, p0 + len(tokens))
        ref_logits = ref.logits[0, rows]
        worst_logits = max(worst_logits, (out["logits"][0] - ref_logits).abs().max().item())
        assert torch.equal(out["argmax_ids"][0].long(), ref_logits.argmax(-1)), f"argmax differs in {name} at {p0}"
        for k, layer in enumerate(TAPS):
            tap = out["taps"][0, :, k * args.hidden_size : (k + 1) * args.hidden_size]
            worst_taps = max(worst_taps, (tap - ref.hidden_states[layer + 1][0, rows]).abs().max().item())
        positions_checked += len(tokens)
    assert len(committed) >= 64 and positions_checked >= 64
    assert worst_logits < 1e-4, worst_logits
    assert worst_taps < 1e-4, worst_taps


def test_rollback_rows_are_never_read(tmp_path):
    """A verify after a rewind gives the same result whatever garbage the rejected rows hold."""
    write_checkpoint(tmp_path / "ckpt")
    args = Qwen3Args.from_config(read_json(tmp_path / "ckpt" / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=PREFILL, verify=VERIFY), context=CONTEXT)
    modules = build_modules(args, target, load_tensors(tmp_path / "ckpt"), torch.float32)
    tokens = list(range(10, 26))
    modules.call("prefill", tokens, list(range(16)))
    clean = modules.call("decode", [7], [10])["logits"]
    module, _ = modules.functions["decode"]
    module.key_cache[:, :, 11:].normal_()  # rows past the rewind point: stale by contract
    module.value_cache[:, :, 11:].normal_()
    assert torch.equal(modules.call("decode", [7], [10])["logits"], clean)


def test_rollback_rows_are_never_read_from_the_hosts_history(tmp_path):
    """The ane layout's rows at or past a call's first position (a rejected draft's, or padding) are never read
    either: the same logits whatever the host's history holds there."""
    write_checkpoint(tmp_path / "ckpt")
    args = Qwen3Args.from_config(read_json(tmp_path / "ckpt" / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=PREFILL, verify=VERIFY), context=CONTEXT, layout="ane")
    functions = ModuleFunctions(build_modules(args, target, load_tensors(tmp_path / "ckpt"), torch.float32))
    _call(functions, "prefill", list(range(10, 26)), 0)
    history = functions.states()
    kept = {k: v.copy() for k, v in history.items()}
    clean = _call(functions, "verify", list(range(30, 38)), 10)["logits"]
    for name, buffer in history.items():  # the verify wrote rows 10..17; put garbage in every row from 10 on
        buffer[...] = kept[name]
        buffer[:, :, 10:] = np.random.default_rng(0).normal(size=buffer[:, :, 10:].shape)
    assert torch.equal(_call(functions, "verify", list(range(30, 38)), 10)["logits"], clean)
