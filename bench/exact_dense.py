"""Benchmark: what fp16 costs an ``exact`` pack's gate where the pack stores its dense tensors above fp16.

For each seed, a tiny Ternary Bonsai pack (``tests/helpers/prism_packs.py``: its 2-bit codes, fp16 scales and rotations,
and its dense tensors, the norms, ``A_log``, ``dt_bias``, the conv and ``in_proj_a`` / ``in_proj_b``, in ``--dense``
fp32 or bf16) is planned as ``build`` plans it (``method: exact``, the unfolded twin as the reference) and gated
(``gates.gate_target``: the fp32 candidate and the device pass), in two forms: ``shipped`` (as the build ships it: the
tensors ``convert/weights/precision.py`` names kept in fp32) and ``fp16`` (every dense tensor rounded to fp16, as
before issue #40's fix). Each line gives the gate's metrics and, for each top-1 flip of either pass, the reference's
gap between its id and the candidate's, in logits (a near tie is under 0.25). Run from the repo root:
``.venv/bin/python -m bench.exact_dense --seeds 0 1 2 3 4 5 [--dense bf16] [--samples 16 --length 64]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from convert.pipeline.build import shipped_modules
from convert.pipeline.plan import make_plan
from convert.verify import gates
from convert.weights import precision

ROOT = Path(__file__).resolve().parent.parent
RECIPE = """name: exact-dense
target:
  source: path:{pack}
  graphs: {{prefill: 16, decode: 1, verify: 8}}
  context: 128
  quantization: {{method: exact}}
  gate:
    data: {{samples: {samples}, length: {length}}}
    greedy_tokens: 4
backends: [coreai]
"""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PICKED = ("kl_mean", "kl_p99", "kl_max", "top1", "logits_cosine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--dense", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    options = parser.parse_args()
    from tests.helpers.prism_packs import write_pack

    gaps = []
    add = gates._Stats.add

    def recording_add(self, index, ref, cand, margin):  # the reference's gap at each top-1 flip
        want, got = ref.logits.argmax(-1), cand.logits.argmax(-1)
        gaps.extend(float(ref.logits[r, want[r]] - ref.logits[r, got[r]]) for r in (want != got).nonzero().flatten())
        return add(self, index, ref, cand, margin)

    gates._Stats.add = recording_add
    kept_names = precision.kept_fp32_names
    with tempfile.TemporaryDirectory(prefix="spec-convert-bench-") as tmp:
        for seed in options.seeds:
            root = Path(tmp) / str(seed)
            write_pack(root / "pack", root / "unfolded", seed=seed, dense_dtype=DTYPES[options.dense])
            (root / "r.yaml").write_text(RECIPE.format(pack=root / "pack", samples=options.samples,
                                                       length=options.length))
            for form in ("shipped", "fp16"):
                precision.kept_fp32_names = kept_names if form == "shipped" else lambda core, target: frozenset()
                plan = make_plan(root / "r.yaml", cache_root=root / "cache")
                modules, _ = shipped_modules(plan)
                gaps.clear()
                start = time.perf_counter()
                report = gates.gate_target(plan, modules)
                metrics = {m.name: m.value for m in report.metrics if m.name in PICKED}
                device = {m.name: m.value for m in report.device.metrics if m.name in ("kl_mean", "top1")}
                print(f"{options.dense} seed {seed} {form:7s} {options.samples}x{options.length}: "
                      + " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
                      + f" | device {' '.join(f'{k} {v:.4g}' for k, v in device.items())}"
                      + f" | flip gaps {[round(g, 5) for g in gaps]} | passed {report.passed}"
                      + f" | {time.perf_counter() - start:.1f} s", flush=True)
    precision.kept_fp32_names = kept_names


if __name__ == "__main__":
    main()
