"""Calibration: seeded samples through the real tokenizer, and layer-sequential capture over the Qwen3 core (the
hybrid core's capture: tests/test_qwen3_5.py)."""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from convert.inputs.sources import load_tensors
from convert.models.qwen3 import Qwen3Args
from convert.models.qwen3.core import LINEAR_GROUPS, CausalRunner, Qwen3Core
from convert.weights.quantize import quantize_sequential
from quant.calibrate import each_linear, encode, fixture_corpus_text, sample_calibration
from quant.gptq import HessianAccumulator, gptq_quantize

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3"
LENGTH = 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


@pytest.fixture(scope="module")
def validation_text() -> str:
    return fixture_corpus_text("validation")


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return load_tensors(FIXTURE)


def fixture_core(tensors) -> Qwen3Core:
    """The fixture's first three layers (real weights, fp32): enough to chain layers, quick on 2 cores."""
    args = Qwen3Args.from_config(json.loads((FIXTURE / "config.json").read_text()))
    args = dataclasses.replace(args, num_hidden_layers=3)
    core = Qwen3Core(args, LENGTH, taps=(args.num_hidden_layers - 1,)).float().eval()
    core.load_weights(tensors)
    return core


def test_samples_are_seeded_windows_of_the_token_stream(tokenizer, validation_text):
    calib = sample_calibration(validation_text, tokenizer, n=8, length=64, seed=3)
    assert calib.tokens.shape == (8, 64) and calib.tokens.dtype == torch.int64
    assert calib.identity() == {
        "corpus_sha256": hashlib.sha256(validation_text.encode()).hexdigest(),
        "n": 8,
        "length": 64,
        "seed": 3,
    }
    assert torch.equal(calib.tokens, sample_calibration(validation_text, tokenizer, 8, 64, 3).tokens)
    assert not torch.equal(calib.tokens, sample_calibration(validation_text, tokenizer, 8, 64, 4).tokens)
    stream = encode(tokenizer, validation_text)
    assert stream[0] == tokenizer.token_to_id("<|bos|>")  # documents as the model was trained on them
    text = " ".join(map(str, stream))
    assert all(" ".join(map(str, row.tolist())) in text for row in calib.tokens)


def test_transformers_tokenizer_gives_the_same_samples(tokenizer, validation_text):
    from transformers import AutoTokenizer

    text = validation_text[:20000]
    auto = AutoTokenizer.from_pretrained(str(FIXTURE))
    assert torch.equal(
        sample_calibration(text, auto, 4, 64, 0).tokens, sample_calibration(text, tokenizer, 4, 64, 0).tokens
    )


def test_refuses_text_shorter_than_one_sample(tokenizer):
    with pytest.raises(ValueError, match="fewer than one sample of 2048"):
        sample_calibration("def f():\n    pass\n", tokenizer, n=1, length=2048)


def plain_forward(core: Qwen3Core, tokens: torch.Tensor, hessians: dict[str, HessianAccumulator] | None = None):
    """The core's own forward, sample by sample, with zeroed caches; optionally accumulating every linear's
    input Hessian through hooks. Returns the last layer's outputs [n, L, hidden]."""
    hooks = []
    for name, acc in (hessians or {}).items():
        hooks.append(
            core.get_submodule(name.removeprefix("model.")).register_forward_pre_hook(
                lambda _m, args, acc=acc: acc.add(args[0])
            )
        )
    outs = []
    with torch.no_grad():
        for row in tokens:
            caches = (torch.zeros(core.cache_shape()), torch.zeros(core.cache_shape()))
            positions = torch.arange(tokens.shape[1], dtype=torch.int32)[None]
            outs.append(core(row[None].int(), positions, *caches)["taps"][0])
    for hook in hooks:
        hook.remove()
    return torch.stack(outs)


def test_capture_without_quantization_equals_the_core_forward(tensors):
    core = fixture_core(tensors)
    tokens = torch.randint(4, 8192, (3, LENGTH), generator=torch.Generator().manual_seed(0))
    seen = []
    result = quantize_sequential(core, tokens, each_linear(lambda name, w, h: seen.append(name)))
    assert torch.equal(result.hidden, plain_forward(core, tokens))
    assert result.quantized == {}
    per_layer = [f"model.layers.0.{n}" for group in LINEAR_GROUPS for n in group]
    assert seen[:7] == per_layer and len(seen) == 7 * core.args.num_hidden_layers


def test_quantized_layers_feed_the_next_ones(tensors):
    """Every captured Hessian must be the one the final quantized model produces at that linear's input: q/k/v
    before o, gate/up before down, earlier layers quantized (true sequential, layer sequential)."""
    core = fixture_core(tensors)
    tokens = torch.randint(4, 8192, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    captured = {}

    def quantize(name, w, h):
        captured[name] = h
        return gptq_quantize(w, h, "affine4", 64, name=name)

    result = quantize_sequential(core, tokens, each_linear(quantize))
    assert len(result.quantized) == 7 * core.args.num_hidden_layers
    for name, qw in result.quantized.items():
        assert torch.equal(core.get_submodule(name.removeprefix("model.")).weight, qw.dequantize().float())
    replay = {name: HessianAccumulator(h.shape[0]) for name, h in captured.items()}
    assert torch.equal(result.hidden, plain_forward(core, tokens, replay))
    for name, h in captured.items():
        torch.testing.assert_close(replay[name].hessian(), h, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("group", [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                   ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)])
def test_linears_reading_one_input_share_its_hessian_and_stop_at_the_first(tensors, group):
    """A group whose linears read the very same tensor accumulates one Hessian, bit for bit each linear's own, and
    later samples stop before the first linear's matmul."""
    from quant.calibrate import capture_hessians

    core = fixture_core(tensors)
    layer, samples = core.layers[0], 4
    runner = CausalRunner(core, LENGTH)
    x = core.embed_tokens(torch.randint(4, 8192, (samples, LENGTH), generator=torch.Generator().manual_seed(2)))
    calls = []
    hook = layer.get_submodule(group[0]).register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        together = capture_hessians(layer, group, x, runner)
        hook.remove()
        for name in group:
            alone = capture_hessians(layer, (name,), x, runner)[name]
            assert torch.equal(together[name].hessian(), alone.hessian()), name
    shared = len(group) > 1
    assert len({id(acc) for acc in together.values()}) == (1 if shared else len(group))
    assert len(calls) == (1 if shared else 0)  # the first sample runs the first linear; the rest stop before it
