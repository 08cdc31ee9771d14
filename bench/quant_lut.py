"""Benchmark: lut4 codebooks (``quant/lut.py``) against coremltools and coreai-opt k-means palettization.

On one seeded synthetic fp16 matrix (Gaussian, std 0.02; ``--size`` square, 4096 by default) with tables per
group of ``--group-size`` output rows, prints seconds and weight MSE of:

- ours: ``quantize_lut`` (exact DP codebooks, then nearest-entry codes) on ``--device``;
- coremltools, both ways a user meets it: its per-group k-means function alone
  (``_get_kmeans_lookup_table_and_weight``, what ``palettize_weights`` runs for every group) and
  ``ct.optimize.coreml.palettize_weights(mode="kmeans", granularity="per_grouped_channel")`` on a converted
  one-layer model (conversion not timed);
- coreai-opt's ``KMeansPalettizer`` on a one-layer torch model (its default fast mode, which rounds weights to
  4 decimals before clustering, and exact mode);

then ours against coremltools' per-group k-means on the fixture model's real weights. coremltools and
coreai-opt are imported only when installed (they are not on the GPU machine); their rows are skipped
otherwise. Times are the best of ``--repeats`` runs; torch uses ``--threads`` CPU threads (2).

Run: ``PYTHONPATH=. .venv/bin/python bench/quant_lut.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time
from pathlib import Path

import torch

from quant.lut import quantize_lut

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3"
FIXTURE_WEIGHTS = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "lm_head.weight",
)


def best_of(repeats: int, run, device: torch.device):
    """(seconds of the fastest of ``repeats`` calls, the last call's result)."""
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return min(seconds), result


def mse(shipped: torch.Tensor, weight: torch.Tensor) -> float:
    return float((shipped.float().cpu() - weight.float().cpu()).pow(2).mean())


def ours(weight: torch.Tensor, group_size: int, repeats: int):
    seconds, qw = best_of(repeats, lambda: quantize_lut(weight, group_size), weight.device)
    return seconds, mse(qw.dequantize(), weight)


def coremltools_kmeans(weight: torch.Tensor, group_size: int, repeats: int):
    from coremltools.models.neural_network.quantization_utils import _get_kmeans_lookup_table_and_weight

    groups = weight.cpu().numpy().reshape(weight.shape[0] // group_size, -1)

    def run():
        shipped = []
        for group in groups:
            table, codes = _get_kmeans_lookup_table_and_weight(4, group)
            shipped.append(torch.from_numpy(table.astype(group.dtype))[torch.from_numpy(codes.astype("int64"))])
        return torch.stack(shipped).view(weight.shape)

    seconds, shipped = best_of(repeats, run, torch.device("cpu"))
    return seconds, mse(shipped, weight)


def coremltools_palettize(weight: torch.Tensor, group_size: int, repeats: int):
    import coremltools as ct

    model = one_layer_coreml_model(weight)
    op = ct.optimize.coreml.OpPalettizerConfig(
        mode="kmeans", nbits=4, granularity="per_grouped_channel", group_size=group_size
    )
    config = ct.optimize.coreml.OptimizationConfig(global_config=op)
    seconds, palettized = best_of(
        repeats, lambda: ct.optimize.coreml.palettize_weights(model, config), torch.device("cpu")
    )
    return seconds, mse(_palettized_weight(palettized, weight.shape), weight)


def one_layer_coreml_model(weight: torch.Tensor):
    """A converted fp16 Core ML model of one bias-free linear holding ``weight`` (what coremltools compresses)."""
    import coremltools as ct

    out_features, in_features = weight.shape
    layer = torch.nn.Linear(in_features, out_features, bias=False).eval()
    layer.weight.data.copy_(weight.float().cpu())
    traced = torch.jit.trace(layer, torch.zeros(1, in_features))
    return ct.convert(
        traced,
        inputs=[ct.TensorType(name="x", shape=(1, in_features))],
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
    )


def _palettized_weight(model, shape) -> torch.Tensor:
    """The dense weight of the model's one ``constexpr_lut_to_dense`` op (lut [groups, 1, 16, 1], indices)."""
    ops = [op for op in model._mil_program.functions["main"].operations if op.op_type == "constexpr_lut_to_dense"]
    lut = torch.from_numpy(ops[0].lut.val.reshape(ops[0].lut.val.shape[0], -1))
    indices = torch.from_numpy(ops[0].indices.val.astype("int64")).view(shape)
    rows = torch.arange(shape[0]) // (shape[0] // lut.shape[0])
    return lut[rows[:, None], indices]


def coreai_opt_kmeans(weight: torch.Tensor, group_size: int, repeats: int, fast: bool):
    from coreai_opt.palettization import (
        KMeansPalettizer,
        KMeansPalettizerConfig,
        ModuleKMeansPalettizerConfig,
        PalettizationSpec,
    )
    from coreai_opt.palettization.spec.granularity import PerGroupedChannelGranularity

    out_features, in_features = weight.shape
    spec = PalettizationSpec(n_bits=4, granularity=PerGroupedChannelGranularity(group_size=group_size))
    config = KMeansPalettizerConfig(
        global_config=ModuleKMeansPalettizerConfig(op_state_spec={"weight": spec}, enable_fast_kmeans_mode=fast)
    )

    def run():
        model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False)).half()
        model[0].weight.data.copy_(weight.cpu())
        example = (torch.zeros(1, in_features, dtype=torch.float16),)
        return KMeansPalettizer(model, config).prepare(example_inputs=example)[0].weight.detach()

    run_small = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False)).half()  # builds its C++ k-means once
    KMeansPalettizer(run_small, config).prepare(example_inputs=(torch.zeros(1, 16, dtype=torch.float16),))
    seconds, shipped = best_of(repeats, run, torch.device("cpu"))
    return seconds, mse(shipped, weight)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def fixture_weights() -> dict[str, torch.Tensor]:
    if not installed("safetensors") or not FIXTURE.exists():
        return {}
    from safetensors import safe_open

    found = {}
    for path in sorted(FIXTURE.glob("*.safetensors")):
        with safe_open(path, framework="pt") as shards:
            found.update({name: shards.get_tensor(name) for name in FIXTURE_WEIGHTS if name in shards.keys()})
    return {name: found[name].half() for name in FIXTURE_WEIGHTS if name in found}


def row(name: str, seconds: float, error: float, reference: tuple[float, float] | None, scale: float) -> str:
    speedup = f"{reference[0] / seconds:7.1f}x" if reference else "       "
    relative = f"{error / reference[1] - 1:+.2e}" if reference else ""
    return f"| {name:<62} | {seconds:8.3f} | {speedup} | {error:.4e} | {error / scale:.4e} | {relative:>9} |"


HEADER = "| method | seconds | vs ct | weight MSE | MSE / E[w^2] | MSE vs ct |"
RULE = "| --- | ---: | ---: | ---: | ---: | ---: |"


def parse_args(description: str, group_size: int, groups: str) -> tuple[argparse.Namespace, torch.device, torch.Tensor]:
    """The quantizer benchmarks' common options, the device, and the seeded synthetic fp16 weight
    (``--size`` square, N(0, 0.02^2)); prints what runs where."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=group_size)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    weight = (torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(args.seed)) * 0.02).half()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"weight {args.size}x{args.size} fp16 N(0, 0.02^2) seed {args.seed}, {groups.format(args.group_size)}")
    print(f"load average at start {os.getloadavg()[0]:.2f} (other processes share these cores)")
    return args, device, weight


def main() -> None:
    args, device, weight = parse_args(__doc__.splitlines()[0], 16, "tables per {} rows")
    quantize_lut(weight[: args.group_size].to(device), args.group_size)  # warm-up (CUDA context, kernels)
    scale = float(weight.float().pow(2).mean())
    results = {"ours": ours(weight.to(device), args.group_size, args.repeats)}
    if installed("coremltools"):
        results["coremltools k-means per group"] = coremltools_kmeans(weight, args.group_size, args.repeats)
        results["coremltools palettize_weights"] = coremltools_palettize(weight, args.group_size, args.repeats)
    if installed("coreai_opt"):
        for fast in (True, False):
            label = f"coreai-opt KMeansPalettizer ({'fast' if fast else 'exact'} mode)"
            results[label] = coreai_opt_kmeans(weight, args.group_size, args.repeats, fast)
    reference = results.get("coremltools k-means per group")
    print(HEADER, RULE, sep="\n")
    for label, (seconds, error) in results.items():
        print(row(f"{label} ({device.type})" if label == "ours" else label, seconds, error, reference, scale))
    if not installed("coremltools"):
        print("coremltools not installed: its rows skipped")
    if not installed("coreai_opt"):
        print("coreai-opt not installed: its rows skipped")

    weights = fixture_weights()
    if weights:
        print(f"\nfixture weights ({FIXTURE.name}, fp16), tables per {args.group_size} rows:")
        print(HEADER, RULE, sep="\n")
        for tensor_name, tensor in weights.items():
            label = f"{tensor_name} {list(tensor.shape)}"
            scale = float(tensor.float().pow(2).mean())
            theirs = coremltools_kmeans(tensor, args.group_size, args.repeats) if installed("coremltools") else None
            seconds, error = ours(tensor.to(device), args.group_size, args.repeats)
            print(row(f"ours: {label}", seconds, error, theirs, scale))
            if theirs:
                print(row(f"coremltools: {label}", *theirs, theirs, scale))
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
