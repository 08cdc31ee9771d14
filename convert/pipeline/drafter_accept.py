"""The drafter stage's measurements: plain greedy references, speculative decoding over held-out prompts (lossless or
refused), the bytes each call reads, the pair in the devices' arithmetic (the build's device pass) and the A/B verdict
of a quantized drafter against its fp16 one. Each computes where the modules it is given are (the build's torch
device: ``drafter_build``), the device pass's fp16 copies on ``plan.torch_device``; the drivers and the statistics
are numpy on the host."""

from __future__ import annotations

import numpy as np
import torch

from convert.errors import GateError
from convert.export.functions import compute_copy
from convert.fp16 import Peaks
from convert.inputs.thresholds import NEAR_TIE_LOGITS
from convert.pipeline.drafter import NGRAM, PromptJournal, anchor_table, drivers, over_prompts
from convert.runtime import speculative
from convert.runtime.economics import MeteredFunctions, cost_model
from convert.runtime.host import DeviceFunctions, ModuleFunctions, TargetDriver, module_driver
from convert.verify.gates import DEVICE_OF_LAYOUT
from convert.verify.report import RangeReport
from convert.weights.target import TargetModules


def greedy_references(target_modules, prompts: list[list[int]], tokens: int, sessions: int = 1,
                      journal: PromptJournal | None = None) -> list[tuple[list[int], list]]:
    """Plain greedy decoding of each prompt (ids and the logits each was chosen from): the lossless reference;
    ``sessions`` prompts at a time (``over_prompts``, with its ``journal``)."""
    return over_prompts(lambda target, _, i: module_driver(target).greedy(prompts[i], tokens), len(prompts), sessions,
                        target_modules, journal=journal)


def accept(kind: str, target_modules, drafter_modules, prompts: list[list[int]], tokens: int,
           embeddings: np.ndarray, references: list, functions: tuple | None = None,
           sessions: int = 1, journal: PromptJournal | None = None) -> tuple[dict, list[speculative.PromptRun]]:
    """Speculative decoding over ``prompts`` and the lossless check against ``references`` (plain greedy of
    the same target: ``greedy_references`` of these prompts); on ``functions`` (see ``drivers``) when given, else on
    the modules, ``sessions`` prompts at a time (``over_prompts``, with its ``journal``)."""
    def run(target, drafter, index: int):
        return speculative.speculate(*drivers(kind, target, drafter, embeddings, functions), prompts[index], tokens)

    results = over_prompts(run, len(prompts), 1 if functions else sessions, target_modules, drafter_modules, journal)
    runs = []
    for (run_, spec_logits), (greedy_ids, greedy_logits) in zip(results, references, strict=True):
        speculative.check_lossless(run_, greedy_ids, spec_logits, greedy_logits, NEAR_TIE_LOGITS)
        runs.append(run_)
    width = target_modules.widths["verify"]
    stats = speculative.ngram_stats(runs, width) if kind == NGRAM else speculative.acceptance_stats(runs, width)
    return stats, runs


def economics(kind: str, target_modules, target32, drafter_modules, drafter32, prompt: list[int], tokens: int,
              embeddings: np.ndarray, tokens_per_round: float) -> dict:
    """Bytes read per call and the cost model (``convert.runtime.economics``) over one metered speculative run of
    ``prompt`` (the fp32 compute copies run, elements priced as the shipped modules store them) and a decode
    call of the target."""
    log: list = []
    functions = (MeteredFunctions(target32, target_modules, "target", log),
                 MeteredFunctions(drafter32, drafter_modules, "drafter", log))
    target, drafter = drivers(kind, target32, drafter32, embeddings, functions)
    speculative.speculate(target, drafter, prompt, tokens)
    target.greedy(prompt, 2)  # prefill, then one decode call: the unit of cost
    return cost_model(log, tokens_per_round)


def device_acceptance(plan, target: TargetModules, modules, prompts: list[list[int]],
                      tokens: int) -> tuple[dict, list[speculative.PromptRun], RangeReport]:
    """The pair as the devices compute it: the shipped fp16 target in the arithmetic of its layout's device and the
    fp16 drafter in its layout's (``convert.fp16``, call by call: ``DeviceFunctions``), over speculative decoding of
    ``prompts`` for ``tokens`` ids each, checked against the target's own plain greedy decoding in that arithmetic
    (``accept``'s stats and runs), every product's input and port and every module's output of the drafter watched
    (its ``RangeReport``). The fp16 copies compute on ``plan.torch_device`` (the devices' arithmetic is emulated
    there: ``convert.fp16``)."""
    target16 = compute_copy(target, torch.float16, share_weights=True, device=plan.torch_device)
    drafter16 = compute_copy(modules, torch.float16, share_weights=True, device=plan.torch_device)
    device = DEVICE_OF_LAYOUT[plan.drafter.config.layout]
    peaks = Peaks(only=torch.float16, drafter=drafter16.core)
    functions = (DeviceFunctions(ModuleFunctions(target16), DEVICE_OF_LAYOUT[plan.recipe.target.layout]),
                 DeviceFunctions(ModuleFunctions(drafter16), device, peaks))
    driver = TargetDriver(functions[0], target16.widths, target16.contract)
    references = []
    for prompt in prompts:
        functions[0].reset()
        references.append(driver.greedy(prompt, tokens))
    stats, runs = accept(plan.drafter.kind, target16, drafter16, prompts, tokens, anchor_table(target), references,
                         functions)
    return stats, runs, RangeReport.of(device, peaks)


def device_pass(plan, target: TargetModules, target32: TargetModules, modules, prompt: list[int],
                tokens: int) -> dict:
    """The build's device pass of the pair (``device_acceptance``) on one held-out ``prompt``, beside the fp32 pair's
    tokens per round on it (no time recorded: a rebuild's manifest is the same); raises ``GateError`` where a drafter
    tensor leaves its device's range or the run is not lossless."""
    stats, runs, verdict = device_acceptance(plan, target, modules, [prompt], tokens)
    drafter32 = compute_copy(modules, torch.float32, share_weights=True, device=plan.torch_device)
    fp32, _ = accept(plan.drafter.kind, target32, drafter32, [prompt], tokens, anchor_table(target),
                     greedy_references(target32, [prompt], tokens))
    result = {"target_device": DEVICE_OF_LAYOUT[plan.recipe.target.layout], "device": verdict.device,
              "prompt_tokens": len(prompt), "tokens": tokens, "tokens_per_round": stats["tokens_per_round"],
              "fp32_tokens_per_round": fp32["tokens_per_round"],
              "acceptance_by_position": stats["acceptance_by_position"], "lossless": stats["lossless"],
              "near_ties": stats["near_ties"], "range": verdict.model_dump(exclude={"tightest"}),
              "tightest": [f"{e.tensor} ({e.kind}): {e.headroom:.3g}x" for e in verdict.tightest[:3]]}
    raise_if_out_of_range(verdict, "device pass of the pair")
    raise_if_lossy(stats, runs)
    return result


def raise_if_out_of_range(verdict: RangeReport, what: str) -> None:
    if verdict.over:
        raise GateError(f"{what} (the drafter on the {verdict.device}): range: {verdict.over_phrase()}; nothing was "
                        "published")


def raise_if_lossy(stats: dict, runs: list[speculative.PromptRun]) -> None:
    if not stats["lossless"]:
        flip = next(r.divergence for r in runs if r.divergence and r.divergence["kind"] == "real_flip")
        raise GateError(
            f"speculative decoding is not lossless: at output offset {flip['offset']} it produced "
            f"{flip['speculative']} where plain greedy decoding produced {flip['greedy']} (logit gap "
            f"{flip['logit_gap']:.3f} >= near-tie margin {NEAR_TIE_LOGITS})"
        )


def ab_verdict(ab: dict, max_p: float) -> dict:
    """A quantized drafter that accepts significantly fewer drafts than the fp16 one is refused."""
    worse = ab["accepted_other"] < ab["accepted_base"] and ab["sign_test_p"] < max_p
    return {**ab, "max_p_value": max_p, "significant_loss": worse}
