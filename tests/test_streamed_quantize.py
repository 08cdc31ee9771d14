"""The streamed, cached quantize stage (``convert/weights/quantize.py``): the same bytes as the in-memory GPTQ loop over
the whole core, units reused from the cache, corrupt entries recomputed, ``--no-cache`` honoured, a SIGKILLed run
resumed with at most the unit in flight redone, and peak memory bounded by one unit."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from convert.cache import BuildCache
from convert.inputs.recipe import Calibration, Graphs, Quantization, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models import family_of, read_args
from convert.models.layout import Layout
from convert.weights.quantize import _calibration_set, quantize_checkpoint, quantize_sequential
from convert.weights.target import build_modules
from quant import calibrate
from quant.calibrate import each_linear, quantize_layer
from quant.gptq import HessianAccumulator, gptq_quantize
from quant.lut import quantize_lut
from tests.helpers.checkpoints import TOKENIZER_TEXT
from tests.helpers.checkpoints import write_checkpoint as write_dense
from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = Target(source="path:x", graphs=Graphs(prefill=16, verify=4), context=64)
SHAPES = {"dense": dict(hidden_size=64, num_hidden_layers=3),
          "hybrid": dict(hidden_size=64, intermediate_size=128, linear_key_head_dim=16, linear_value_head_dim=16,
                         head_dim=16)}


def write(directory: Path, kind: str) -> Path:
    (write_dense if kind == "dense" else write_hybrid)(directory, **SHAPES[kind])
    (directory.parent / "corpus.txt").write_text("".join(TOKENIZER_TEXT) * 40)
    return directory


def quantization(method: str) -> Quantization:
    group = 32 if method.startswith("affine4") else 16
    return Quantization(method=method, group_size=group,
                        calibration=Calibration(corpus="path:corpus.txt", samples=3, length=24))


def in_memory(directory: Path, quant: Quantization) -> dict:
    """The loop the stage streams, over the whole core in memory: GPTQ on an fp32 copy of the fp16 core, the
    lm_head under the final-norm Hessian, everything else rounded to nearest from the fp16 weights."""
    args = read_args(read_json(directory / "config.json"))
    core = build_modules(args, TARGET, load_tensors(directory), torch.float16).core
    work = copy.deepcopy(core).float()
    method, group = quant.format, quant.resolved_group_size
    small = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")

    def gptq(name, weight, hessian):
        return None if name.endswith(small) else gptq_quantize(weight, hessian, method, group, name=name)

    tokens = _calibration_set(quant, directory, directory.parent).tokens
    result = quantize_sequential(work, tokens, each_linear(gptq))
    weights = {name.removeprefix("model."): qw for name, qw in result.quantized.items()}
    accumulator = HessianAccumulator(args.hidden_size)
    with torch.no_grad():
        for sample in result.hidden:
            accumulator.add(work.norm(sample))
    weights["lm_head"] = gptq_quantize(work.lm_head.weight, accumulator.hessian(), method, group, name="lm_head")
    from quant.affine import quantize_affine

    table = core.embed_tokens.weight.detach().float()
    weights["embed_tokens"] = quantize_lut(table, group) if method == "lut4" else quantize_affine(table, group)
    return weights


def streamed(directory: Path, quant: Quantization, cache: BuildCache | None = None):
    args = read_args(read_json(directory / "config.json"))
    return quantize_checkpoint(directory, args, TARGET, Layout(), quant, directory.parent, cache=cache, device="cpu")


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, qw in want.items():
        for field in ("codes", "scale", "zero_point", "lut"):
            a, b = getattr(got[name], field), getattr(qw, field)
            assert (a is None) == (b is None), (name, field)
            if a is not None:
                assert torch.equal(a, b), (name, field)


@pytest.mark.parametrize("kind, method", [("dense", "affine4-gptq"), ("hybrid", "lut4-gptq")])
def test_streamed_gptq_gives_the_in_memory_loops_bytes(tmp_path, kind, method):
    directory = write(tmp_path / "ckpt", kind)
    quant = quantization(method)
    result = streamed(directory, quant)
    assert_same(result.weights, in_memory(directory, quant))
    layers = read_args(read_json(directory / "config.json")).num_hidden_layers
    assert result.units == {**{f"layers.{i}": "computed" for i in range(layers)}, "lm_head": "computed",
                            "embed_tokens": "computed"}


@pytest.mark.parametrize("kind, method", [("dense", "affine4-gptq"), ("hybrid", "lut4-gptq")])
def test_tables_in_row_chunks_give_the_whole_tables_bytes(tmp_path, monkeypatch, kind, method):
    """A table larger than CHUNK_ELEMENTS (a 27B's lm_head) is read, GPTQ'd or rounded in row chunks: the same codes
    and tables as the whole table's, and GPTQ's output errors add up over the chunks."""
    import convert.weights.quantize as stage

    directory = write(tmp_path / "ckpt", kind)
    args = read_args(read_json(directory / "config.json"))
    quant = quantization(method)
    monkeypatch.setattr(stage, "CHUNK_ELEMENTS", args.vocab_size * args.hidden_size // 5)  # 5 or 6 chunks
    result = streamed(directory, quant)
    want = in_memory(directory, quant)
    assert_same(result.weights, want)
    head, whole = result.weights["lm_head"].stats, want["lm_head"].stats
    for key in ("gptq_output_error", "rtn_output_error", "error_ratio"):
        assert head[key] == pytest.approx(whole[key], rel=1e-4), key
    assert head["damping"] == whole["damping"] and head["dead_columns"] == whole["dead_columns"]


@pytest.mark.parametrize("kind, method", [("dense", "affine4-gptq"), ("hybrid", "lut4-gptq")])
def test_the_block_caches_give_the_recomputing_passes_bytes_and_skip_the_blocks(tmp_path, monkeypatch, kind, method):
    """Each layer quantized with its blocks' last-linear inputs kept (``BlockCache``: the mixer's and the MLP's,
    under the default CPU budget), with the mixer's only (a budget that admits it and not the MLP's too), with the
    MLP's only, and (budget 0) with every pass recomputing both: the same codes and tables and the same layer outputs,
    bit for bit, layer after layer. Per sample and layer the mixer is entered 2 times with its cache (the passes of
    the groups up to its last linear), 5 without (every group's pass and the outputs); the MLP 2 times with its
    cache (the gate/up and down passes: the outputs pass runs down_proj on the kept inputs), 3 without."""
    directory = write(tmp_path / "ckpt", kind)
    quant = quantization(method)
    args = read_args(read_json(directory / "config.json"))
    family = family_of(args)
    core = build_modules(args, TARGET, load_tensors(directory), torch.float16).core.float()
    tokens = _calibration_set(quant, directory, directory.parent).tokens
    method, group = quant.format, quant.resolved_group_size

    def gptq(name, weight, hessian):
        return None if name.endswith(family.KEEP_FP16 or ()) else gptq_quantize(weight, hessian, method, group)

    def cache_bytes(layer, last: str) -> int:
        return tokens.numel() * layer.get_submodule(last).in_features * 4  # fp32 activations

    blocks = [family.cached_blocks(core, layer) for layer in core.layers]
    assert all(tuple(name for name, _ in b) == (b[0][0], "mlp") for b in blocks)
    mixer_bytes = [cache_bytes(layer, b[0][1]) for layer, b in zip(core.layers, blocks, strict=True)]
    mlp_bytes = [cache_bytes(layer, b[1][1]) for layer, b in zip(core.layers, blocks, strict=True)]
    # a budget of max(mixer_bytes) admits every layer's mixer cache and then none of the MLP's
    assert all(m + p > max(mixer_bytes) for m, p in zip(mixer_bytes, mlp_bytes, strict=True))
    assert sum(map(max, mixer_bytes, mlp_bytes)) < calibrate.CPU_CACHE_BYTES

    def layer_by_layer(budget: int | None, mlp_only: bool = False):
        monkeypatch.setattr(calibrate, "CACHE_BYTES", budget)
        work = copy.deepcopy(core)
        runner = family.calibration_runner(work, tokens.shape[1])
        x = work.embed_tokens(tokens)
        entered = {"mixer": 0, "mlp": 0}
        results = []
        for i, layer in enumerate(work.layers):
            (mixer, _), (mlp, _) = pair = family.cached_blocks(work, layer)
            for what, name in (("mixer", mixer), ("mlp", mlp)):
                layer.get_submodule(name).register_forward_pre_hook(lambda *_, what=what: entered.update(
                    {what: entered[what] + 1}))
            quantized, x = quantize_layer(layer, i, family.linear_groups(work, layer), x, runner, each_linear(gptq),
                                          blocks=pair[1:] if mlp_only else pair, outputs=True)
            results.append((quantized, x))
        runs = tokens.shape[0] * len(work.layers)
        return results, (entered["mixer"] / runs, entered["mlp"] / runs)

    recomputed, recomputed_entries = layer_by_layer(0)
    assert recomputed_entries == (5, 3)
    for budget, mlp_only, entries in ((None, False, (2, 2)), (max(mixer_bytes), False, (2, 3)), (None, True, (5, 2))):
        cached, cached_entries = layer_by_layer(budget, mlp_only)
        for (got, got_outputs), (want, want_outputs) in zip(cached, recomputed, strict=True):
            assert_same(got, want)
            assert torch.equal(got_outputs, want_outputs)
        assert cached_entries == entries, (budget, mlp_only)


def test_a_layers_caches_are_granted_in_order_within_the_budget_where_they_hold(monkeypatch):
    """The budget: half the CUDA device's free memory when the layer starts (what the caching allocator holds unused
    counts as free), a fixed one on CPU, the override before either. Caches are granted block by block in order while
    their bytes together fit (a later one may fit where an earlier did not), only where the kept inputs hold (no other
    linear of the block quantized with or after its last one) and where a later pass reads them."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 141 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 << 30)
    assert calibrate.cache_budget(torch.device("cuda", 0)) == 60 << 30
    assert calibrate.cache_budget(torch.device("cpu")) == calibrate.CPU_CACHE_BYTES == 1 << 30
    monkeypatch.setattr(calibrate, "CACHE_BYTES", 0)
    assert calibrate.cache_budget(torch.device("cuda", 0)) == calibrate.cache_budget(torch.device("cpu")) == 0

    layer = torch.nn.Module()
    layer.mixer, layer.mlp = torch.nn.Module(), torch.nn.Module()
    layer.mixer.q, layer.mixer.o = torch.nn.Linear(8, 8), torch.nn.Linear(12, 8)
    layer.mlp.up, layer.mlp.down = torch.nn.Linear(8, 4), torch.nn.Linear(4, 8)
    blocks = (("mixer", "mixer.o"), ("mlp", "mlp.down"))
    groups = (("mixer.q",), ("mixer.o",), ("mlp.up",), ("mlp.down",))
    x = torch.zeros(2, 3, 8)  # a cache takes 2 x 3 x in_features x 4 bytes: 288 for mixer.o, 96 for mlp.down

    def granted(budget, groups=groups, outputs=True):
        monkeypatch.setattr(calibrate, "CACHE_BYTES", budget)
        return [c.last_name for c in calibrate.BlockCache.for_layer(layer, groups, x, blocks, outputs)]

    assert granted(384) == ["mixer.o", "mlp.down"]
    assert granted(383) == granted(288) == ["mixer.o"]
    assert granted(287) == granted(96) == ["mlp.down"]
    assert granted(95) == []
    assert granted(384, outputs=False) == ["mixer.o"]  # no pass after the down pass would read the MLP's
    assert granted(384, (("mixer.q",), ("mixer.o", "mlp.up"), ("mlp.down",))) == ["mixer.o", "mlp.down"]
    assert granted(384, (("mixer.q", "mixer.o"), ("mlp.up", "mlp.down"))) == []  # quantized with their last linear
    assert granted(384, (("mixer.o",), ("mixer.q",), ("mlp.up",))) == []  # q after o; down in no group


def test_the_cache_reuses_units_recomputes_corrupt_ones_and_can_be_off(tmp_path):
    directory = write(tmp_path / "ckpt", "hybrid")
    quant = quantization("affine4-gptq")
    cache = BuildCache(tmp_path / "cache")
    first = streamed(directory, quant, cache)
    entries = sorted((tmp_path / "cache" / "quantize").glob("*/*/weights.safetensors"))
    assert len(entries) == len(first.units) == 6
    again = streamed(directory, quant, BuildCache(tmp_path / "cache"))
    assert set(again.units.values()) == {"cached"}
    assert_same(again.weights, first.weights)
    assert again.weights["layers.2.mlp.down_proj"].stats == first.weights["layers.2.mlp.down_proj"].stats

    # one flipped byte in layer 1's entry: detected, recomputed (and the activations after it are the same)
    entry = next(p for p in entries
                 if any(n.startswith("layers.1.") for n in json.loads((p.parent / "entry.json").read_text())["meta"]
                        ["weights"]))
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
    cache = BuildCache(tmp_path / "cache")
    repaired = streamed(directory, quant, cache)
    assert cache.corrupt == {"quantize": 1}
    assert [u for u, how in repaired.units.items() if how == "computed"] == ["layers.1"]
    assert_same(repaired.weights, first.weights)

    # a changed recipe field is a different key; a disabled cache reads and writes nothing
    other = quant.model_copy(update={"calibration": Calibration(corpus="path:corpus.txt", samples=3, length=24,
                                                                seed=1)})
    assert set(streamed(directory, other, BuildCache(tmp_path / "cache")).units.values()) == {"computed"}
    off = BuildCache(tmp_path / "off", enabled=False)
    assert set(streamed(directory, quant, off).units.values()) == {"computed"}
    assert not (tmp_path / "off").exists()


KILLED = """
import torch
from tests.test_streamed_quantize import quantization, streamed
from convert.cache import BuildCache
from pathlib import Path
torch.set_num_threads(1)
streamed(Path({directory!r}), quantization("lut4-gptq"), BuildCache(Path({cache!r})))
"""


def finished_entries(cache_dir: Path) -> list[Path]:
    """The stored units' entries; not one being written (``.<key>.tmp-<pid>``: pathlib's ``*`` matches a dot)."""
    return [p for p in cache_dir.glob("quantize/*/*/entry.json") if not p.parent.name.startswith(".")]


def test_a_killed_run_resumes_redoing_at_most_the_unit_in_flight(tmp_path):
    directory = write(tmp_path / "ckpt", "dense")
    cache_dir = tmp_path / "cache"
    script = KILLED.format(directory=str(directory), cache=str(cache_dir))
    process = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parent.parent,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    stored = []
    while time.monotonic() < deadline and process.poll() is None:
        stored = finished_entries(cache_dir)
        if len(stored) >= 2:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it was killed mid-quantization"
    stored = finished_entries(cache_dir)
    assert 2 <= len(stored) < 5  # 3 layers, the lm_head and the embedding: killed in the middle
    cache = BuildCache(cache_dir)
    resumed = streamed(directory, quantization("lut4-gptq"), cache)
    assert sum(how == "cached" for how in resumed.units.values()) == len(stored)
    assert cache.misses == {"quantize": 5 - len(stored)}
    assert_same(resumed.weights, streamed(directory, quantization("lut4-gptq")).weights)
    assert not list(cache_dir.glob("quantize/*/.*.tmp-*"))  # what the kill left half-written is gone


MEMORY = """
import torch
from tests.test_streamed_quantize import quantization, streamed
from pathlib import Path
torch.set_num_threads(1)
def status(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) * 1024
streamed(Path({small!r}), quantization("affine4-gptq"))  # imports, allocator and thread pools warm
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to the current RSS
weights = streamed(Path({directory!r}), quantization("affine4-gptq")).weights
held = sum(t.numel() * t.element_size() for qw in weights.values()
           for t in (qw.codes, qw.scale, qw.zero_point, qw.lut) if t is not None)
print(base, status("VmHWM"), held)
"""

SHAPE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=32, num_attention_heads=6,
             num_key_value_heads=3, head_dim=64, vocab_size=1024)


@pytest.mark.heavy  # 40 s on 2 cores: make test-heavy
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_streamed_quantization_peak_memory_is_bounded_by_one_layer(tmp_path):
    """GPTQ of a 32-layer model: the stage's peak resident memory above the warm process stays under what it returns
    (the codes and tables, held until the packages take them) plus a working set of one layer: 12 x its fp32
    weights (reads, casts, GPTQ's copies and the C heap's slack; 130 MiB measured in all on this model), 6 x its
    largest Hessian and 4 x the calibration activations. Holding the model (fp16 weights and the
    fp32 copy GPTQ computes on) could not pass. Measured in-process: the kernel's peak RSS, reset once warm."""
    directory = tmp_path / "big" / "ckpt"
    write_dense(directory, dtype=torch.float16, **SHAPE)
    (directory.parent / "corpus.txt").write_text("".join(TOKENIZER_TEXT) * 40)
    small = write(tmp_path / "small" / "ckpt", "dense")
    script = MEMORY.format(small=str(small), directory=str(directory))
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "SPEC_CONVERT_CACHE": str(tmp_path / "c")})
    assert out.returncode == 0, out.stderr[-2000:]
    base, peak, held = map(int, out.stdout.split()[-3:])
    h, i, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i  # parameters of q, o, k, v, gate, up, down
    working = 12 * 4 * layer + 6 * 4 * i * i + 4 * 4 * 3 * 24 * h
    model = SHAPE["num_hidden_layers"] * layer + 2 * SHAPE["vocab_size"] * h
    assert 6 * model > held + working  # fp16 weights + an fp32 copy: a stage that held the model could not pass
    assert peak - base < held + working, \
        f"peak {(peak - base) / 2**20:.1f} MiB over the warm process; bound {(held + working) / 2**20:.1f} MiB"
