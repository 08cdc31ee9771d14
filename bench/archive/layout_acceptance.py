"""Speculative decoding of the four fixture pairs in both layouts in torch (fp32), with the same shipped weights.

The build's own acceptance (``accept`` in torch) runs each layout's modules with the weights that layout's build
quantized; a lut4-gptq drafter's codes follow calibration Hessians that the two layouts make equal only to fp32
rounding, so two builds ship two drafters. Here each pair is built in both layouts (target and drafter ``ane``,
against ``stateful``), and the ane drafter is also run with the stateful build's codes: the same weights in both
layouts. For each it reports the target's plain greedy ids per held-out prompt (where they part, the top-2 logit gap
of each layout there), the acceptance (rounds, tokens a round, prompts with the same rounds) and, with the same
weights, where the two drafters first draft another id (each drafter's decision gap there: a near tie is under
``NEAR_TIE_LOGITS``, 0.25).

    PYTHONPATH=. .venv/bin/python bench/archive/layout_acceptance.py [--json docs/bench-logs/layout-acceptance.json]
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import arguments, write_json
from bench.layouts import ROOT, layout_recipe
from convert.export.functions import compute_copy
from convert.export.quantized import CodesLinear, apply_quantized
from convert.pipeline import drafter, drafter_accept, drafter_calibration
from convert.pipeline.build import shipped_modules
from convert.pipeline.drafter_build import held_out_prompts, shipped_drafter
from convert.pipeline.plan import make_plan
from convert.runtime import speculative
from convert.verify.checks import decision_gap

PAIRS = ("tiny_qwen3_dflash2", "tiny_qwen3_mtp", "tiny_qwen3_5_dflash2", "tiny_qwen3_5_mtp")
LAYOUTS = ("stateful", "ane")


def greedy_comparison(references: dict) -> dict:
    """Per prompt: whether both layouts' greedy ids are equal, else where they part and each layout's top-2 gap."""
    same, parted = 0, []
    for index, ((ids_s, logits_s), (ids_a, logits_a)) in enumerate(
            zip(references["stateful"], references["ane"], strict=True)):
        if ids_s == ids_a:
            same += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(ids_s, ids_a, strict=True)) if a != b)
        gaps = [decision_gap({"logits": np.asarray(logits[at])[None, None]}, 0)[0] for logits in (logits_s, logits_a)]
        parted.append({"prompt": index, "position": at, "gap_stateful": gaps[0], "gap_ane": gaps[1]})
    return {"prompts_with_the_same_ids": same, "parted": parted}


def acceptance(kind, target32, modules, prompts, tokens, embeddings, references) -> tuple[dict, list]:
    stats, runs = drafter_accept.accept(kind, target32, compute_copy(modules, torch.float32, share_weights=True),
                                        prompts, tokens, embeddings, references)
    return {key: stats[key] for key in ("rounds", "tokens_per_round", "lossless", "near_ties")}, runs


def draft_divergence(kind: str, sides: dict, prompt: list[int], tokens: int) -> dict | None:
    """Where two layouts' drafters first draft another id on ``prompt`` (the speculative run recorded on each side:
    ``sides`` maps a layout to its target modules (fp32), drafter modules (fp32) and anchor table), with each side's
    decision gap there (``checks.decision_gap``: the top-2 logits, or a selector's top-2 scores and its top-k edge);
    None when every draft is the same."""
    recorded = {}
    for layout, (target32, drafter32, embeddings) in sides.items():
        target, drafted = drafter.drivers(kind, target32, drafter32, embeddings)
        drafted.functions = drafter_calibration.Recording(drafted.functions)
        speculative.speculate(kind, target, drafted, prompt, tokens)
        recorded[layout] = [call for call in drafted.functions.calls if call[0] != "reset"]
    for index, calls in enumerate(zip(*recorded.values(), strict=False)):
        outputs = [call[2] for call in calls]
        if "draft_ids" not in outputs[0]:
            continue
        ids = [np.asarray(out["draft_ids"])[0] for out in outputs]
        if not np.array_equal(*ids):
            row = int(np.flatnonzero(ids[0] != ids[1])[0])
            gaps = {layout: decision_gap(out, row) for layout, out in zip(recorded, outputs, strict=True)}
            return {"call": index, "function": calls[0][0], "row": row, "gap": next(iter(gaps.values()))[1],
                    **{f"gap_{layout}": gap for layout, (gap, _) in gaps.items()}}
    return None


def measure_pair(name: str, work: Path) -> dict:
    built = {}
    for layout in LAYOUTS:
        recipe = layout_recipe(ROOT / "recipes" / f"{name}.yaml", layout, work)
        plan = make_plan(recipe, str(work / f"{name}-{layout}"))
        target, _ = shipped_modules(plan)
        target32 = compute_copy(target, torch.float32, share_weights=True)
        modules, _, _ = shipped_drafter(plan, target, target32)
        built[layout] = (plan, target, target32, modules)
    plan, target, target32, _ = built["ane"]
    same = drafter.build_modules(plan.drafter, plan.recipe, target, torch.float16)  # the stateful build's codes
    codes = {path: module.quantized_weight() for path, module in built["stateful"][3].core.named_modules()
             if isinstance(module, CodesLinear)}
    apply_quantized(same.core, codes, codes_only=True)
    (prompts, _), tokens = held_out_prompts(plan), plan.drafter.config.accept.tokens
    kind = plan.drafter.kind
    references = {layout: drafter_accept.greedy_references(built[layout][2], prompts, tokens) for layout in LAYOUTS}
    result = {"kind": kind, "drafter_quantization": plan.drafter.config.quantization.method, "prompts": len(prompts),
              "tokens": tokens, "greedy": greedy_comparison(references), "quantized_linears_shared": len(codes)}
    runs = {}
    for label, layout, modules in (("stateful", "stateful", built["stateful"][3]), ("ane", "ane", built["ane"][3]),
                                   ("ane_with_the_stateful_codes", "ane", same)):
        _, target_l, target32_l, _ = built[layout]
        result[label], runs[label] = acceptance(kind, target32_l, modules, prompts, tokens,
                                                drafter.anchor_table(target_l), references[layout])
    for label in ("ane", "ane_with_the_stateful_codes"):
        result[label]["prompts_with_the_stateful_rounds"] = sum(
            [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
            for a, b in zip(runs["stateful"], runs[label], strict=True))
    sides = {layout: (built[layout][2], compute_copy(modules, torch.float32, share_weights=True),
                      drafter.anchor_table(built[layout][1]))
             for layout, modules in (("stateful", built["stateful"][3]), ("ane", same))}  # the same weights
    parted = []
    for index, (a, b) in enumerate(zip(runs["stateful"], runs["ane_with_the_stateful_codes"], strict=True)):
        if [r.proposal for r in a.rounds] != [r.proposal for r in b.rounds]:
            parted.append({"prompt": index, **(draft_divergence(kind, sides, prompts[index], tokens) or {})})
    result["ane_with_the_stateful_codes"]["drafts_parted"] = parted
    return result


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("pairs", nargs="*", default=PAIRS, help="fixture pair recipes (default: the four)")
    args = parser.parse_args()
    results = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "pairs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-layout-acceptance-") as scratch:
        for name in args.pairs:
            start = time.time()
            results["pairs"][name] = {**measure_pair(name, Path(scratch)), "seconds": round(time.time() - start, 1)}
            print(json.dumps({name: results["pairs"][name]}, indent=1), flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
