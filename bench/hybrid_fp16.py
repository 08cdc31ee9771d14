"""Benchmark: the package check's run (``checks.lockstep``: prefill, decodes, a rollback or partial accept) of the
targets ``tests/test_fp16.py`` checks (the seeded dense Qwen3, hybrid Qwen3.5 CausalLM and ConditionalGeneration, and
the trained ``fixtures/`` checkpoints as they are), in either layout, the fp16 modules computing in one arithmetic
(``true``: ``true_fp16``, the Core AI runtime's on the CPU; ``ane`` / ``gpu``: ``device_arithmetic``; ``torch``:
torch's own kernels; ``floor``, ``floor1``..``floor8``: the fp32 modules with each projection's input stored in fp16,
``convert.fp16.StoredInputs``, dithered K) against the fp32 modules, with the check's bounds lifted: the worst output
and state deltas (relative to the largest magnitude), by name (docs/fp16.md, "Every package kind in the devices'
arithmetic"). Run from the repo root: ``.venv/bin/python -m bench.hybrid_fp16 --case hybrid --layout ane --mode
layout`` (``--mode layout``: the device of the layout, as the gate's device pass takes it). The seconds are
indicative only: true fp16 with two torch threads on a shared 2-core machine runs up to 500x slower than with one
(threads spin-waiting)."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import arguments, write_json
from convert.export.functions import compute_copy
from convert.fp16 import StoredInputs, device_arithmetic, true_fp16
from convert.pipeline.build import shipped_modules
from convert.pipeline.plan import make_plan
from convert.runtime.host import ModuleFunctions
from convert.verify import checks, gates

ROOT = Path(__file__).resolve().parent.parent
RECIPE = """\
name: t
target:
  source: path:{source}
  graphs: {{prefill: 16, decode: 1, verify: 8}}
  context: 128
  layout: {layout}
  gate: {{data: {{samples: 2, length: 64}}, greedy_tokens: 8}}
  logits: true
backends: [coreai]
"""
CASES = ("dense", "hybrid", "hybrid-conditional")
TRAINED = {"trained-dense": "stdlib-qwen3", "trained-hybrid": "stdlib-qwen3_5"}  # the fixtures/ checkpoints as they are


def write_case(case: str, directory: Path) -> None:
    """The fixture of ``case``, as ``tests/test_fp16.py`` writes it."""
    from tests.helpers.checkpoints import write_checkpoint
    from tests.helpers.qwen3_5_checkpoints import write_checkpoint as write_hybrid

    if case == "dense":
        write_checkpoint(directory, hidden_size=128, intermediate_size=384, num_hidden_layers=4)
    else:
        write_hybrid(directory, conditional=case == "hybrid-conditional")


def arithmetic(mode: str):
    """The context the fp16 modules compute under: ``true`` fp16, a device's, or torch's own (``torch``); ``floor``,
    ``floorK`` (the fp32 modules under ``convert.fp16.StoredInputs``, dither K)."""
    if mode.startswith("floor"):
        return StoredInputs(int(mode[5:] or 0))
    if mode == "true":
        return true_fp16()
    if mode == "torch":
        return contextlib.nullcontext()
    return device_arithmetic(mode)


class InMode:
    """``Functions`` over ``modules`` computing under ``arithmetic(mode)``."""

    def __init__(self, modules, mode: str):
        self.functions, self.mode = ModuleFunctions(modules), mode

    def reset(self):
        self.functions.reset()

    def states(self):
        return self.functions.states()

    def call(self, name, inputs):
        with arithmetic(self.mode), torch.no_grad():
            return self.functions.call(name, inputs)


def measure(modules, mode: str) -> dict:
    """The check's run with ``modules`` (fp16) in ``mode`` against their fp32 copy, the bounds lifted: worst deltas,
    by output and by state."""
    outputs: dict[str, float] = {}
    compare = checks._compare

    def noting(function, p0, got, ref, stats):
        for name in ("taps", "hidden", "logits"):
            if name in got and name in ref:
                a, b = np.asarray(got[name], dtype=np.float32), ref[name]
                delta = float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))
                key = f"{function}.{name}"
                outputs[key] = max(outputs.get(key, 0.0), delta)
        compare(function, p0, got, ref, stats)

    fp32 = compute_copy(modules, torch.float32)
    computing = compute_copy(modules, torch.float32) if mode.startswith("floor") else modules  # own states
    runtime, reference = InMode(computing, mode), ModuleFunctions(fp32)
    saved = checks.FP16_OUTPUT_BOUND, checks.FP16_STATE_BOUND, checks._compare
    checks.FP16_OUTPUT_BOUND = checks.FP16_STATE_BOUND = float("inf")
    checks._compare = noting  # the check's own comparison, each delta noted by name on the way
    start = time.perf_counter()
    try:
        stats = checks.lockstep(runtime, reference, modules.widths, modules.contract, modules.core.args.vocab_size)
    finally:
        checks.FP16_OUTPUT_BOUND, checks.FP16_STATE_BOUND, checks._compare = saved
    got, ref = runtime.states(), reference.states()
    states = {}
    for name, want in ref.items():
        want = np.asarray(want, dtype=np.float32)
        states[name] = float(np.abs(np.asarray(got[name], dtype=np.float32) - want).max()
                             / max(1.0, float(np.abs(want).max())))
    return {"max_output_delta": stats["max_output_delta"], "max_state_delta": stats["max_state_delta"],
            "argmax_compared": stats["argmax_compared"], "argmax_near_ties": stats["argmax_near_ties"],
            "outputs": outputs, "states": states, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--case", choices=(*CASES, *TRAINED), action="append")
    parser.add_argument("--layout", choices=("stateful", "ane"), action="append")
    modes = ("true", "ane", "gpu", "torch", "layout", "floor", *(f"floor{k}" for k in range(1, 9)))  # floorK: dither K
    parser.add_argument("--mode", choices=modes, action="append")
    options = parser.parse_args()
    results = []
    for case in options.case or CASES:
        for layout in options.layout or ("stateful", "ane"):
            with tempfile.TemporaryDirectory(prefix="spec-convert-bench-") as tmp:
                source = ROOT / "fixtures" / TRAINED[case] if case in TRAINED else Path(tmp) / "ckpt"
                if case not in TRAINED:
                    write_case(case, source)
                recipe = Path(tmp) / "recipe.yaml"
                recipe.write_text(RECIPE.format(source=source, layout=layout))
                modules, _ = shipped_modules(make_plan(recipe, str(Path(tmp) / "out")))
                for mode in options.mode or ("true", "layout"):
                    mode = gates.DEVICE_OF_LAYOUT[layout] if mode == "layout" else mode
                    result = {"case": case, "layout": layout, "mode": mode, **measure(modules, mode)}
                    print(json.dumps(result), flush=True)
                    results.append(result)
    write_json(options.json, results)


if __name__ == "__main__":
    main()
