"""Greedy speculative decoding with an exported target and drafter, called the way a runtime calls them.

Both sides are driven through one small interface, ``convert.runtime.host.Functions``: ``call(function, inputs) ->
outputs`` on numpy arrays, and ``reset()`` (a fresh session: zero states). The torch export modules (shipped
weights) and the Core AI runtime's sessions both fit it, so ``spec-convert accept`` measures what ships. The
target is called through ``convert.runtime.host.TargetDriver``, which follows its host contract.

One round, DFlash2 (docs/drafters.md): the drafter proposes ``W - 1`` tokens after the anchor (the last
token the target produced) from its context ring; the target verifies ``[anchor, drafts]`` at positions
``p .. p+W-1``; the longest prefix of drafts equal to the target's argmax ids is accepted, plus the target's
next id (the bonus). The verify rows of the anchor and the accepted drafts are the drafter's new context. Rows
past them are stale in both KV caches and are overwritten later (positional rollback, nothing copied). On a
hybrid target the driver's next call starts at the bonus position, which tells the target (host contract
``commit-next-call``) how many verify rows to commit into its recurrent states; the rest are dropped.

One round, MTP: the head's ``accept`` over the newly committed tokens (each paired with the target's hidden
state of the position before it) returns the first draft, ``draft_step`` chains the rest; the target
verifies ``[bonus, drafts]``.

One round, n-gram (prompt lookup, the zero-cost baseline): ``NGramDrafter`` proposes up to ``W - 1`` tokens from
an earlier occurrence of the text's suffix; the target verifies them, or, with no proposal, decodes one token.

Losslessness: the output must equal plain greedy decoding of the same target (prefill, then decode steps).
A divergence is classified by the target's logits at that position in the speculative run (its verify logits),
as the gates do: the two ids' logits closer than the near-tie margin is a near tie (block vs chain
arithmetic), counted apart; otherwise it is a real flip and the check fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from convert.export.names import ARGMAX_IDS, LOGITS
from convert.runtime.host import TargetDriver


@dataclass
class Round:
    start: int  # text offset (tokens generated before the round)
    proposal: tuple[int, ...]
    accepted: int


@dataclass
class PromptRun:
    prompt: list[int]
    output: list[int]
    rounds: list[Round] = field(default_factory=list)
    divergence: dict | None = None  # first difference from plain greedy, classified


class DrafterDriver(Protocol):
    """How ``speculate`` drives a drafter (each drafter family's ``driver``, ``convert.models.DRAFTERS``; the n-gram
    baseline): ``begin`` once the target has prefilled the prompt (``out``: the prefill's outputs, its first id last
    of ``argmax_ids``), ``propose`` up to ``count`` drafts after the anchor ``text[-1]`` at ``position`` (``text``: the
    prompt and every id since), ``observe`` what a round kept (``accepted``: the accepted drafts and the bonus id,
    ``verified``: the verify call's outputs, whose first ``len(accepted)`` rows are theirs) from ``position``."""

    def begin(self, prompt: list[int], out: dict[str, np.ndarray]) -> None: ...

    def propose(self, text: list[int], position: int, count: int) -> list[int]: ...

    def observe(self, accepted: list[int], verified: dict[str, np.ndarray], position: int) -> None: ...


class NGramDrafter:
    """Prompt lookup (no model, no package): the longest suffix of the text so far, of ``max_order`` tokens down to
    one, that occurred earlier; its most recent earlier occurrence's continuation is the proposal (empty when no
    suffix recurs: the round is then a plain decode call)."""

    def __init__(self, max_order: int = 3):
        self.max_order = max_order

    def begin(self, prompt: list[int], out: dict[str, np.ndarray]) -> None:
        """Nothing to set up: the text is all it reads."""

    def observe(self, accepted: list[int], verified: dict[str, np.ndarray], position: int) -> None:
        """Nothing to keep: the text is all it reads."""

    def propose(self, text: list[int], position: int, count: int) -> list[int]:
        for order in range(min(self.max_order, len(text) - 1), 0, -1):
            suffix = text[-order:]
            for start in range(len(text) - order - 1, -1, -1):
                if text[start : start + order] == suffix:
                    return text[start + order : start + order + count]
        return []


def speculate(target: TargetDriver, drafter: DrafterDriver, prompt: list[int], tokens: int) -> tuple[PromptRun, list]:
    """Greedy speculative decoding of ``tokens`` ids after ``prompt``; returns the run and per output id the
    target logits it was chosen from (None where the target does not return logits)."""
    width = target.widths["verify"]
    out = target.prefill(prompt)
    bonus = int(out[ARGMAX_IDS][-1])
    output, logits = [bonus], [out[LOGITS][-1] if LOGITS in out else None]
    run = PromptRun(prompt=list(prompt), output=output)
    drafter.begin(list(prompt), out)
    p = len(prompt)  # position of the bonus token (the anchor)
    while len(output) < tokens:
        proposal = drafter.propose(run.prompt + output, p, width - 1)
        verified = target.run("verify" if proposal else "decode", [bonus] + proposal, p)
        argmax = [int(t) for t in verified[ARGMAX_IDS]]
        k = 0
        while k < len(proposal) and proposal[k] == argmax[k]:
            k += 1
        run.rounds.append(Round(start=len(output), proposal=tuple(proposal), accepted=k))
        new = proposal[:k] + [argmax[k]]
        output.extend(new)
        logits.extend(verified[LOGITS][: k + 1] if LOGITS in verified else [None] * (k + 1))
        drafter.observe(new, verified, p)
        bonus, p = new[-1], p + k + 1
    del output[tokens:]
    return run, logits[:tokens]


def check_lossless(run: PromptRun, greedy_ids: list[int], spec_logits: list, greedy_logits: list,
                   margin: float) -> None:
    """Compare with plain greedy; record the first divergence on ``run`` (kind near_tie / real_flip)."""
    for i, (a, b) in enumerate(zip(run.output, greedy_ids, strict=False)):
        if a == b:
            continue
        row = spec_logits[i] if spec_logits[i] is not None else greedy_logits[i]
        gap = abs(float(row[a]) - float(row[b])) if row is not None else math.inf
        run.divergence = {"offset": i, "speculative": a, "greedy": b, "logit_gap": gap,
                          "kind": "near_tie" if gap < margin else "real_flip"}
        return


def acceptance_stats(runs: list[PromptRun], width: int) -> dict:
    """Tokens per round, acceptance per draft position (of the rounds that reached it), lossless counts."""
    rounds = [r for run in runs for r in run.rounds]
    drafts = width - 1
    reached = [0] * drafts
    accepted = [0] * drafts
    for r in rounds:
        for i in range(drafts):
            if i <= r.accepted and i < len(r.proposal):
                reached[i] += 1
                accepted[i] += i < r.accepted
    divergences = [run.divergence for run in runs if run.divergence]
    return {
        "prompts": len(runs),
        "rounds": len(rounds),
        "tokens_per_round": sum(r.accepted + 1 for r in rounds) / len(rounds) if rounds else 0.0,
        "mean_accepted": sum(r.accepted for r in rounds) / len(rounds) if rounds else 0.0,
        "acceptance_by_position": [a / n if n else None for a, n in zip(accepted, reached, strict=True)],
        "lossless": not any(d["kind"] == "real_flip" for d in divergences),
        "near_ties": sum(d["kind"] == "near_tie" for d in divergences),
        "real_flips": sum(d["kind"] == "real_flip" for d in divergences),
    }


def ngram_stats(runs: list[PromptRun], width: int) -> dict:
    """``acceptance_stats`` of a prompt-lookup run, with its calls split: rounds with a proposal are verify calls,
    the rest decode calls; ``tokens``: the ids the rounds produced (the prefill's first id not among them)."""
    stats = acceptance_stats(runs, width)
    rounds = [r for run in runs for r in run.rounds]
    verify = sum(bool(r.proposal) for r in rounds)
    return {**stats, "tokens": sum(r.accepted + 1 for r in rounds), "verify_calls": verify,
            "decode_calls": len(rounds) - verify, "hit_rate": verify / len(rounds) if rounds else 0.0,
            "tokens_per_verify": sum(r.accepted + 1 for r in rounds if r.proposal) / verify if verify else None}


def paired_ab(base: list[PromptRun], other: list[PromptRun]) -> dict:
    """Rounds of two drafters on the same prompts matched by their start offset (the text is identical
    when both are lossless): identical-proposal rate, sign test on the accept counts, total accepted."""
    same = diff_base = diff_other = matched = total_base = total_other = 0
    for run_a, run_b in zip(base, other, strict=True):
        by_start = {r.start: r for r in run_b.rounds}
        for r in run_a.rounds:
            twin = by_start.get(r.start)
            if twin is None:
                continue
            matched += 1
            same += r.proposal == twin.proposal
            total_base += r.accepted
            total_other += twin.accepted
            diff_base += r.accepted > twin.accepted
            diff_other += twin.accepted > r.accepted
    return {
        "matched_rounds": matched,
        "identical_proposals": same / matched if matched else None,
        "base_more": diff_base,
        "other_more": diff_other,
        "sign_test_p": sign_test(diff_base, diff_other),
        "accepted_base": total_base,
        "accepted_other": total_other,
    }


def sign_test(a: int, b: int) -> float:
    """Two-sided exact binomial sign test of a vs b successes (p = 0.5); 1.0 with no differing pairs."""
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2**n
    return min(1.0, 2 * tail)
