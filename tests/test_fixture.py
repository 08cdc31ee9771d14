"""The shipped fixture target: loads with plain transformers, and the export modules match it on held-out text."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models.qwen3 import Qwen3Args
from convert.weights.target import build_modules
from fixtures import corpus

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3"
TOKENS = 256


@pytest.fixture(scope="module")
def held_out_ids() -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    text = corpus.read_split("eval")[0].text  # read_split checks every file against the corpus manifest
    ids = tokenizer(text).input_ids[:TOKENS]
    assert len(ids) == TOKENS and ids[0] == tokenizer.bos_token_id
    return ids


def test_fixture_loads_with_transformers():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE)
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    assert sum(p.numel() for p in model.parameters()) == 13_112_576
    assert model.config.tie_word_embeddings is False and model.config.head_dim * 8 != model.config.hidden_size
    assert len(tokenizer) == 8192
    assert tokenizer.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]) == [0, 1, 2, 3]
    code = "def f(x):\n\treturn {'a': [1, 2]}  # é 你好\n"
    assert tokenizer.decode(tokenizer(code, add_special_tokens=False).input_ids) == code


def test_export_modules_match_fixture_on_held_out_tokens(held_out_ids):
    reference = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = reference(torch.tensor([held_out_ids])).logits[0]
    args = Qwen3Args.from_config(read_json(FIXTURE / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=64, verify=8), context=512)
    modules = build_modules(args, target, load_tensors(FIXTURE), torch.float32)

    got = torch.empty_like(ref_logits)
    for p0 in (0, 64):  # prefill chunks
        got[p0 : p0 + 64] = modules.call("prefill", held_out_ids[p0 : p0 + 64], range(p0, p0 + 64))["logits"][0]
    for p in range(128, 136):  # decode steps
        got[p] = modules.call("decode", [held_out_ids[p]], [p])["logits"][0, 0]
    modules.call("verify", [5] * 8, range(136, 144))  # a rejected draft: rewound below, rows 136..143 stale
    for p0 in range(136, TOKENS, 8):  # verify blocks over the true continuation
        got[p0 : p0 + 8] = modules.call("verify", held_out_ids[p0 : p0 + 8], range(p0, p0 + 8))["logits"][0]

    assert (got - ref_logits).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), ref_logits.argmax(-1))
