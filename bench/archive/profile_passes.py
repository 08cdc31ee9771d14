"""Where a layer's quantize time goes at the 27B geometry: each capture pass, the outputs pass and the solves, timed
(CUDA synchronised) around ``bench.scale``'s run. Usage: PYTHONPATH=. python3 -m bench.archive.profile_passes"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

import convert.weights.quantize as stage
import quant.calibrate as calibrate
from bench import scale


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    records = []

    def timed(name, fn):
        def wrapper(*a, **k):
            _sync()
            start = time.perf_counter()
            out = fn(*a, **k)
            _sync()
            label = name if name != "capture" else f"capture {','.join(n.split('.')[-1] for n in a[1])}"
            records.append((label, time.perf_counter() - start))
            return out
        return wrapper

    calibrate.capture_hessians = timed("capture", calibrate.capture_hessians)
    calibrate.layer_outputs = timed("outputs", calibrate.layer_outputs)
    stage.gptq_quantize = timed("solve", stage.gptq_quantize)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "ckpt"
        config = scale.write_checkpoint(directory, ["linear_attention", "full_attention"], "cuda")
        (directory.parent / "corpus.txt").write_text(scale._corpus())
        scale.run(directory, config, "lut4-gptq", 128, 2048, "cuda")
    for label, seconds in records:
        print(f"{label}: {seconds:.2f} s")


if __name__ == "__main__":
    main()
