"""Benchmark: the shipped fp16 .aimodel on the Core AI runtime against the fp16 torch modules, on the fixture.

Packages the fixture target with logits returned (the shipped default does not return them), then runs the
package check sequence (prefill, greedy decode steps, a verify block after a rollback) on held-out text and
prints the agreement and the time per call. Run from the repo root: `.venv/bin/python -m bench.coreai_runtime`.
"""

from __future__ import annotations

import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from convert.backends import coreai
from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models.qwen3 import Qwen3Args
from convert.verify import checks
from convert.weights.target import build_modules
from fixtures import corpus

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "stdlib-qwen3"


def main() -> None:
    args = Qwen3Args.from_config(read_json(FIXTURE / "config.json"))
    target = Target(source="path:x", graphs=Graphs(prefill=64, verify=8), context=512, logits=True)
    modules = build_modules(args, target, load_tensors(FIXTURE), torch.float16)
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    prompt = tokenizer(corpus.read_split("eval")[1].text).input_ids[:40]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fixture.aimodel"
        start = time.perf_counter()
        coreai.package(modules.functions, path)
        package_s = time.perf_counter() - start
        with coreai.open_session(path) as session:
            timed = TimedSession(session)
            stats = checks.run_coreai(timed, modules, prompt)
        worst_abs = timed.worst_abs_logits(modules)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}")
    print(f"package (3 functions): {package_s:.1f} s")
    for name, seconds in timed.seconds.items():
        print(f"runtime {name}: {np.mean(seconds):.2f} s per call over {len(seconds)} calls")
    print(f"argmax compared {stats['argmax_compared']}, near ties {stats['argmax_near_ties']}, mismatches 0")
    print(f"logits: max |delta| {worst_abs:.4f}, relative to the largest |logit| {stats['max_output_delta']:.2e}")


class TimedSession:
    """Wraps a Core AI session: times each call and keeps the outputs to compare with torch afterwards."""

    def __init__(self, session):
        self.session, self.seconds, self.calls = session, {}, []

    def __getattr__(self, name):  # the rest of the session's interface (states) as it is
        return getattr(self.session, name)

    def reset(self) -> None:
        self.session.reset()
        self.calls.append(("reset", None, None))

    def call(self, name, inputs):
        start = time.perf_counter()
        out = self.session.call(name, inputs)
        self.seconds.setdefault(name, []).append(time.perf_counter() - start)
        self.calls.append((name, inputs, out))
        return out

    def worst_abs_logits(self, modules) -> float:
        """Replays the same calls in torch (fresh states) and returns the largest absolute logit difference."""
        modules.reset()
        worst = 0.0
        for name, inputs, out in self.calls:
            if name == "reset":
                modules.reset()
                continue
            ref = modules.call(name, inputs["input_ids"], inputs["position_ids"])["logits"].float().numpy()
            worst = max(worst, float(np.abs(out["logits"].astype(np.float32) - ref).max()))
        return worst


if __name__ == "__main__":
    main()
