"""``spec-convert accept``: greedy speculative decoding with the shipped target and drafter, measured.

By default the export modules run with the shipped weights (rebuilt from the recipe's pinned sources, as
``spec-convert gate`` does), computing in fp32. ``--runtime coreai`` runs the built bundle's ``.aimodel``
packages themselves on the Core AI runtime (on Linux its CPU reference: slow, so one short prompt), after the
pair check; divergences from plain greedy are classified by the torch modules' logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from convert import backends, drafter, speculative
from convert.build import make_plan, shipped_modules
from convert.drafter_build import format_ab, format_stats, held_out_prompts, measure, shipped_drafter
from convert.errors import GateError, InputError
from convert.export import compute_copy
from convert.host import TargetDriver, module_driver
from convert.progress import console, stage


def run_accept(recipe_path: Path, bundle: Path | None, runtime: str, tokens: int | None, prompts: int | None) -> dict:
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
    target32 = compute_copy(target, torch.float32)
    modules, fp16_modules, _ = shipped_drafter(plan, target, target32)
    if runtime == "torch":
        acceptance, ab = measure(plan, target, target32, modules, fp16_modules, held_out_prompts(plan))
        return {"runtime": "torch", "acceptance": acceptance, "ab": ab}
    if bundle is None:
        raise InputError("--runtime coreai runs a built bundle's packages: give --bundle DIR")
    return _run_coreai(plan, bundle, target, target32, modules)


def _package(folder: Path) -> Path:
    found = sorted(folder.glob("*.aimodel"))
    if not found:
        raise InputError(f"{folder}: no .aimodel package (build with the coreai backend)")
    return found[0]


def _run_coreai(plan, bundle: Path, target, target32, modules) -> dict:
    from convert.inspect import read_manifest
    from manifests import identity

    target_dir, drafter_dir = bundle / "target", bundle / "drafter"
    target_manifest, drafter_manifest = read_manifest(target_dir), read_manifest(drafter_dir)
    problems = identity.pair_mismatches(drafter_manifest, target_manifest, target_dir)
    if problems:
        raise GateError(f"check-pair: {problems[0]}")
    if target_manifest.weights.lm_head_sha256 != identity.tensor_sha256(target.core.lm_head.weight):
        raise InputError(f"{bundle}: the bundle was not built from {plan.recipe_path} (lm_head differs)")
    kind, spec = plan.drafter.kind, plan.drafter.config.accept
    prompt = held_out_prompts(plan)[0][0][: plan.recipe.target.graphs.prefill]
    count = min(spec.tokens, 16)
    embeddings = drafter.anchor_table(target)
    coreai = backends.load("coreai")
    target_package, drafter_package = _package(target_dir), _package(drafter_dir)
    with coreai.open_session(target_package) as t_session, coreai.open_session(drafter_package) as d_session:
        t_driver = TargetDriver(t_session, target.widths, target_manifest.host_contract.model_dump())
        d_driver = (speculative.DFlash2Driver(d_session, modules.widths, embeddings) if kind == "dflash2"
                    else speculative.MTPDriver(d_session, modules.widths))
        with stage(f"speculative decoding on the Core AI runtime: {len(prompt)}-token prompt, {count} tokens"):
            run, spec_logits = speculative.speculate(kind, t_driver, d_driver, prompt, count)
        with stage("plain greedy decoding on the Core AI runtime"):
            greedy_ids, _ = t_driver.greedy(prompt, count)
    reference = module_driver(target32)
    _, torch_logits = reference.greedy(prompt, count)
    speculative.check_lossless(run, greedy_ids, spec_logits, torch_logits, drafter.NEAR_TIE_LOGITS)
    stats = speculative.acceptance_stats([run], t_driver.widths["verify"])
    drafter.raise_if_lossy(stats, [run])
    return {"runtime": "coreai", "acceptance": {**stats, "prompt_tokens": len(prompt), "tokens": count,
                                                "output": " ".join(map(str, run.output))}, "ab": None}


def print_result(result: dict) -> None:
    console.print(f"runtime: {result['runtime']}")
    console.print(format_stats(result["acceptance"]))
    if result.get("ab"):
        console.print(format_ab(result["ab"]))
