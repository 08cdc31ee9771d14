"""Benchmark: the numeric gate on a fixture over held-out windows, timed, with its table.

The fixture target (``--fixture stdlib-qwen3``, the dense one, by default; ``stdlib-qwen3_5`` the hybrid one; taps
at layers 3 and 7, the default graph widths) with its fp16 weights as shipped, or
quantized exactly as ``build`` ships it (``--method affine4 | lut4 | affine4-gptq | lut4-gptq``: the build's
quantize stage, ``convert.weights.quantize.quantize_checkpoint``, with the recipe defaults: every decoder linear, the
lm_head and the embedding table at the format's default group size; GPTQ calibrated on the fixture corpus's train split
with the recipe's default calibration, 32 x 256 tokens, unless ``--calibration-samples`` / ``--calibration-length``
say otherwise), gated against the transformers model in fp32
with ``default_thresholds(method)``. Run from the repo root: ``.venv/bin/python -m bench.gates [--method M]
[--fixture F]``.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from tokenizers import Tokenizer

from bench.common import arguments
from convert.export.quantized import apply_quantized
from convert.inputs.recipe import Calibration, Graphs, Quantization, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models import read_args
from convert.models.layout import Layout
from convert.verify import gates
from convert.weights.quantize import quantize_checkpoint
from convert.weights.target import build_modules

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TAPS = [3, 7]


def main() -> None:
    parser = arguments(__doc__, "also write the report here")
    parser.add_argument("--method", choices=("none", "affine4", "lut4", "affine4-gptq", "lut4-gptq"), default="none")
    parser.add_argument("--fixture", choices=("stdlib-qwen3", "stdlib-qwen3_5"), default="stdlib-qwen3")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--compute-dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--calibration-samples", type=int, default=Calibration().samples)
    parser.add_argument("--calibration-length", type=int, default=Calibration().length)
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)

    start = time.perf_counter()
    fixture = FIXTURES / options.fixture
    args = read_args(read_json(fixture / "config.json"))
    target = Target(source="path:x", graphs=Graphs(), context=512, taps=TAPS)
    modules = build_modules(args, target, load_tensors(fixture), torch.float16)
    if options.method != "none":
        quantization = Quantization(method=options.method,
                                    calibration=Calibration(samples=options.calibration_samples,
                                                            length=options.calibration_length))
        result = quantize_checkpoint(fixture, args, target, Layout(), quantization, fixture)
        apply_quantized(modules.core, result.weights)
    reference = gates.load_reference(fixture)
    tokenizer = Tokenizer.from_file(str(fixture / "tokenizer.json"))
    data = gates.EvalData.fixture(tokenizer, n=options.n, length=options.length)
    setup_s = time.perf_counter() - start

    report = gates.run_gates(reference, modules, data, gates.default_thresholds(options.method),
                             compute_dtype=getattr(torch, options.compute_dtype))
    console = Console(width=110)
    console.print(report.table())
    if options.json:
        report.write_json(options.json)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"fixture {options.fixture}, method {options.method}, candidate: {report.candidate}")
    print(f"data: {data.identity.corpus} sha256 {data.identity.corpus_sha256[:16]}, {options.n} x {options.length}")
    print(f"setup (load, quantize incl. any GPTQ calibration, tokenize): {setup_s:.1f} s; gate: {report.seconds:.1f} s")


if __name__ == "__main__":
    main()
