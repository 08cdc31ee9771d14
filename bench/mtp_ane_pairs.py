"""Benchmark: the MTP pair of ``tests/test_rescaled_pair.py`` in the ane layout, both sides in the ANE's arithmetic
(``drafter.device_acceptance``), three ways: the fixtures as they are (``plain``), their residual streams scaled (the
target x 4096, the head x 16384) and folded back by the range scales (``scaled``), and the same checkpoints brought to
the scaled pair's final magnitudes with nothing folded (``prefolded``: the target x 512, the head x 1024,
``target.rescale: false``). Prints each one's tokens per round and acceptance by position, whether its rounds equal the
scaled pair's, and the first drafter call (its argmax ids and top-two logit margin) where plain and scaled part
(docs/fp16.md, "A pair in the devices' arithmetic"; docs/bench-logs/mtp-ane-near-tie.json). Run from the repo root:
``.venv/bin/python -m bench.mtp_ane_pairs [--json FILE]`` (about 10 minutes on 2 cores)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from convert.pipeline import drafter
from convert.pipeline.build import shipped_modules
from convert.pipeline.drafter_build import held_out_prompts, shipped_drafter, stage_copy
from convert.pipeline.plan import make_plan
from convert.runtime import host

ROOT = Path(__file__).resolve().parent.parent


class Recording(host.DeviceFunctions):
    """The drafter's calls (the side that watches peaks): each call's argmax ids and top-two logit margins."""

    calls: list = []

    def call(self, function, inputs):
        out = super().call(function, inputs)
        logits = [v.reshape(-1, v.shape[-1]) for k, v in sorted(out.items()) if k.startswith("logits")]
        if self.peaks is not None and logits:
            joined = np.concatenate(logits, axis=-1)
            top = np.sort(joined, axis=-1)[:, -2:]
            Recording.calls.append({"function": function, "ids": joined.argmax(-1).tolist(),
                                    "margin": (top[:, 1] - top[:, 0]).tolist()})
        return out


def run(recipe: Path) -> dict:
    plan = make_plan(recipe)
    target, _ = shipped_modules(plan)
    modules, _, _ = shipped_drafter(plan, target, stage_copy(plan, target))
    (prompts, _), tokens = held_out_prompts(plan), plan.drafter.config.accept.tokens
    Recording.calls = []
    stats, runs, verdict = drafter.device_acceptance(plan, target, modules, prompts, tokens)
    return {"tokens_per_round": stats["tokens_per_round"], "acceptance_by_position": stats["acceptance_by_position"],
            "lossless": stats["lossless"], "in_range": verdict.passed,
            "rounds": [[vars(r) for r in run.rounds] for run in runs], "calls": Recording.calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    options = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from rescaled import mtp_residual_scaled, residual_scaled
    from test_rescaled_pair import FACTOR, MTP, MTP_RECIPE, TARGET, in_layout

    drafter.DeviceFunctions = Recording
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
    for i, (a, b) in enumerate(zip(results["plain"]["calls"], results["scaled"]["calls"], strict=False)):
        if a["ids"] != b["ids"]:
            print(f"first differing drafter call: {i} ({a['function']}): plain {a['ids']} margins {a['margin']}, "
                  f"scaled {b['ids']} margins {b['margin']}")
            break
    if options.json:
        options.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
