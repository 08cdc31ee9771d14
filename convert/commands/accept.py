"""``spec-convert accept``: greedy speculative decoding with the shipped target and drafter, measured.

By default the export modules run with the shipped weights (rebuilt from the recipe's pinned sources, as
``spec-convert gate`` does), computing in fp32. ``--runtime device`` runs them in fp16 in the arithmetic of each
side's device (``convert.fp16``: the ane layout's on the Neural Engine, the stateful layout's on the GPU).
``--runtime coreai`` runs the built bundle's ``.aimodel`` packages themselves on the Core AI runtime (on Linux its
CPU reference: slow, so one short prompt), after the pair check; divergences from plain greedy are classified by the
torch modules' logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from convert.commands.inspect import open_drafter, open_target
from convert.errors import GateError, InputError
from convert.pipeline import drafter_accept
from convert.pipeline.build import shipped_modules
from convert.pipeline.drafter_build import (
    format_ab,
    format_stats,
    held_out_prompts,
    measure,
    measure_held_out,
    shipped_drafter,
    stage_copy,
)
from convert.pipeline.plan import make_plan
from convert.progress import console, stage
from convert.runtime.chain import coreai_drafter, coreai_target
from convert.runtime.host import TargetDriver, module_driver
from convert.verify.gates import DEVICE_OF_LAYOUT
from manifests import identity
from manifests.schema import HostContract

CORE_AI_TOKENS = 16  # the Core AI runtime's CPU reference emulates fp16: one short prompt, a few rounds


def run_accept(recipe_path: Path, bundle: Path | None, runtime: str, tokens: int | None, prompts: int | None) -> dict:
    if runtime == "coreai" and bundle is None:
        raise InputError("--runtime coreai runs a built bundle's packages: give --bundle DIR")
    pair = _open_pair(bundle) if runtime == "coreai" else None  # before any weight is built
    plan = make_plan(recipe_path)
    if plan.drafter is None:
        raise InputError(f"{recipe_path}: no drafter section; accept measures a target with its drafter")
    if prompts or tokens:
        spec = plan.drafter.config.accept
        updated = spec.model_copy(update={"samples": prompts or spec.samples, "tokens": tokens or spec.tokens})
        config = plan.drafter.config.model_copy(update={"accept": updated})
        plan.drafter.config = config
        plan.recipe = plan.recipe.model_copy(update={"drafter": config})
    target, _ = shipped_modules(plan)
    target32 = stage_copy(plan, target)  # as the build's drafter stage runs its prompts
    modules, fp16_modules, _ = shipped_drafter(plan, target, target32)
    if runtime == "torch":
        acceptance, ab = measure_held_out(plan, target, target32, modules, fp16_modules, held_out_prompts(plan))
        return {"runtime": "torch", "acceptance": acceptance, "ab": ab}
    if runtime == "device":
        return _run_device(plan, target, modules)
    return _run_coreai(plan, bundle, pair, target, target32, modules, fp16_modules)


def _open_pair(bundle: Path):
    """A pair bundle's target and drafter manifests, their kinds and files checked (the .aimodel packages hashed)."""
    target_dir, drafter_dir = bundle / "target", bundle / "drafter"
    if not (target_dir / "manifest.json").is_file():
        raise InputError(f"{bundle}: not a pair bundle (no target/manifest.json); --bundle takes the directory that "
                         "holds target/ and drafter/")
    return open_target(target_dir, "accept --bundle", ("coreai",)), open_drafter(drafter_dir, "accept --bundle",
                                                                                   ("coreai",))


def _run_coreai(plan, bundle: Path, pair, target, target32, modules, fp16_modules) -> dict:
    target_dir, drafter_dir = bundle / "target", bundle / "drafter"
    target_manifest, drafter_manifest = pair
    problems = identity.pair_mismatches(drafter_manifest, target_manifest, target_dir)
    if problems:
        raise GateError(f"check-pair: {problems[0]}")
    if target_manifest.weights.lm_head_sha256 != identity.tensor_sha256(target.core.lm_head.weight):
        raise InputError(f"{bundle}: the bundle was not built from {plan.recipe_path} (lm_head differs)")
    if target_manifest.host_contract != HostContract.model_validate(target.contract):
        raise InputError(f"{target_dir}: the bundle's host contract differs from this version's; rebuild it")
    if drafter_manifest.host_contract != (HostContract.model_validate(modules.contract) if modules.contract else None):
        raise InputError(f"{drafter_dir}: the drafter's host contract (its layout) differs from the recipe's; rebuild "
                         "the bundle")
    prompt = held_out_prompts(plan)[0][0][: plan.recipe.target.graphs.prefill]
    count = min(plan.drafter.config.accept.tokens, CORE_AI_TOKENS)
    with coreai_target(target_dir, target_manifest) as t_session, \
            coreai_drafter(drafter_dir, drafter_manifest, target_dir) as d_session:
        with stage(f"plain greedy decoding on the Core AI runtime: {len(prompt)}-token prompt, {count} tokens"):
            greedy_ids, _ = TargetDriver(t_session, target.widths, target.contract).greedy(prompt, count)
        _, torch_logits = module_driver(target32).greedy(prompt, count)  # classifies any divergence
        acceptance, ab = measure(plan, target, target32, modules, fp16_modules, [prompt], count,
                                 [(greedy_ids, torch_logits)], (t_session, d_session))
    return {"runtime": "coreai", "acceptance": {**acceptance, "prompt_tokens": len(prompt), "tokens": count},
            "ab": ab}


def _run_device(plan, target, modules) -> dict:
    """Both sides in the arithmetic of their layouts' devices (``drafter_accept.device_acceptance``) on the held-out
    prompts: lossless against the target's own greedy decoding so computed, and the drafter's range verdict (exit 1
    past)."""
    (prompts, data), tokens = held_out_prompts(plan), plan.drafter.config.accept.tokens
    devices = f"the target on the {DEVICE_OF_LAYOUT[plan.recipe.target.layout]}, the drafter on the " \
              f"{DEVICE_OF_LAYOUT[plan.drafter.config.layout]}"
    with stage(f"accept in the devices' arithmetic ({devices}): {len(prompts)} prompts x {tokens} tokens"):
        stats, runs, verdict = drafter_accept.device_acceptance(plan, target, modules, prompts, tokens)
    drafter_accept.raise_if_out_of_range(verdict, "accept --runtime device")
    drafter_accept.raise_if_lossy(stats, runs)
    console.print(f"range ({verdict.device}): {verdict.checked} drafter tensors within their limits; least headroom "
                  + ", ".join(f"{e.tensor} ({e.kind}) {e.headroom:.3g}x" for e in verdict.tightest[:3]))
    return {"runtime": "device", "acceptance": {"data": data, **stats, "range": verdict.model_dump()}, "ab": None}


def result_json(result: dict) -> str:
    return json.dumps(result, indent=2, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))


def print_result(result: dict) -> None:
    console.print(f"runtime: {result['runtime']}")
    console.print(format_stats(result["acceptance"]))
    if result.get("ab"):
        console.print(format_ab(result["ab"]))
