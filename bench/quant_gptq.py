"""GPTQ vs round-to-nearest on the fixture's real layers, and GPTQ time on one large matrix (a benchmark, not a test).

    PYTHONPATH=. python bench/quant_gptq.py                  # CPU: fixture + timing at a reduced size
    PYTHONPATH=. python3 bench/quant_gptq.py --device cuda   # GPU: fixture (if the train split is built) + full size

Fixture part: calibration samples from the corpus train split (``python -m fixtures.build_corpus`` builds it),
held-out activations from the eval split. Both formats are quantized layer-sequentially (``quant.calibrate``)
with GPTQ, and per linear with round-to-nearest (affine4: ``quantize_affine``; lut4: ``quantize_lut``, no
weighting). The output error of every linear, ``||W X - Q X||^2`` per held-out token, is computed as
``trace((W - Q) H (W - Q)^T) / 2`` from the held-out inputs' ``H = 2 X X^T / n`` (X: the inputs of that linear
in the unquantized model). The held-out eval loss of each model (``fixtures.evaluation``'s windows) is printed.

Timing part: a down_proj-shaped matrix (out 5120, in 17408) and 128 x 2048 tokens of structured fp16
activations (low-rank correlated, uneven per-feature gains), generated before the clock starts; timed are the
Hessian accumulation and ``gptq_quantize`` for each format (fit, damping + Cholesky, sweep, error stats).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from convert.models.qwen3.core import LINEAR_GROUPS, CausalRunner
from convert.weights.quantize import quantize_sequential
from quant.affine import quantize_affine
from quant.calibrate import capture_hessians, each_linear, encode, fixture_corpus_text, sample_calibration
from quant.gptq import HessianAccumulator, gptq_quantize, inverse_factor, output_error

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3"
FORMATS = (("affine4", 64), ("lut4", 16))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--part", choices=("fixture", "timing", "all"), default="all")
    p.add_argument("--calibration-split", default="train", choices=("train", "validation"))
    p.add_argument("--samples", type=int, default=128, help="calibration samples (fixture)")
    p.add_argument("--length", type=int, default=512, help="tokens per sample (fixture; it was trained on 512)")
    p.add_argument("--held-out-samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lut-refits", type=int, default=2)
    p.add_argument("--eval-windows", type=int, default=64, help="eval loss windows of 512 tokens (all: 255)")
    p.add_argument("--out-features", type=int, default=None, help="timing matrix rows (default 5120; CPU 1280)")
    p.add_argument("--in-features", type=int, default=None, help="timing matrix columns (default 17408; CPU 4352)")
    p.add_argument("--timing-samples", type=int, default=None, help="x 2048 tokens (default 128; CPU 8)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> str:
    cores = torch.get_num_threads()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {cores} threads"
    return f"{where}; Python {platform.python_version()}, torch {torch.__version__}"


# ---------------------------------------------------------------- fixture part


def load_fixture():
    from tokenizers import Tokenizer

    from convert.inputs.sources import load_tensors
    from convert.models.qwen3 import Qwen3Args

    args = Qwen3Args.from_config(json.loads((FIXTURE / "config.json").read_text()))
    return args, load_tensors(FIXTURE), Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


def fresh_core(args, tensors, length: int, device: torch.device):
    from convert.models.qwen3.core import Qwen3Core

    core = Qwen3Core(args, length).float().eval()
    core.load_weights(tensors)
    return core.to(device)


@torch.no_grad()
def held_out_hessians(core, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Input Hessians of every linear of the unquantized model over held-out tokens (a capture pass and a forward per
    layer)."""
    runner = CausalRunner(core, tokens.shape[1])
    x = core.embed_tokens(tokens.to(core.embed_tokens.weight.device))
    names = tuple(name for group in LINEAR_GROUPS for name in group)
    hessians = {}
    for i, layer in enumerate(core.layers):
        accumulators = capture_hessians(layer, names, x, runner)
        x = runner(layer, x)
        hessians.update({f"model.layers.{i}.{name}": acc.hessian() for name, acc in accumulators.items()})
    return hessians


def rtn(method: str, weight: torch.Tensor, group_size: int):
    if method == "affine4":
        return quantize_affine(weight, group_size)
    from quant.lut import quantize_lut

    return quantize_lut(weight, group_size)


def eval_loss(quantized: dict, eval_tokens: torch.Tensor, windows: int, device: torch.device) -> float:
    """Held-out eval loss of the fixture with ``quantized`` weights (name -> QuantizedWeight), fp32 math."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from fixtures.evaluation import stream_loss

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).to(device)
    with torch.no_grad():
        for name, qw in quantized.items():
            model.get_parameter(name + ".weight").copy_(qw.dequantize().float())
    return stream_loss(model, eval_tokens, seq_len=512, batch_size=16, max_windows=windows).loss


def gptq_callback(method: str, group_size: int, lut_refits: int):
    def quantize(name: str, weight: torch.Tensor, hessian: torch.Tensor):
        return gptq_quantize(weight, hessian, method, group_size, lut_refits=lut_refits, name=name)

    return quantize


def fixture_part(opts, device: torch.device) -> dict:
    args, tensors, tokenizer = load_fixture()
    t0 = time.perf_counter()
    calibration = sample_calibration(
        fixture_corpus_text(opts.calibration_split), tokenizer, opts.samples, opts.length, opts.seed
    )
    eval_text = fixture_corpus_text("eval")
    held_out = sample_calibration(eval_text, tokenizer, opts.held_out_samples, opts.length, opts.seed)
    eval_tokens = torch.tensor(encode(tokenizer, eval_text))
    print(
        f"tokenized calibration ({opts.calibration_split}) and held-out (eval) text in {time.perf_counter() - t0:.1f} s"
    )
    t0 = time.perf_counter()
    held_h = held_out_hessians(fresh_core(args, tensors, opts.length, device), held_out.tokens)
    print(f"held-out Hessians of {len(held_h)} linears in {time.perf_counter() - t0:.1f} s")

    weights = {name: tensors[name + ".weight"].to(device) for name in held_h}
    result = {
        "calibration": {"split": opts.calibration_split, **calibration.identity()},
        "held_out": {"split": "eval", **held_out.identity()},
        "eval_loss": {"fp16": eval_loss({}, eval_tokens, opts.eval_windows, device)},
        "layers": {name: {} for name in held_h},
        "seconds": {},
    }
    for method, group_size in FORMATS:
        rtn_q = {name: rtn(method, w, group_size) for name, w in weights.items()}
        core = fresh_core(args, tensors, opts.length, device)
        refits = opts.lut_refits if method == "lut4" else 0
        t0 = time.perf_counter()
        callback = each_linear(gptq_callback(method, group_size, refits))
        gptq_q = quantize_sequential(core, calibration.tokens, callback).quantized
        result["seconds"][method] = time.perf_counter() - t0
        for name, w in weights.items():
            result["layers"][name][method] = {
                "rtn": output_error(w.float() - rtn_q[name].dequantize().float(), held_h[name]),
                "gptq": output_error(w.float() - gptq_q[name].dequantize().float(), held_h[name]),
                "signal": output_error(w.float(), held_h[name]),
                "damping": gptq_q[name].stats["damping"],
                "lut_refits_kept": gptq_q[name].stats["lut_refits_kept"],
            }
        result["eval_loss"][f"{method} rtn"] = eval_loss(rtn_q, eval_tokens, opts.eval_windows, device)
        result["eval_loss"][f"{method} gptq"] = eval_loss(gptq_q, eval_tokens, opts.eval_windows, device)
    print_fixture(result)
    return result


def print_fixture(result: dict) -> None:
    layers = result["layers"]
    print("\nper linear: held-out output error per token, GPTQ / RTN (and RTN error relative to ||W x||^2)")
    print(f"{'linear':<34} " + " ".join(f"{m + ' gptq/rtn':>17} {'rtn rel':>8}" for m, _ in FORMATS))
    for name, row in layers.items():
        cells = " ".join(
            f"{row[m]['gptq'] / row[m]['rtn']:>17.3f} {row[m]['rtn'] / row[m]['signal']:>8.2e}" for m, _ in FORMATS
        )
        print(f"{name:<34} {cells}")
    print(f"\n{'format':<8} {'RTN total':>11} {'GPTQ total':>11} {'ratio':>6} {'median':>7} {'worst':>6} {'GPTQ s':>7}")
    for method, _ in FORMATS:
        ratios = sorted(row[method]["gptq"] / row[method]["rtn"] for row in layers.values())
        rtn_total = sum(row[method]["rtn"] for row in layers.values())
        gptq_total = sum(row[method]["gptq"] for row in layers.values())
        print(
            f"{method:<8} {rtn_total:>11.4g} {gptq_total:>11.4g} {gptq_total / rtn_total:>6.3f} "
            f"{ratios[len(ratios) // 2]:>7.3f} {ratios[-1]:>6.3f} {result['seconds'][method]:>7.1f}"
        )
    damped = sorted({row[m]["damping"] for row in layers.values() for m, _ in FORMATS})
    print(f"damping used (x mean diag H): {damped}")
    print(
        "\nheld-out eval loss (ppl): "
        + ", ".join(f"{k} {v:.4f} ({math.exp(v):.2f})" for k, v in result["eval_loss"].items())
    )


# ---------------------------------------------------------------- timing part


def structured_batches(tokens: int, features: int, device: torch.device, batch: int = 2048) -> list[torch.Tensor]:
    """fp16 activations [batch, features]: rank-256 correlated part plus noise, heavy-tailed per-feature gains."""
    g = torch.Generator(device).manual_seed(0)
    mix = torch.randn(256, features, device=device, generator=g) / 16
    gains = torch.rand(features, device=device, generator=g).pow(4) * 8 + 0.05
    batches = []
    for _ in range(tokens // batch):
        z = torch.randn(batch, 256, device=device, generator=g) @ mix
        z += 0.3 * torch.randn(batch, features, device=device, generator=g)
        batches.append((z * gains).half())
    return batches


def timing_part(opts, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    out_f = opts.out_features or (5120 if cuda else 1280)
    in_f = opts.in_features or (17408 if cuda else 4352)
    samples = opts.timing_samples or (128 if cuda else 8)
    warm = structured_batches(2048, 512, device)[0]  # initialize cuBLAS / cuSOLVER / kernels outside the clock
    warm_acc = HessianAccumulator(512, device)
    warm_acc.add(warm)
    for method, group_size in FORMATS:
        gptq_quantize(torch.randn(256, 512, device=device).half(), warm_acc.hessian(), method, group_size)

    batches = structured_batches(samples * 2048, in_f, device)
    weight = (0.02 * torch.randn(out_f, in_f, device=device, generator=torch.Generator(device).manual_seed(1))).half()
    seconds = {}
    sync(device)
    t0 = time.perf_counter()
    acc = HessianAccumulator(in_f, device)
    for b in batches:
        acc.add(b)
    hessian = acc.hessian()
    sync(device)
    seconds["hessian"] = time.perf_counter() - t0
    del batches
    t0 = time.perf_counter()
    inverse_factor(hessian, 0.01, "bench")
    sync(device)
    seconds["damping + Cholesky + inverse"] = time.perf_counter() - t0
    ratios = {}
    for method, group_size in FORMATS:
        t0 = time.perf_counter()
        qw = gptq_quantize(weight, hessian, method, group_size, name="bench.down_proj")
        sync(device)
        seconds[f"gptq_quantize {method}"] = time.perf_counter() - t0
        ratios[method] = qw.stats["error_ratio"]
    shape = f"{out_f}x{in_f}, {samples}x2048 tokens"
    print(f"\nGPTQ time, {shape}, {machine(device)}")
    for what, s in seconds.items():
        print(f"  {what:<32} {s:8.2f} s")
    for method, _ in FORMATS:
        total = seconds["hessian"] + seconds[f"gptq_quantize {method}"]
        print(f"  {'total ' + method:<32} {total:8.2f} s   (calibration output error GPTQ/RTN {ratios[method]:.3f})")
    return {"shape": shape, "seconds": seconds, "error_ratio": ratios}


def main() -> None:
    opts = parse_args()
    device = torch.device(opts.device)
    print(machine(device))
    results = {"machine": machine(device)}
    if opts.part in ("fixture", "all"):
        from fixtures.corpus import split_path

        if split_path(opts.calibration_split).is_file():
            results["fixture"] = fixture_part(opts, device)
        else:
            hint = "python -m fixtures.build_corpus"
            print(f"fixture part skipped: the {opts.calibration_split} split is not built ({hint})")
    if opts.part in ("timing", "all"):
        results["timing"] = timing_part(opts, device)
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
