"""The streamed fp32 reference (convert/verify/reference.py) against the gate's whole transformers model: the same
logits, tapped layer outputs and greedy ids on a dense, a tied dense, a hybrid and a vision-language checkpoint, with at
most one decoder layer's weights in memory at any time; and the greedy ids teacher-forced on a candidate's
continuation against the model's own greedy continuation, one token at a time."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from convert.inputs.sources import read_json
from convert.models import read_args
from convert.verify import gates, reference
from tests.helpers.checkpoints import write_checkpoint as write_dense
from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GREEDY = 4
LENGTHS = (24, 37)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=["dense", "tied-dense", "hybrid", "vision-language"])
def source(request, tmp_path) -> Path:
    if request.param == "dense":
        return FIXTURES / "stdlib-qwen3"
    if request.param == "hybrid":
        return FIXTURES / "stdlib-qwen3_5"
    if request.param == "tied-dense":
        write_dense(tmp_path, tie_word_embeddings=True)
    else:
        write_hybrid(tmp_path, conditional=True)
    return tmp_path


def recording_peak(peaks: list[int]):
    """``reference.meta_model`` that records, before every decoder layer call, how many of the decoder layers, the
    embedding and the lm_head hold real (non-meta) parameters."""
    build = reference.meta_model

    def meta_model(source, device):
        model = build(source, device)
        held = [*model.model.layers, model.model.embed_tokens, model.lm_head]

        def count(_layer, _args):
            peaks.append(sum(any(p.device != reference.META for p in m.parameters()) for m in held))

        for layer in model.model.layers:
            layer.register_forward_pre_hook(count)
        return model

    return meta_model


@torch.no_grad()
def free_running(model, window: list[int], tokens: int) -> list[int]:
    """The model's own greedy continuation of ``window``, one token at a time on its cache."""
    keyword = gates._cache_keyword(model)
    out = model(input_ids=torch.tensor([window]), use_cache=True)
    ids = [int(out.logits[0, -1].argmax())]
    while len(ids) < tokens:
        out = model(input_ids=torch.tensor([ids[-1:]]), use_cache=True, **{keyword: out[keyword]})
        ids.append(int(out.logits[0, -1].argmax()))
    return ids


def test_streamed_reference_equals_whole_model(source, monkeypatch):
    args = read_args(read_json(source / "config.json"))
    generator = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, args.vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]
    taps = [1, args.num_hidden_layers - 1]
    whole = gates.load_reference(source)
    own = [free_running(whole, window, GREEDY) for window in windows]
    # the first window's candidate follows the model; the second's differs from its second id on
    continuations = [own[0], [own[1][0], (own[1][1] + 1) % args.vocab_size, *own[1][2:]]]
    peaks = []
    monkeypatch.setattr(reference, "meta_model", recording_peak(peaks))
    streamed = reference.streamed_reference(source, windows, taps, continuations)

    modules = SimpleNamespace(core=SimpleNamespace(args=args))
    for window, continuation, got in zip(windows, continuations, streamed, strict=True):
        want = gates._reference_window(whole, window, taps, continuation, modules)
        assert got.logits.shape == want.logits.shape == (len(window), args.vocab_size)
        assert torch.equal(got.logits, want.logits), float((got.logits - want.logits).abs().max())
        for t in taps:
            assert torch.equal(got.taps[t], want.taps[t]), (t, float((got.taps[t] - want.taps[t]).abs().max()))
        assert got.greedy == want.greedy and len(got.greedy) == GREEDY
    # teacher-forced on the model's own continuation: that continuation; on one that differs at its second id: the
    # model's own first two ids, so greedy_match counts one
    assert streamed[0].greedy == own[0]
    assert streamed[1].greedy[:2] == own[1][:2]
    stats = gates._Stats([])
    for got, continuation in zip(streamed, continuations, strict=True):
        stats.add_greedy(got.greedy, continuation)
    assert stats.greedy == [1.0, 1 / GREEDY]
    assert len(peaks) == 2 * len(windows) * args.num_hidden_layers  # the window, then the continuation: two passes
    assert max(peaks) == 1  # the layer being called, and nothing else
