"""Numeric gates on the fixture: pass on the fp16 modules, fail naming the metric on a corrupted weight or a
too-strict bar; the block-vs-chain probe; the artifact gate on a packaged tiny Qwen3."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from rich.console import Console
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoModelForCausalLM

from convert.errors import GateError, InputError
from convert.fp16 import Peaks
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models.qwen3 import Qwen3Args
from convert.verify import checks, gates
from convert.verify.report import ArtifactResult, GateReport, RangeReport
from convert.weights.target import build_modules
from quant.calibrate import fixture_corpus_text

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3"
TARGET = Target(source="path:x", graphs=Graphs(prefill=64, verify=8), context=512, taps=[3, 7])
# The o_proj row whose zeroing moves the fixture most (of all 8 x 256 rows, measured on 2 x 128 held-out
# tokens: mean KL 1.8e-3, 18x the fp16 bar; the median row moves it 1.5e-4).
CORRUPTED_ROW = ("model.layers.0.self_attn.o_proj.weight", 50)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def args() -> Qwen3Args:
    return Qwen3Args.from_config(read_json(FIXTURE / "config.json"))


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return load_tensors(FIXTURE)


@pytest.fixture(scope="module")
def reference():
    return AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


@pytest.fixture(scope="module")
def data(tokenizer) -> gates.EvalData:
    return gates.EvalData.fixture(tokenizer, n=4, length=128)


@pytest.fixture(scope="module")
def fp16_report(reference, args, tensors, data) -> GateReport:
    modules = build_modules(args, TARGET, tensors, torch.float16)
    return gates.run_gates(reference, modules, data, gates.default_thresholds("none"), progress=False)


def failed(report: GateReport) -> set[str]:
    return {m.name for m in report.metrics if not m.passed}


def test_default_thresholds_per_method():
    fp16, affine, lut = (gates.default_thresholds(m) for m in ("none", "affine4", "lut4"))
    assert fp16.mean_kl_max < affine.mean_kl_max and fp16.top1_min > affine.top1_min
    assert gates.default_thresholds("affine4-gptq") == affine and gates.default_thresholds("lut4-gptq") == lut
    assert all(t.block_chain_real_flips_max == 0 for t in (fp16, affine, lut))
    with pytest.raises(InputError, match="int8"):
        gates.default_thresholds("int8")
    with pytest.raises(ValidationError, match="top1"):
        gates.GateThresholds(**{**fp16.model_dump(), "top1": 0.5})


def test_eval_data_is_seeded_held_out_windows(tokenizer, data):
    text = fixture_corpus_text("eval")
    assert data.identity.corpus_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert (data.identity.corpus, data.identity.n, data.identity.length, data.identity.seed) == ("fixture:eval", 4,
                                                                                                  128, 0)
    assert data.tokens.shape == (4, 128)
    assert torch.equal(gates.EvalData.fixture(tokenizer, n=4, length=128).tokens, data.tokens)
    assert not torch.equal(gates.EvalData.fixture(tokenizer, n=4, length=128, seed=1).tokens, data.tokens)


def test_gate_passes_on_fp16_fixture_and_reports(fp16_report, data, tmp_path):
    values = {m.name: m.value for m in fp16_report.metrics}
    assert fp16_report.passed, fp16_report.failures()
    assert values["kl_mean"] < 1e-5 and values["kl_max"] < 1e-3
    assert values["top1"] > 0.99 and values["logits_cosine"] > 0.9999 and values["greedy_match"] >= 0.9
    assert values["tap_cosine[3]"] > 0.9999 and values["tap_cosine[7]"] > 0.9999
    assert values["block_chain_positions"] == 4 * 8 and values["block_chain_real_flips"] == 0
    assert "computed in float32" in fp16_report.candidate and "float16" in fp16_report.candidate
    assert any("Core ML" in n.what for n in fp16_report.not_run)

    written = json.loads(fp16_report.write_json(tmp_path / gates.REPORT_FILE).read_text())
    assert written["passed"] is True and written["data"] == data.identity.model_dump()
    assert GateReport.model_validate(written).metrics == fp16_report.metrics
    entry = fp16_report.manifest_entry()
    assert entry["data"]["corpus_sha256"] == data.identity.corpus_sha256 and entry["metrics"]["top1"] == values["top1"]
    console = Console(record=True, width=120)
    console.print(fp16_report.table())
    text = console.export_text()
    assert "PASS" in text and "kl_mean" in text and "<= 0.0001" in text and "not run" in text

    broken = ArtifactResult(package="x.aimodel", passed=False, error="decode at position 3 differs", seconds=0)
    with_artifact = fp16_report.model_copy(update={"artifact": broken})
    assert not with_artifact.passed
    with pytest.raises(GateError, match="x.aimodel: decode at position 3"):
        with_artifact.raise_if_failed()


def test_gate_fails_on_a_zeroed_o_proj_row(reference, args, tensors, data):
    name, row = CORRUPTED_ROW
    corrupted = dict(tensors)
    corrupted[name] = tensors[name].clone()
    corrupted[name][row] = 0
    modules = build_modules(args, TARGET, corrupted, torch.float16)
    report = gates.run_gates(reference, modules, data, gates.default_thresholds("none"), progress=False)
    assert not report.passed
    # measured: KL mean 1.2e-3, max 0.054, top-1 98.6%; greedy continuations and the probe are unaffected
    assert failed(report) == {"kl_mean", "kl_p99", "kl_max", "top1", "logits_cosine", "tap_cosine[3]", "tap_cosine[7]"}
    with pytest.raises(GateError, match=r"kl_mean \S+ > 0\.0001"):
        report.raise_if_failed()


def test_too_strict_threshold_fails_naming_it(reference, args, tensors, data):
    strict = gates.default_thresholds("none").model_copy(update={"mean_kl_max": 1e-12})
    modules = build_modules(args, TARGET, tensors, torch.float16)
    report = gates.run_gates(reference, modules, data, strict, progress=False)
    assert failed(report) == {"kl_mean"}
    assert report.failures()[0].startswith("kl_mean ") and report.failures()[0].endswith("> 1e-12")


def test_classify_flips_tells_a_near_tie_from_a_real_flip():
    chain = torch.tensor([[5.0, 1.0, 4.99], [0.0, 3.0, 1.0], [2.0, 0.0, 7.0]])
    block = torch.tensor([[4.98, 1.0, 5.0], [0.0, 3.0, 1.0], [9.0, 0.0, 7.0]])
    flips = gates.classify_flips(block, chain, margin=0.25)
    assert [(f.row, f.block_id, f.chain_id, f.near_tie) for f in flips] == [(0, 2, 0, True), (2, 0, 2, False)]
    assert flips[0].gap == pytest.approx(0.02, abs=1e-6) and flips[1].gap == 5.0  # the wider of the two gaps
    # a flip whose block gap is tiny but whose chain gap is wide is real: both computations must be near a tie
    chain_wide = torch.tensor([[5.0, 1.0, 3.0]])
    assert gates.classify_flips(torch.tensor([[4.99, 1.0, 5.0]]), chain_wide, margin=0.25)[0].near_tie is False


def test_the_device_pass_gates_its_top1_beyond_near_ties():
    """Four positions: one agreeing, one flipped to an id the reference scores 0.1 below its best (a near tie at the
    margin of 0.25), one flipped to an id 1.0 below, one flipped to an id exactly at the margin (not a tie): top-1 is
    1/4, beyond near ties 2/4, and only that one is held to ``device_top1_min``."""
    ref = torch.tensor([[3.0, 0.0, 0.0], [2.0, 1.9, 0.0], [2.0, 1.0, 0.0], [0.0, 2.0, 1.75]])
    cand = torch.tensor([[3.0, 0.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 2.0]])
    stats = gates._Stats([])
    stats.add(0, gates._Window(ref, {}, []), gates._Window(cand, {}, [], []), 0.25)
    stats.add_greedy([1], [1])
    bars = gates.default_thresholds("none").model_copy(update={"device_top1_min": 0.5})
    watched = RangeReport.of("gpu", Peaks())
    result = gates._device_result(stats, bars, "gpu", 1, watched, 0.0)
    metrics = {m.name: m for m in result.metrics}
    assert metrics["top1"].value == 0.25 and metrics["top1"].threshold is None
    assert metrics["top1_beyond_near_ties"].value == 0.5 and metrics["top1_beyond_near_ties"].passed
    bars = bars.model_copy(update={"device_top1_min": 0.75})
    assert not {m.name: m for m in gates._device_result(stats, bars, "gpu", 1, watched, 0.0).metrics}[
        "top1_beyond_near_ties"].passed


class SkewedHead(nn.Module):
    """An lm_head that puts ids 10 and 11 on top of every row: 11 wins by ``gap`` in multi-token calls
    (prefill, verify), 10 wins by ``gap`` in single-token calls (decode): every probed position flips."""

    def __init__(self, head: nn.Linear, gap: float):
        super().__init__()
        self.head, self.gap = head, gap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        top = logits.max(-1).values + 1
        logits[..., 10] = top
        logits[..., 11] = top + (self.gap if logits.shape[-2] > 1 else -self.gap)
        return logits


@pytest.mark.parametrize("gap, near_tie", [(0.01, True), (1.0, False)])
def test_probe_end_to_end_near_tie_and_real_flip(reference, args, tensors, tokenizer, gap, near_tie):
    target = Target(source="path:x", graphs=Graphs(prefill=64, verify=8), context=512)
    modules = build_modules(args, target, tensors, torch.float16)
    modules.core.lm_head = SkewedHead(modules.core.lm_head, gap)
    data = gates.EvalData.fixture(tokenizer, n=2, length=64)
    report = gates.run_gates(reference, modules, data, gates.default_thresholds("none"), greedy_tokens=2,
                             progress=False)
    values = {m.name: m.value for m in report.metrics}
    assert len(report.flips) == values["block_chain_positions"] == 2 * 8
    assert all(f.near_tie is near_tie and (f.block_id, f.chain_id) == (11, 10) for f in report.flips)
    assert values["block_chain_near_ties"] == (16 if near_tie else 0)
    assert ("block_chain_real_flips" in failed(report)) is not near_tie


def test_schedule_refuses_what_the_context_cannot_hold(reference, args, tensors, tokenizer):
    modules = build_modules(args, Target(source="path:x", context=128), tensors, torch.float16)
    data = gates.EvalData.fixture(tokenizer, n=1, length=128)
    with pytest.raises(InputError, match="context is 128"):
        gates.run_gates(reference, modules, data, gates.default_thresholds("none"), progress=False)
    with pytest.raises(InputError, match="tap layer 3"):
        gates.run_gates(reference, modules, data, gates.default_thresholds("none"), taps=[3], progress=False)


def test_artifact_gate_fails_on_a_package_with_other_weights(tiny_checkpoint, tmp_path):
    from convert.backends import coreai

    args = Qwen3Args.from_config(read_json(tiny_checkpoint / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=64)
    tensors = load_tensors(tiny_checkpoint)
    shipped = build_modules(args, target, tensors, torch.float16)
    path = tmp_path / "tiny.aimodel"
    coreai.package(shipped.functions, path)

    result = gates.artifact_gate(path, shipped)
    assert result.passed and result.argmax_compared > 0 and result.runtime_calls == checks.DECODE_STEPS + 2
    # lm_head negated: every argmax becomes the argmin, far outside the fp16 near-tie margin
    other = build_modules(args, target, {**tensors, "lm_head.weight": -tensors["lm_head.weight"]}, torch.float16)
    result = gates.artifact_gate(path, other)
    assert not result.passed and "the .aimodel predicts" in result.error
    with pytest.raises(InputError, match="Core AI .aimodel"):
        gates.artifact_gate(tmp_path / "tiny.mlpackage", shipped)
