"""Benchmark: the GPTQ sweep at the 27B widths: stacked linears that share a Hessian against each in its own sweep,
and the CUDA-graph sweep against the eager one.

The matrices of a Qwen3.8-27B layer that read one input (attention q/k/v: 6144, 1024 and 1024 rows; a Gated
DeltaNet's in_proj_qkv / in_proj_z: 10240 and 6144; the MLP's gate / up: 17408 each; 5120 columns) and down_proj
(5120 x 17408) are quantized under seeded Hessians by ``gptq_quantize_shared``, eager (``CUDA_GRAPHS`` off) and
graphed, and by ``gptq_quantize`` one at a time; prints the times and whether codes and tables are bit for bit
equal. The first row includes the device's warm-up.

    PYTHONPATH=. python3 -m bench.gptq_stacked [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from quant import gptq

STACKS = (((6144, 1024, 1024), 5120), ((10240, 6144), 5120), ((17408, 17408), 5120), ((5120,), 17408))
SAMPLES = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device

    def synchronized() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    generator = torch.Generator(device).manual_seed(0)
    hessians = {}
    for rows, columns in STACKS:
        if columns not in hessians:
            x = torch.randn(SAMPLES, columns, generator=generator, device=device)
            hessians[columns] = 2 * x.T @ x / SAMPLES
        hessian = hessians[columns]
        weights = [0.02 * torch.randn(r, columns, generator=generator, device=device) for r in rows]
        for method, group in (("lut4", 16), ("affine4", 64)):
            fields = ("codes", "lut") if method == "lut4" else ("codes", "scale", "zero_point")
            times, results = {}, {}
            for name, graphs, stacked in (("eager", False, True), ("graphed", True, True), ("alone", True, False)):
                gptq.CUDA_GRAPHS = graphs
                start = synchronized()
                results[name] = gptq.gptq_quantize_shared(weights, hessian, method, group) if stacked else \
                    [gptq.gptq_quantize(w, hessian, method, group) for w in weights]
                times[name] = synchronized() - start
            gptq.CUDA_GRAPHS = True
            equal = all(torch.equal(getattr(a, f), getattr(b, f)) for other in ("graphed", "alone")
                        for a, b in zip(results["eager"], results[other], strict=True) for f in fields)
            print(f"{method} rows {rows} x {columns}: stacked eager {times['eager']:.2f} s, stacked graphed "
                  f"{times['graphed']:.2f} s, one by one graphed {times['alone']:.2f} s; bit-equal {equal}", flush=True)


if __name__ == "__main__":
    main()
