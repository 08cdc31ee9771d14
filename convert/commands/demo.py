"""`spec-convert demo`: build the embedded default recipe, then continue a code prompt greedily three ways.

1. transformers in fp32 on the source checkpoint (the reference),
2. the export modules in torch with the shipped fp16 weights (what the gates measure),
3. the shipped ``.aimodel`` on the Core AI runtime (what a device runs; slow on Linux, fp16 emulated).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console

from convert.commands.generate import greedy
from convert.inputs.sources import load_tensors
from convert.pipeline.build import SHIP_DTYPE, build
from convert.pipeline.plan import make_plan
from convert.runtime.chain import coreai_functions
from convert.runtime.host import TargetDriver, module_driver, module_lookup
from convert.weights.target import build_modules

PROMPT = "class Stack:\n    def push(self, item):"
NEW_TOKENS = 16


def run_demo(recipe: Path, output: str) -> None:
    out = Console(highlight=False, soft_wrap=True)
    start = time.perf_counter()
    plan = make_plan(recipe, output)
    manifest = build(plan)
    out.print(f"\n[bold]bundle[/bold] {plan.output.resolve()}  (export id {manifest.export_id[:16]})")
    for package in manifest.packages:
        size = sum(f.size for f in package.files) / 2**20
        steps = ", ".join(f"{c.kind} {c.status}" for c in package.compile)
        out.print(f"  {package.path}: {size:.1f} MiB, functions {[f.name for f in manifest.functions]}; {steps}")
    weights = manifest.weights
    out.print(f"  manifest.json: {weights.parameter_count:,} parameters, lm_head {weights.lm_head_sha256[:16]}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = plan.snapshot.directory
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    prompt = tokenizer.encode(PROMPT)  # with <|bos|>, as the fixture was trained
    reference = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    rows = {"transformers fp32": greedy_reference(reference, prompt)}
    modules = build_modules(plan.args, plan.recipe.target, load_tensors(source), SHIP_DTYPE, plan.layout)
    rows["export modules fp16 (torch)"] = greedy(module_driver(modules), prompt, NEW_TOKENS, eos=None)
    if "coreai" in plan.recipe.backends:
        package = plan.output / next(p.path for p in manifest.packages if p.format == "coreai")
        with coreai_functions(package, modules.contract, module_lookup(modules.core)) as session:
            driver = TargetDriver(session, modules.widths, modules.contract)
            rows[".aimodel fp16 (Core AI runtime)"] = greedy(driver, prompt, NEW_TOKENS, eos=None)
    out.print(f"\n[bold]greedy continuation of[/bold] {PROMPT!r} ({NEW_TOKENS} tokens)")
    for label, ids in rows.items():
        same = "" if ids == rows["transformers fp32"] else "  [yellow](differs from the reference)[/yellow]"
        out.print(f"  {label:32s} {tokenizer.decode(ids)!r}{same}")
    out.print(f"\ndone in {time.perf_counter() - start:.0f} s")


def greedy_reference(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
