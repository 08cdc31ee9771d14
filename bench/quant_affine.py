"""Benchmark: affine4 (``quant/affine.py``) against coremltools' int4 per-block linear quantization.

On the same seeded synthetic fp16 matrix as ``bench/quant_lut.py`` (Gaussian, std 0.02, ``--size`` square) and on
the fixture model's real weights, with groups of ``--group-size`` input columns, prints seconds and weight MSE of:

- ours: ``quantize_affine`` (MLX's affine grid in shift-scale form, zero exact; see its module docstring);
- coremltools: ``ct.optimize.coreml.linear_quantize_weights`` with ``OpLinearQuantizerConfig(mode="linear",
  dtype="uint4", granularity="per_block", block_size=G)`` on a converted one-layer model (conversion not timed);
  its shipped weight is read back from the ``constexpr_blockwise_shift_scale`` op.

Times are the best of ``--repeats`` runs with ``--threads`` torch CPU threads. coremltools rows are skipped where it
is not installed (the GPU machine).

Run: ``PYTHONPATH=. .venv/bin/python bench/quant_affine.py [--device cuda]``.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from bench.quant_lut import (
    HEADER,
    RULE,
    best_of,
    fixture_weights,
    installed,
    mse,
    one_layer_coreml_model,
    parse_args,
    row,
)
from quant.affine import quantize_affine


def ours(weight: torch.Tensor, group_size: int, repeats: int):
    seconds, qw = best_of(repeats, lambda: quantize_affine(weight, group_size), weight.device)
    return seconds, mse(qw.dequantize(), weight)


def coremltools_linear(weight: torch.Tensor, group_size: int, repeats: int):
    import coremltools as ct

    model = one_layer_coreml_model(weight)
    op = ct.optimize.coreml.OpLinearQuantizerConfig(
        mode="linear", dtype="uint4", granularity="per_block", block_size=group_size
    )
    config = ct.optimize.coreml.OptimizationConfig(global_config=op)
    seconds, quantized = best_of(
        repeats, lambda: ct.optimize.coreml.linear_quantize_weights(model, config), torch.device("cpu")
    )
    return seconds, mse(_shift_scale_weight(quantized, weight.shape), weight)


def _shift_scale_weight(model, shape) -> torch.Tensor:
    """The dense weight of the one ``constexpr_blockwise_shift_scale`` op: scale * (data - offset), in fp16."""
    ops = [o for o in model._mil_program.functions["main"].operations if o.op_type == "constexpr_blockwise_shift_scale"]
    op = ops[0]
    data = op.data.val.astype(np.float32)
    scale = op.scale.val.astype(np.float32)
    offset = op.offset.val.astype(np.float32) if op.offset is not None else np.zeros_like(scale)
    block = data.shape[1] // scale.shape[1]
    dense = (data - np.repeat(offset, block, axis=1)) * np.repeat(scale, block, axis=1)
    return torch.from_numpy(dense.astype(np.float16)).view(shape)


def main() -> None:
    args, device, weight = parse_args(__doc__.splitlines()[0], 64, "groups of {} columns")
    quantize_affine(weight[:16].to(device), args.group_size)  # warm-up
    tensors = {f"synthetic {args.size}x{args.size}": weight}
    tensors.update({f"{k} {list(v.shape)}": v for k, v in fixture_weights().items()})
    print(HEADER, RULE, sep="\n")
    for label, tensor in tensors.items():
        scale = float(tensor.float().pow(2).mean())
        theirs = coremltools_linear(tensor, args.group_size, args.repeats) if installed("coremltools") else None
        print(row(f"ours ({device.type}): {label}", *ours(tensor.to(device), args.group_size, args.repeats), theirs,
                  scale))
        if theirs:
            print(row(f"coremltools: {label}", *theirs, theirs, scale))
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
