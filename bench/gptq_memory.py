"""Benchmark: the host memory of GPTQ on one linear at the 27B drafters' widths (``quant.gptq.gptq_quantize`` on the
CPU, as the drafter stage quantizes), sampled in this process's resident memory (``VmRSS``, every 20 ms).

For each ``--shapes`` entry [out, in] it makes a seeded fp16 weight and a Hessian ``2 X^T X / n`` of seeded inputs
(``--samples`` rows: rank-deficient, so the sweep's damping is exercised as on real calibration data), then runs
lut4 (groups of 16 rows, as the release recipe's drafter) and reports the peak above what was held before the call
(the weight and the Hessian), in Hessians (``in^2`` fp32 matrices) and in GB, with the time and a hash of the codes
(the same codes before and after a memory change).

    PYTHONPATH=. python3 -m bench.gptq_memory [--shapes 5120x25600,5120x17408] [--json out.json]
"""

from __future__ import annotations

import hashlib
import time

import torch

from bench.common import Sampler, arguments, machine
from quant.gptq import gptq_quantize


def hessian_of(columns: int, samples: int, generator: torch.Generator) -> torch.Tensor:
    """``2 X^T X / n`` of seeded inputs [samples, columns], made a block of rows at a time."""
    hessian = torch.zeros(columns, columns)
    for lo in range(0, samples, 512):
        x = torch.randn(min(512, samples - lo), columns, generator=generator)
        hessian.addmm_(x.T, x, alpha=2.0 / samples)
    return hessian


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--shapes", default="5120x25600,5120x17408")
    parser.add_argument("--samples", type=int, default=2048)
    a = parser.parse_args()
    sampler = Sampler()
    rows = {}
    for text in a.shapes.split(","):
        out, columns = (int(n) for n in text.split("x"))
        generator = torch.Generator().manual_seed(0)
        weight = (torch.randn(out, columns, generator=generator) / columns**0.5).half()
        hessian = hessian_of(columns, a.samples, generator)
        held = sampler._rss()
        with sampler.phase(f"gptq lut4 of [{out}, {columns}]"):
            began = time.perf_counter()
            result = gptq_quantize(weight.float(), hessian, "lut4", 16, name=text)
            seconds = time.perf_counter() - began
        hessian_bytes = 4 * columns**2
        peak = sampler.phases[-1]["peak_gib"] * 2**30 - held
        rows[text] = {"seconds": round(seconds, 1), "hessian_gb": round(hessian_bytes / 1e9, 2),
                      "peak_above_inputs_gb": round(peak / 1e9, 2),
                      "peak_above_inputs_in_hessians": round(peak / hessian_bytes, 2),
                      "codes_sha256": hashlib.sha256(result.codes.numpy().tobytes()).hexdigest()[:16]}
        del weight, hessian, result
    sampler.stop()
    record = {"machine": machine("cpu"), "threads": torch.get_num_threads(), "samples": a.samples, "shapes": rows,
              "phases": sampler.phases, "base_gib": round(sampler.base / 2**30, 2)}
    summary = "; ".join(f"[{k}]: peak {v['peak_above_inputs_gb']} GB above its weight and Hessian "
                        f"({v['peak_above_inputs_in_hessians']} Hessians of {v['hessian_gb']} GB), {v['seconds']} s"
                        for k, v in rows.items())
    sampler.report(summary, record, a.json)


if __name__ == "__main__":
    main()
