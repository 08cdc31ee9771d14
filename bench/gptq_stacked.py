"""Benchmark: GPTQ of linears that share a Hessian, stacked in one sweep against each in its own, at the 27B widths.

The matrices of a Qwen3.8-27B layer that read one input (attention q/k/v: 6144, 1024 and 1024 rows; a Gated
DeltaNet's in_proj_qkv / in_proj_z: 10240 and 6144; the MLP's gate / up: 17408 each; 5120 columns) are quantized
under one seeded Hessian by ``gptq_quantize_shared`` and by ``gptq_quantize`` one at a time; prints both times and
whether codes and tables are bit for bit equal. The first row includes the device's warm-up.

    PYTHONPATH=. python3 -m bench.gptq_stacked [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from quant.gptq import gptq_quantize, gptq_quantize_shared

STACKS = ((6144, 1024, 1024), (10240, 6144), (17408, 17408))
COLUMNS = 5120


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device

    def synchronized() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(8192, COLUMNS, generator=generator, device=device)
    hessian = 2 * x.T @ x / x.shape[0]
    for rows in STACKS:
        weights = [0.02 * torch.randn(r, COLUMNS, generator=generator, device=device) for r in rows]
        for method, group in (("lut4", 16), ("affine4", 128)):
            start = synchronized()
            stacked = gptq_quantize_shared(weights, hessian, method, group)
            middle = synchronized()
            alone = [gptq_quantize(w, hessian, method, group) for w in weights]
            end = synchronized()
            fields = ("codes", "lut") if method == "lut4" else ("codes", "scale", "zero_point")
            equal = all(torch.equal(getattr(a, f), getattr(s, f)) for a, s in zip(alone, stacked, strict=True)
                        for f in fields)
            print(f"{method} rows {rows}: stacked {middle - start:.2f} s, alone {end - middle:.2f} s, "
                  f"bit-equal {equal}", flush=True)


if __name__ == "__main__":
    main()
