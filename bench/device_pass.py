"""Benchmark: the gate's device pass (``gates.device_pass``, docs/fp16.md "The gate's device pass") on a fixture, in
either layout, beside the fp32 candidate: both passes' mean KL, top-1 and greedy match, the range verdict's tightest
tensors and the time. A recipe for the fixture is written to a temporary folder and planned as ``build`` plans it
(the layout's device: ``ane`` for ``layout: ane``, ``gpu`` for ``stateful``). ``--residual-scale B`` /
``--mlp-scale B`` gate a function-preserving rescale of the fixture instead (``tests/helpers/rescaled.py``), whose
range scales (``convert/weights/rescale.py``, measured on the first window) the build folds as ``shipped_modules``
does. Run from the repo root:
``.venv/bin/python -m bench.device_pass --fixture stdlib-qwen3 --layout ane [--method lut4]``."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench.common import arguments, write_json
from convert.pipeline.build import shipped_modules
from convert.pipeline.plan import make_plan
from convert.verify import gates

ROOT = Path(__file__).resolve().parent.parent
RECIPE = """name: device-pass
target:
  source: path:{source}
  graphs: {{prefill: 64, decode: 1, verify: 8}}
  context: 512
  layout: {layout}
{quantization}  gate:
    data: {{samples: {n}, length: {length}}}
    device_samples: {n}
backends: [coreai]
"""


def main() -> None:
    parser = arguments(__doc__, "also write the summary here")
    parser.add_argument("--fixture", choices=("stdlib-qwen3", "stdlib-qwen3_5"), default="stdlib-qwen3")
    parser.add_argument("--layout", choices=("stateful", "ane"), default="stateful")
    parser.add_argument("--method", choices=("none", "affine4", "lut4"), default="none")
    parser.add_argument("--n", type=int, default=4, help="windows, every one also in the device pass")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--residual-scale", type=float, help="gate the fixture's residual stream times this")
    parser.add_argument("--mlp-scale", type=float, help="gate the fixture's MLP intermediates times this")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spec-convert-bench-") as tmp:
        source = ROOT / "fixtures" / options.fixture
        if options.residual_scale or options.mlp_scale:
            from tests.helpers.rescaled import mlp_rebalanced, residual_scaled
            source = (residual_scaled(source, Path(tmp) / "scaled", options.residual_scale) if options.residual_scale
                      else mlp_rebalanced(source, Path(tmp) / "scaled", options.mlp_scale))
        quantization = "" if options.method == "none" else f"  quantization: {{method: {options.method}}}\n"
        recipe = Path(tmp) / "recipe.yaml"
        recipe.write_text(RECIPE.format(source=source, layout=options.layout, quantization=quantization, n=options.n,
                                        length=options.length))
        plan = make_plan(recipe, str(Path(tmp) / "out"))
        start = time.perf_counter()
        modules, _ = shipped_modules(plan)  # the range scales measured on the first window, folded
        load_seconds = time.perf_counter() - start
        start = time.perf_counter()
        report = gates.gate_target(plan, modules)
        seconds = time.perf_counter() - start
    device = report.device
    picked = ("kl_mean", "top1", "greedy_match")
    summary = {
        "fixture": options.fixture, "layout": options.layout, "method": options.method, "windows": options.n,
        "length": options.length, "residual_scale": options.residual_scale, "mlp_scale": options.mlp_scale,
        "fp32": {m.name: m.value for m in report.metrics if m.name in picked},
        "device": device.device, "device_metrics": {m.name: m.value for m in device.metrics if m.name in picked},
        "range_passed": device.range.passed, "range_checked": device.range.checked,
        "tightest": [(e.tensor, e.kind, e.peak, e.headroom) for e in device.range.tightest[:3]],
        "first_over": device.range.over[0].phrase() if device.range.over else None,
        "gate_seconds": round(seconds, 1), "device_pass_seconds": round(device.seconds, 1), "passed": report.passed,
        "shipped_modules_seconds": round(load_seconds, 1),
        "rescale": None if modules.rescale is None else {
            "residual_scale": modules.rescale.residual_scale, "mlp_scales": modules.rescale.mlp_scales,
            "tightest": [(e.tensor, e.kind, e.peak, e.scaled) for e in modules.rescale.tightest[:3]]},
    }
    print(json.dumps(summary, indent=1))
    write_json(options.json, summary)


if __name__ == "__main__":
    main()
