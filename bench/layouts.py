"""Benchmark: the stateful and the ane layouts side by side on the embedded fixtures (docs/layouts.md).

Builds each fixture recipe (``recipes/tiny_qwen3.yaml``, the dense fixture, and ``recipes/tiny_qwen3_5.yaml``, the
hybrid one) twice into a scratch directory, once per ``target.layout``, through ``spec-convert build`` (both formats,
every gate and check), then reads each bundle back and reports per format: the op kinds of each function's program
and those outside the placement lint's vocabulary, the lint's findings, the package's bytes, and per call the bytes
that cross the call's boundary (its inputs and outputs, and the states the package keeps) and the bytes the host
writes into its buffers after it (the ane layout's rows and states). In the ane layout the host also looks up each
call's embedding rows (the ``hidden_states`` input) and takes the argmax of the ``logits`` output: both are counted
in the call's inputs and outputs.

The drafters likewise: the dense fixture pairs (``recipes/tiny_qwen3_dflash2.yaml``, ``recipes/tiny_qwen3_mtp.yaml``)
built with target and drafter in each layout, their drafter packages read back the same way.

It then computes the same per-call figures for Qwen3.8-27B, the release target (``recipes/dflash2_27b.yaml``'s
target contract: 48 Gated DeltaNet and 16 attention layers, context 8192), and for the release drafters (that
recipe's DFlash2 drafter, ``recipes/qwen3_mtp_27b.yaml``'s MTP head), from the functions both layouts would export
at that geometry (nothing is built).

    PYTHONPATH=. python3 -m bench.layouts [--json docs/bench-logs/layouts-fixtures.json]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import arguments, write_json
from convert import backends
from convert.inputs.contract import as_config
from convert.inputs.recipe import load_recipe
from convert.models import dflash2, family_of, mtp, read_args
from convert.pipeline.drafter import drafter_contract, head_ranges
from convert.verify.placement import VOCABULARY

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = {"dense": ROOT / "recipes" / "tiny_qwen3.yaml", "hybrid": ROOT / "recipes" / "tiny_qwen3_5.yaml"}
PAIRS = {"dflash2": ROOT / "recipes" / "tiny_qwen3_dflash2.yaml", "mtp": ROOT / "recipes" / "tiny_qwen3_mtp.yaml"}
MTP_RELEASE = ROOT / "recipes" / "qwen3_mtp_27b.yaml"
RELEASE = ROOT / "recipes" / "dflash2_27b.yaml"
RELEASE_CONTEXT = 8192  # the figures docs/layouts.md compares (the recipe ships 65,472 with a ladder from 8,192)
LAYOUTS = ("stateful", "ane")


def layout_recipe(recipe: Path, layout: str, scratch: Path) -> Path:
    """A fixture recipe with its target (and drafter) in ``layout``, its fixtures by absolute path, in ``scratch``."""
    text = recipe.read_text().replace("path:../fixtures/", f"path:{ROOT}/fixtures/")
    text = text.replace("  context: 512", f"  context: 512\n  layout: {layout}", 1)
    text = re.sub(r"\ndrafter:\n  kind: (\w+)", lambda m: f"{m.group(0)}\n  layout: {layout}", text, count=1)
    path = scratch / f"{recipe.stem}-{layout}.yaml"
    path.write_text(text)
    return path


def build(recipe: Path, layout: str, scratch: Path) -> tuple[Path, float]:
    path = layout_recipe(recipe, layout, scratch)
    bundle = scratch / f"{recipe.stem}-{layout}"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "convert", "build", str(path), "-o", str(bundle), "--no-cache"],
                   check=True, cwd=ROOT, capture_output=True)
    return bundle, time.perf_counter() - start


def call_bytes(spec, contract: dict) -> dict:
    """What crosses one call's boundary, and what the host writes into its buffers after it (the outputs its buffers
    are written from)."""
    outputs = {t.name: t.nbytes for t in spec.outputs}
    inputs = {t.name: t.nbytes for t in spec.inputs}
    return {"call_input_bytes": sum(inputs.values()), "call_output_bytes": sum(outputs.values()),
            "state_bytes": sum(t.nbytes for t in spec.states),
            "host_buffer_bytes": sum(inputs.get(name, 0) for name in contract.get("buffers", {})),
            "host_rows_written_bytes": sum(outputs.get(rule["rows"], 0)
                                           for rule in contract.get("buffers", {}).values()),
            "logits_bytes": outputs.get("logits", 0) + sum(outputs.get(name, 0) for name in contract.get(
                "logits_parts", {}))}


def measure(bundle: Path) -> dict:
    manifest = json.loads((bundle / "manifest.json").read_text())
    contract, found = manifest.get("host_contract") or {}, {}  # a stateful drafter has none
    for package in manifest["packages"]:
        fmt, path = package["format"], bundle / package["path"]
        backend = backends.load(fmt)
        specs = backend.read_back(path)
        types = backend.operation_types(path) if fmt == "coreai" else backend.contents(path).operation_types
        found[fmt] = {
            "package_bytes": sum(f["size"] for f in package["files"]),
            "placement_findings": len(package["placement"]),
            "functions": {name: {"op_kinds": sorted(types[name]),
                                 "op_kinds_outside_vocabulary": sorted(types[name] - VOCABULARY[fmt]),
                                 **call_bytes(spec, contract)} for name, spec in specs.items()},
        }
    return found


def release_target() -> dict:
    """Per call (decode, verify) at the release target's geometry, in each layout, at context ``RELEASE_CONTEXT``
    without the ladder: computed from the functions the recipe's target contract plans."""
    recipe = load_recipe(RELEASE)
    args = read_args(as_config(recipe.target.contract), f"{RELEASE.name}: target.contract")
    family, computed = family_of(args), {}
    for layout in LAYOUTS:
        target = recipe.target.model_copy(update={"layout": layout, "context": RELEASE_CONTEXT, "ladder": []})
        specs = {s.name: s for s in family.function_specs(args, target)}
        contract = family.host_contract(args, target)
        computed[layout] = {name: call_bytes(specs[name], contract) for name in ("decode", "verify")}
    return computed


def release_drafters() -> dict:
    """Per call at the release drafters' geometry (the DFlash2 drafter of ``RELEASE``, the MTP head of
    ``MTP_RELEASE``, whose history is ``RELEASE_CONTEXT`` rows), in each layout."""
    computed = {}
    for kind, path in (("dflash2", RELEASE), ("mtp", MTP_RELEASE)):
        recipe = load_recipe(path)
        drafter, target = recipe.drafter, recipe.target
        if kind == "dflash2":
            args = dflash2.DFlash2Args.from_config(as_config(drafter.contract), f"{path.name}: drafter.contract")
        else:
            pinned = as_config(target.contract)
            pinned["text_config"] = {**pinned["text_config"], **as_config(drafter.contract)["text_config"]}
            args = mtp.MTPArgs.from_config(pinned, f"{path.name}: target.contract + drafter.contract")
        computed[kind] = {}
        for layout in LAYOUTS:
            config = drafter.model_copy(update={"layout": layout})
            ranges = head_ranges(recipe.model_copy(update={"drafter": config}), args.vocab_size)
            if kind == "dflash2":
                specs = dflash2.function_specs(args, config.context_update, config.context_append, config.ring,
                                               draft_width=target.graphs.verify, layout=layout, head_ranges=ranges)
            else:
                specs = mtp.function_specs(args, target.graphs.verify - 1, RELEASE_CONTEXT, layout=layout,
                                           head_ranges=ranges)
            contract = drafter_contract(kind, args, config, ranges)
            computed[kind][layout] = {s.name: call_bytes(s, contract) for s in specs}
    return computed


def mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def main() -> None:
    parser = arguments(__doc__)
    args = parser.parse_args()
    results = {"fixtures": {}, "drafters": {}, "release_target": {"recipe": str(RELEASE.relative_to(ROOT))}}
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as scratch:
        for kind, recipe in FIXTURES.items():
            results["fixtures"][kind] = {"recipe": str(recipe.relative_to(ROOT))}
            for layout in LAYOUTS:
                bundle, seconds = build(recipe, layout, Path(scratch))
                results["fixtures"][kind][layout] = {"build_seconds": round(seconds, 1), **measure(bundle)}
        for kind, recipe in PAIRS.items():
            results["drafters"][kind] = {"recipe": str(recipe.relative_to(ROOT))}
            for layout in LAYOUTS:
                bundle, seconds = build(recipe, layout, Path(scratch))
                results["drafters"][kind][layout] = {"build_seconds": round(seconds, 1),
                                                     **measure(bundle / "drafter")}
    results["release_target"].update(release_target())
    results["release_drafters"] = release_drafters()
    for kind, layouts in results["fixtures"].items():
        for layout in LAYOUTS:
            got = layouts[layout]
            print(f"{kind} {layout}: build {got['build_seconds']} s")
            for fmt in ("coreai", "coreml"):
                verify = got[fmt]["functions"]["verify"]
                outside = ", ".join(verify["op_kinds_outside_vocabulary"]) or "none"
                print(f"  {fmt}: {got[fmt]['package_bytes'] / 2**20:.2f} MiB, {got[fmt]['placement_findings']} lint "
                      f"findings; verify: {len(verify['op_kinds'])} op kinds ({outside} outside the vocabulary), "
                      f"inputs {verify['call_input_bytes']:,} B, outputs {verify['call_output_bytes']:,} B, states "
                      f"{verify['state_bytes']:,} B, host writes {verify['host_rows_written_bytes']:,} B")
    for kind, layouts in results["drafters"].items():
        for layout in LAYOUTS:
            got = layouts[layout]
            print(f"{kind} drafter {layout}: pair build {got['build_seconds']} s")
            for fmt in ("coreai", "coreml"):
                print(f"  {fmt}: {got[fmt]['package_bytes'] / 2**20:.2f} MiB, {got[fmt]['placement_findings']} lint "
                      f"findings")
                for name, call in got[fmt]["functions"].items():
                    outside = ", ".join(call["op_kinds_outside_vocabulary"]) or "none"
                    print(f"    {name}: {len(call['op_kinds'])} op kinds ({outside} outside), inputs "
                          f"{call['call_input_bytes']:,} B, outputs {call['call_output_bytes']:,} B, states "
                          f"{call['state_bytes']:,} B, host writes {call['host_rows_written_bytes']:,} B")
    for kind, layouts in results["release_drafters"].items():
        for layout in LAYOUTS:
            for name, got in layouts[layout].items():
                print(f"27B {kind} {layout} {name}: inputs {mib(got['call_input_bytes'])}, outputs "
                      f"{mib(got['call_output_bytes'])} (logits {mib(got['logits_bytes'])}), states "
                      f"{mib(got['state_bytes'])}, host buffers {mib(got['host_buffer_bytes'])}, host writes "
                      f"{mib(got['host_rows_written_bytes'])}")
    for layout in LAYOUTS:
        for name, got in results["release_target"][layout].items():
            print(f"27B {layout} {name}: inputs {mib(got['call_input_bytes'])}, outputs "
                  f"{mib(got['call_output_bytes'])} (logits {mib(got['logits_bytes'])}), states "
                  f"{mib(got['state_bytes'])}, host buffers {mib(got['host_buffer_bytes'])}, host writes "
                  f"{mib(got['host_rows_written_bytes'])}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
