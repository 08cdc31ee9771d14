"""Benchmark: the MTP pair of ``tests/test_rescaled_pair.py`` in the ane layout, both sides in the ANE's arithmetic
(``drafter_accept.device_acceptance``), three ways: the fixtures as they are (``plain``), their residual streams scaled
(the target x 4096, the head x 16384) and folded back by the range scales (``scaled``), and the same checkpoints brought
to the scaled pair's final magnitudes with nothing folded (``prefolded``: the target x 512, the head x 1024,
``target.rescale: false``). Prints each one's tokens per round and acceptance by position, whether its rounds equal the
scaled pair's, and the first drafter call (its argmax ids and top-two logit margin) where plain and scaled part
(docs/fp16.md, "A pair in the devices' arithmetic"; docs/bench-logs/mtp-ane-near-tie.json). Run from the repo root:
``.venv/bin/python -m bench.mtp_ane_pairs [--json FILE]`` (about 10 minutes on 2 cores)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from convert.pipeline import drafter_accept
from convert.pipeline.build import shipped_modules
from convert.pipeline.drafter_build import held_out_prompts, shipped_drafter, stage_copy
from convert.pipeline.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent


def run(recipe: Path) -> dict:
    from tests.helpers.rescaled import DrafterCalls

    calls = DrafterCalls()
    drafter_accept.DeviceFunctions = calls.functions()
    plan = make_plan(recipe)
    target, _ = shipped_modules(plan)
    modules, _, _ = shipped_drafter(plan, target, stage_copy(plan, target))
    (prompts, _), tokens = held_out_prompts(plan), plan.drafter.config.accept.tokens
    stats, runs, verdict = drafter_accept.device_acceptance(plan, target, modules, prompts, tokens)
    return {"tokens_per_round": stats["tokens_per_round"], "acceptance_by_position": stats["acceptance_by_position"],
            "lossless": stats["lossless"], "in_range": verdict.passed,
            "rounds": [[vars(r) for r in run.rounds] for run in runs], "calls": calls.calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    options = parser.parse_args()
    from tests.helpers.rescaled import first_parting, mtp_residual_scaled, residual_scaled
    from tests.test_rescaled_pair import FACTOR, MTP, MTP_RECIPE, TARGET, in_layout

    text = in_layout(MTP_RECIPE, "ane")
    results = {}
    with tempfile.TemporaryDirectory(prefix="spec-convert-bench-") as tmp:
        tmp = Path(tmp)
        pairs = {"plain": (TARGET, MTP, text),
                 "scaled": (residual_scaled(TARGET, tmp / "t", FACTOR), mtp_residual_scaled(MTP, tmp / "m", 4 * FACTOR),
                            text),
                 "prefolded": (residual_scaled(TARGET, tmp / "t512", 512.0),
                               mtp_residual_scaled(MTP, tmp / "m1024", 1024.0),
                               text.replace("  context: 512\n", "  context: 512\n  rescale: false\n", 1))}
        for name, (target, head, recipe_text) in pairs.items():
            recipe = tmp / f"{name}.yaml"
            recipe.write_text(recipe_text.format(target=target, drafter=head))
            results[name] = run(recipe)
    for name, r in results.items():
        print(f"{name}: {r['tokens_per_round']:.3f} tokens a round, by position {r['acceptance_by_position']}, "
              f"lossless {r['lossless']}, in range {r['in_range']}, rounds as the scaled pair's: "
              f"{r['rounds'] == results['scaled']['rounds']}")
    i = first_parting(results["plain"]["calls"], results["scaled"]["calls"])
    if i is not None:
        a, b = results["plain"]["calls"][i], results["scaled"]["calls"][i]
        print(f"first differing drafter call: {i} of {len(results['plain']['calls'])} ({a['function']}): plain "
              f"{a['ids']} margins {a['margin']}, scaled {b['ids']} margins {b['margin']}")
    if options.json:
        options.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
