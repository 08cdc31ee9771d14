"""Benchmark: the streamed quantize stage at the real Qwen3.8-27B geometry, per unit, extrapolated to the whole model.

A synthetic checkpoint in the published geometry (hidden 5120, intermediate 17408, vocab 248320, attention 24/4 heads
of 256 with gated queries, Gated DeltaNet 16 key / 48 value heads of 128, conv kernel 4; untied lm_head), seeded
random bf16 weights written on the fly as sharded safetensors, with a subset of its 64 layers (by default one Gated
DeltaNet and one attention layer: the stage's cost is per layer, and every layer of a kind has the same shapes). The
build's own stage (``convert.weights.quantize.quantize_checkpoint``, the cache off) runs on it per method with the
release recipe's calibration (128 x 2048 tokens; the bench's tokenizer is a small byte-level BPE, which changes the ids,
not the cost); per unit it records the seconds, the peak GPU memory allocated and the process's peak resident host
memory. The whole model's time is 48 x the GDN layer + 16 x the attention layer + the lm_head + the embedding, plus
the calibration's embedding lookup.

    PYTHONPATH=. python3 -m bench.scale [--methods affine4-gptq,lut4-gptq] [--layers linear_attention,full_attention]
                                        [--samples 128] [--length 2048] [--device cuda] [--json out.json]
                                        [--compare-tf32] [--compare-recompute]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import arguments, machine, write_json

GEOMETRY = dict(hidden_size=5120, intermediate_size=17408, vocab_size=248320, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                max_position_embeddings=262144, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
WHOLE = {"linear_attention": 48, "full_attention": 16}
SHARD_BYTES = 4 << 30


def write_checkpoint(directory: Path, layer_types: list[str], device: str, seed: int = 0) -> dict:
    """config.json, a tokenizer and seeded bf16 weights (std 0.02, norms near 1) in shards of about 4 GiB."""
    from safetensors.torch import save_file

    from convert.models import qwen3_5

    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **GEOMETRY,
              "num_hidden_layers": len(layer_types), "layer_types": layer_types, "full_attention_interval": 4,
              "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(directory)
    shapes = qwen3_5.expected_shapes(qwen3_5.Args.from_config(config))
    shards, size = [[]], 0
    for key, shape in shapes.items():
        if size >= SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += 2 * torch.Size(shape).numel()
    generator = torch.Generator(device).manual_seed(seed)
    index = {}
    for number, keys in enumerate(shards):
        name = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key in keys:
            noise = torch.randn(shapes[key], generator=generator, device=device)
            value = 1.0 + 0.1 * noise if len(shapes[key]) == 1 else 0.02 * noise
            tensors[key] = value.to(torch.bfloat16).cpu()
        save_file(tensors, str(directory / name))
        index.update({key: name for key in keys})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return config


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_corpus()], trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))


def _corpus() -> str:
    """Text to calibrate on: the source of a few standard-library modules (any text has the same cost)."""
    import inspect
    import json.decoder
    import textwrap

    return "".join(inspect.getsource(m) for m in (argparse, json.decoder, tempfile, textwrap)) * 8


def host_peak() -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) * 1024


def reset_host_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run(directory: Path, config: dict, method: str, samples: int, length: int, device: str,
        keep: tuple[str, ...] = ()) -> dict:
    from convert.cache import BuildCache
    from convert.inputs.recipe import Calibration, Graphs, Quantization, Target
    from convert.models import qwen3_5
    from convert.models.layout import Layout
    from convert.weights.quantize import quantize_checkpoint

    args = qwen3_5.Args.from_config(config)
    target = Target(source="path:x", graphs=Graphs(), context=max(length, 512))
    quant = Quantization(method=method, keep_fp16=list(keep),
                         calibration=Calibration(corpus="path:corpus.txt", samples=samples, length=length))
    units, sweeps = {}, []
    import convert.weights.quantize as stage

    def timed(solve):  # a GPTQ solve (fit, sweep, refits) of one matrix or a stack, apart from the calibration passes
        def run(*a, **k):
            begin = time.perf_counter()
            result = solve(*a, **k)
            if device == "cuda":
                torch.cuda.synchronize()
            sweeps.append(time.perf_counter() - begin)
            return result

        return run

    solvers = {name: getattr(stage, name) for name in ("gptq_quantize", "gptq_quantize_shared")}
    for name, solve in solvers.items():
        setattr(stage, name, timed(solve))

    def observe(unit: str, seconds: float) -> None:
        gpu = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        solve = sum(sweeps)
        sweeps.clear()
        units[unit] = {"seconds": round(seconds, 2), "gptq_solve_seconds": round(solve, 2),
                       "gpu_peak_gib": round(gpu / 2**30, 2), "host_peak_gib": round(host_peak() / 2**30, 2)}
        print(f"  {method} {unit}: {seconds:.1f} s (GPTQ solves {solve:.1f} s), GPU peak {gpu / 2**30:.1f} GiB, "
              f"host peak {host_peak() / 2**30:.1f} GiB", flush=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        reset_host_peak()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    reset_host_peak()
    start = time.perf_counter()
    result = quantize_checkpoint(directory, args, target, Layout(), quant, directory.parent,
                                 cache=BuildCache(enabled=False), device=device, observe=observe)
    total = time.perf_counter() - start
    for name, solve in solvers.items():
        setattr(stage, name, solve)
    kinds = {}
    for i, kind in enumerate(args.layer_types):
        kinds.setdefault(kind, []).append(units[f"layers.{i}"]["seconds"])
    per_kind = {kind: sum(v) / len(v) for kind, v in kinds.items()}
    layer_sum = sum(units[f"layers.{i}"]["seconds"] for i in range(args.num_hidden_layers))
    tables = sum(units[name]["seconds"] for name in ("lm_head", "embed_tokens") if name in units)
    overhead = total - layer_sum - tables
    whole = sum(WHOLE[k] * per_kind[k] for k in WHOLE if k in per_kind) + tables + overhead
    ratios = [qw.stats.get("error_ratio") for qw in result.weights.values() if qw.stats.get("error_ratio")]
    return {"method": method, "units": units, "seconds_total": round(total, 1),
            "seconds_per_layer": {k: round(v, 2) for k, v in per_kind.items()},
            "seconds_outside_units": round(overhead, 2),
            "whole_model_seconds": round(whole, 1) if set(WHOLE) <= set(per_kind) else None,
            "kept_fp16": list(keep),
            "gptq_over_rtn_output_error_mean": round(sum(ratios) / len(ratios), 4) if ratios else None,
            "passes": "tf32" if device == "cuda" and stage.CUDA_TF32_PASSES else "fp32"}, result.weights


def compare(directory: Path, tf32: dict, fp32: dict) -> dict:
    """Per GPTQ'd matrix: the fraction of codes the two runs share, and ||Q_tf32 - Q_fp32|| / ||W - Q_fp32||."""
    from convert.inputs.sources import CheckpointReader

    reader = CheckpointReader(directory)
    rows = {}
    for name, qw in fp32.items():
        if qw.stats.get("gptq_output_error") is None:
            continue
        key = name + ".weight" if name == "lm_head" else f"model.{name}.weight"
        original = reader.get(key).to(torch.float16).float()
        a, b = tf32[name].dequantize().float(), qw.dequantize().float()
        rows[name] = {"codes_equal": round(float((tf32[name].codes == qw.codes).float().mean()), 5),
                      "change_over_quantization_error": round(float((a - b).norm() / (original - b).norm()), 5)}
    return rows


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--methods", default="affine4-gptq,lut4-gptq")
    parser.add_argument("--layers", default="linear_attention,full_attention")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workdir", type=Path, help="where the synthetic checkpoint goes (default: a temp dir)")
    parser.add_argument("--keep-fp16", default="", help="comma-separated weights left unquantized (e.g. lm_head: "
                        "its GPTQ solve holds the whole 248320-row table, ~50 GiB, more than a 24 GB CPU machine)")
    parser.add_argument("--compare-tf32", action="store_true",
                        help="run the first method again with TF32 calibration passes and compare the weights")
    parser.add_argument("--compare-recompute", action="store_true",
                        help="run the first method again without the block caches (every pass runs the mixer and the "
                             "MLP) and check the weights are bit for bit the same")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=options.workdir) as tmp:
        directory = Path(tmp) / "qwen3.8-27b-geometry"
        start = time.perf_counter()
        config = write_checkpoint(directory, options.layers.split(","), options.device)
        (directory.parent / "corpus.txt").write_text(_corpus())
        size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        print(f"synthetic checkpoint: {options.layers}, {size / 2**30:.2f} GiB bf16, written in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        report = {"machine": machine(options.device), "layers": options.layers.split(","),
                  "checkpoint_gib": round(size / 2**30, 2), "samples": options.samples, "length": options.length,
                  "runs": []}
        weights = {}
        for method in options.methods.split(","):
            record, weights[method] = run(directory, config, method, options.samples, options.length,
                                          options.device, tuple(k for k in options.keep_fp16.split(",") if k))
            report["runs"].append(record)
        if options.compare_tf32:
            import convert.weights.quantize as stage

            method = options.methods.split(",")[0]
            stage.CUDA_TF32_PASSES = True
            record, tf32 = run(directory, config, method, options.samples, options.length, options.device)
            stage.CUDA_TF32_PASSES = False
            report["runs"].append(record)
            report["tf32_vs_fp32"] = compare(directory, tf32, weights[method])
            for name, row in report["tf32_vs_fp32"].items():
                print(f"  TF32 vs fp32 passes, {name}: codes equal {row['codes_equal']:.4f}, weight change "
                      f"{row['change_over_quantization_error']:.4f} x the quantization error")
        if options.compare_recompute:
            import quant.calibrate as calibrate

            method = options.methods.split(",")[0]
            budget, calibrate.CACHE_BYTES = calibrate.CACHE_BYTES, 0  # no block cache: every pass recomputes
            record, recomputed = run(directory, config, method, options.samples, options.length, options.device)
            calibrate.CACHE_BYTES = budget
            record["block_caches"] = "off"
            report["runs"].append(record)
            differ = [name for name, qw in weights[method].items() if not _identical(qw, recomputed[name])]
            report["recompute_identical"] = {"weights": len(recomputed), "differing": differ}
            print(f"  block caches off vs on ({method}): {len(recomputed) - len(differ)} of {len(recomputed)} "
                  f"weights bit for bit equal{'; differing: ' + ', '.join(differ) if differ else ''}")
    for r in report["runs"]:
        tables = ", ".join(f"{n} {r['units'][n]['seconds']} s" for n in ("lm_head", "embed_tokens") if n in r["units"])
        kept = f" (kept fp16: {', '.join(r['kept_fp16'])})" if r["kept_fp16"] else ""
        print(f"{r['method']}: per layer {r['seconds_per_layer']} s, {tables} -> whole 64-layer model "
              f"{r['whole_model_seconds']} s{kept}")
    write_json(options.json, report)


def _identical(a, b) -> bool:
    """Two QuantizedWeights with the same codes and group tensors, bit for bit."""
    from quant.types import GROUP_TENSORS

    tensors = [("codes", a.codes, b.codes), *((n, getattr(a, n), getattr(b, n)) for n in GROUP_TENSORS)]
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for _, x, y in tensors)


if __name__ == "__main__":
    main()
