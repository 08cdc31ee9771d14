"""Benchmark: the stateful and the ane layouts side by side on the embedded fixture (README "Layouts").

Builds ``recipes/tiny_qwen3.yaml`` (fixtures/stdlib-qwen3) twice into a scratch directory, once per ``target.layout``,
through ``spec-convert build`` (both formats, every gate and check), then reads each bundle back and reports per
format: the op kinds of each function's program and those outside the placement lint's vocabulary, the lint's
findings, the package's bytes, and per call the bytes that cross the call's boundary (its inputs and outputs, and the
states the package keeps), and the bytes the host writes after it (the ane layout's rows). It then computes the same
per-call figures for the attention layers of Qwen3.8-27B (16 attention layers, 4 KV heads of 256, context 8192) from
the same formulas; the 27B's Gated DeltaNet layers have no ane functions yet. In the ane layout the host also looks
up each call's embedding rows (the call's ``hidden_states`` input) and takes the argmax of the ``logits`` output:
both are in the call's inputs and outputs.

    PYTHONPATH=. python3 -m bench.layouts [--json docs/bench-logs/layouts-tiny-qwen3.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from convert import backends
from convert.verify.placement import VOCABULARY

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny_qwen3.yaml"
ATTENTION_27B = {"layers": 16, "kv_heads": 4, "head_dim": 256, "context": 8192}  # hybrid-27b.md: 1 of 4 layers


def build(layout: str, scratch: Path) -> tuple[Path, float]:
    text = RECIPE.read_text().replace("path:../fixtures/", f"path:{ROOT}/fixtures/")
    text = text.replace("  context: 512", f"  context: 512\n  layout: {layout}", 1)
    recipe = scratch / f"{layout}.yaml"
    recipe.write_text(text)
    bundle = scratch / layout
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "convert", "build", str(recipe), "-o", str(bundle), "--no-cache"],
                   check=True, cwd=ROOT, capture_output=True)
    return bundle, time.perf_counter() - start


def rows_written(spec, contract: dict) -> int:
    """Bytes the host writes after one call: the outputs its buffers are written from."""
    outputs = {t.name: t for t in spec.outputs}
    return sum(outputs[rule["rows"]].nbytes for rule in contract.get("buffers", {}).values())


def measure(bundle: Path) -> dict:
    manifest = json.loads((bundle / "manifest.json").read_text())
    contract, found = manifest["host_contract"], {}
    for package in manifest["packages"]:
        fmt, path = package["format"], bundle / package["path"]
        backend = backends.load(fmt)
        specs = backend.read_back(path)
        types = backend.operation_types(path) if fmt == "coreai" else backend.contents(path).operation_types
        found[fmt] = {
            "package_bytes": sum(f["size"] for f in package["files"]),
            "placement_findings": len(package["placement"]),
            "functions": {name: {
                "op_kinds": sorted(types[name]),
                "op_kinds_outside_vocabulary": sorted(types[name] - VOCABULARY[fmt]),
                "call_input_bytes": sum(t.nbytes for t in spec.inputs),
                "call_output_bytes": sum(t.nbytes for t in spec.outputs),
                "state_bytes": sum(t.nbytes for t in spec.states),
                "host_rows_written_bytes": rows_written(spec, contract),
            } for name, spec in specs.items()},
        }
    return found


def attention_27b(width: int) -> dict:
    """Per call at the 27B's attention geometry: the history each call reads (a state in one layout, an input in the
    other) and the rows a call writes (in the graph, or by the host)."""
    g = ATTENTION_27B
    row = 2 * g["layers"] * g["kv_heads"] * g["head_dim"] * 2  # a position's key and value rows, fp16
    return {"width": width, "history_bytes": row * g["context"], "rows_written_bytes": row * width}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = {"recipe": str(RECIPE.relative_to(ROOT)), "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as scratch:
        for layout in ("stateful", "ane"):
            bundle, seconds = build(layout, Path(scratch))
            results["layouts"][layout] = {"build_seconds": round(seconds, 1), **measure(bundle)}
    results["attention_27b"] = {name: attention_27b(width) for name, width in (("decode", 1), ("verify", 8))}
    for layout, formats in results["layouts"].items():
        print(f"{layout}: build {formats['build_seconds']} s")
        for fmt in ("coreai", "coreml"):
            got = formats[fmt]
            verify = got["functions"]["verify"]
            outside = ", ".join(verify["op_kinds_outside_vocabulary"]) or "none"
            print(f"  {fmt}: {got['package_bytes'] / 2**20:.2f} MiB, {got['placement_findings']} lint findings; "
                  f"verify: {len(verify['op_kinds'])} op kinds ({outside} outside the vocabulary), inputs "
                  f"{verify['call_input_bytes']:,} B, outputs "
                  f"{verify['call_output_bytes']:,} B, states {verify['state_bytes']:,} B, host writes "
                  f"{verify['host_rows_written_bytes']:,} B")
    for name, got in results["attention_27b"].items():
        print(f"27B attention layers, {name}: history {got['history_bytes'] / 2**20:.0f} MiB read per call, "
              f"{got['rows_written_bytes'] / 2**10:.0f} KiB of rows written per call")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
