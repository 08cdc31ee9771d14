"""The speculative decoding loop, the lossless check and the paired A/B statistics, on constructed drafters."""

import numpy as np
import pytest
import torch

from convert.inputs.recipe import Graphs, Target
from convert.inputs.sources import load_tensors, read_json
from convert.models import read_args
from convert.models.dflash2.driver import DFlash2Driver
from convert.models.mtp.driver import MTPDriver
from convert.models.qwen3 import Qwen3Args
from convert.runtime import speculative
from convert.runtime.host import ModuleFunctions, module_driver
from convert.weights.target import build_modules
from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.qwen3_5_checkpoints import write_small_target

WIDTH = 5


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def target(request, tmp_path_factory):
    """The loop runs on a dense target (positional rollback) and on a hybrid one (Gated DeltaNet + attention: a
    rejected draft's recurrent state is dropped through the commit-next-call host contract)."""
    directory = tmp_path_factory.mktemp("spec") / "t"
    write_small_target(directory, request.param)
    args = read_args(read_json(directory / "config.json"))
    spec = Target(source="path:x", graphs=Graphs(prefill=8, verify=WIDTH), context=96, taps=[0, 1], logits=True,
                  hidden=True)
    modules = build_modules(args, spec, load_tensors(directory), torch.float32)
    driver = module_driver(modules)
    assert driver.commits == (request.param == "hybrid")
    return driver


class ScriptedDrafter(DFlash2Driver):
    """A DFlash2-shaped drafter (its driver's begin / propose / observe) proposing from a script: ``truth`` (the
    target's greedy continuation) with ``wrong_at`` positions of each block replaced by a wrong id."""

    def __init__(self, truth: list[int], prompt_len: int, wrong_at: set[int]):
        self.truth, self.n, self.wrong_at = truth, prompt_len, wrong_at
        self.functions = self
        self.context_rows = 0

    def reset(self) -> None:
        self.context_rows = 0

    def add_context(self, taps, p0, function) -> None:
        assert p0 == self.context_rows  # context arrives in order, with no gap and no overlap
        self.context_rows += len(taps)

    def draft(self, anchor: int, p0: int) -> list[int]:
        assert p0 == self.context_rows  # the context holds exactly the positions before the anchor
        offset = p0 - self.n + 1  # index in truth of the first draft
        ids = self.truth[offset : offset + WIDTH - 1]
        ids = ids + [0] * (WIDTH - 1 - len(ids))
        return [(t + 1) % 4096 if i in self.wrong_at else t for i, t in enumerate(ids)]


def prompt() -> list[int]:
    return torch.randint(4, 4000, (11,), generator=torch.Generator().manual_seed(3)).tolist()


def test_perfect_drafter_accepts_every_draft(target):
    tokens = 23
    truth, _ = target.greedy(prompt(), tokens + WIDTH)
    drafter = ScriptedDrafter(truth, len(prompt()), wrong_at=set())
    run, logits = speculative.speculate(target, drafter, prompt(), tokens)
    assert run.output == truth[:tokens]
    assert [r.accepted for r in run.rounds[:-1]] == [WIDTH - 1] * (len(run.rounds) - 1)
    stats = speculative.acceptance_stats([run], WIDTH)
    assert stats["acceptance_by_position"] == [1.0] * (WIDTH - 1)
    assert len(logits) == tokens


@pytest.mark.parametrize("wrong_at, accepted", [({0}, 0), ({2}, 2), ({3}, 3)])
def test_first_wrong_draft_ends_the_round(target, wrong_at, accepted):
    tokens = 20
    truth, _ = target.greedy(prompt(), tokens + WIDTH)
    run, _ = speculative.speculate(target, ScriptedDrafter(truth, len(prompt()), wrong_at), prompt(),
                                   tokens)
    assert run.output == truth[:tokens]  # lossless whatever the drafter proposes
    assert {r.accepted for r in run.rounds[:-1]} == {accepted}
    stats = speculative.acceptance_stats([run], WIDTH)
    assert stats["acceptance_by_position"][: accepted + 1] == [1.0] * accepted + [0.0]


class CyclingDrafter(ScriptedDrafter):
    """Round r's first wrong draft is at position r mod WIDTH (WIDTH - 1 drafts: the last value means none
    wrong), so the rounds accept 0, 1, ..., WIDTH - 1 drafts in turn."""

    def __init__(self, truth: list[int], prompt_len: int):
        super().__init__(truth, prompt_len, wrong_at=set())
        self.round = 0

    def draft(self, anchor: int, p0: int) -> list[int]:
        self.wrong_at = {self.round % WIDTH}
        self.round += 1
        return super().draft(anchor, p0)


def test_partial_accepts_of_every_length_keep_the_target_exact(target):
    """Every accept length 0..WIDTH-1 occurs; the target's verify logits of every emitted token equal plain
    greedy decoding's (fp32): the rejected rows left no trace in its KV cache or recurrent state."""
    tokens = 40
    truth, greedy_logits = target.greedy(prompt(), tokens + WIDTH)
    run, logits = speculative.speculate(target, CyclingDrafter(truth, len(prompt())), prompt(), tokens)
    assert run.output == truth[:tokens]
    assert {r.accepted for r in run.rounds} == set(range(WIDTH))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(logits, greedy_logits[:tokens], strict=True))
    assert worst < 1e-4


def test_ngram_drafter_proposes_the_continuation_of_the_latest_earlier_match():
    drafter = speculative.NGramDrafter(max_order=3)
    def propose(text: list[int], count: int) -> list[int]:
        return drafter.propose(text, len(text) - 1, count)  # the anchor, the text's last id, at its position

    assert propose([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]  # order 3, the latest occurrence
    assert propose([4, 7, 1, 6, 7], 3) == [1, 6, 7]  # no order 3 or 2 match: order 1
    assert propose([5, 6, 5], 4) == [6, 5]  # the continuation stops at the end of the text
    assert propose([1, 2, 3], 4) == []


def test_ngram_drafting_is_lossless_and_counts_its_calls(target):
    """Prompt lookup on a prompt that recurs: verify calls where a suffix matched, decode calls where none did
    (after pending verify rows too, on the hybrid target), and the output equals plain greedy."""
    tokens = 30
    repeated = prompt() + prompt()
    truth, _ = target.greedy(repeated, tokens)
    run, _ = speculative.speculate(target, speculative.NGramDrafter(), repeated, tokens)
    assert run.output == truth
    stats = speculative.ngram_stats([run], WIDTH)
    assert stats["verify_calls"] + stats["decode_calls"] == stats["rounds"] == len(run.rounds)
    assert stats["verify_calls"] > 0 and stats["tokens"] >= tokens - 1  # the prefill call gives the first id
    assert all(r.accepted == 0 for r in run.rounds if not r.proposal)


def test_lossless_check_classifies_divergence():
    logits = np.zeros(8, dtype=np.float32)
    logits[[2, 5]] = [3.0, 2.9]
    run = speculative.PromptRun(prompt=[1], output=[4, 2, 7])
    speculative.check_lossless(run, [4, 5, 7], [None, logits, None], [None, None, None], margin=0.25)
    assert run.divergence == {"offset": 1, "speculative": 2, "greedy": 5, "logit_gap": pytest.approx(0.1),
                              "kind": "near_tie"}
    logits[5] = 1.0
    run = speculative.PromptRun(prompt=[1], output=[4, 2, 7])
    speculative.check_lossless(run, [4, 5, 7], [None, logits, None], [None, None, None], margin=0.25)
    assert run.divergence["kind"] == "real_flip"
    stats = speculative.acceptance_stats([run], WIDTH)
    assert stats["lossless"] is False and stats["real_flips"] == 1


def test_paired_ab_and_sign_test():
    base = [speculative.PromptRun([0], [], [speculative.Round(0, (1, 2), 2), speculative.Round(3, (5, 6), 0),
                                            speculative.Round(4, (7, 8), 1)])]
    other = [speculative.PromptRun([0], [], [speculative.Round(0, (1, 2), 2), speculative.Round(3, (5, 9), 1),
                                             speculative.Round(5, (7, 8), 1)])]
    ab = speculative.paired_ab(base, other)
    assert ab == {"matched_rounds": 2, "identical_proposals": 0.5, "base_more": 0, "other_more": 1,
                  "sign_test_p": 1.0, "accepted_base": 2, "accepted_other": 3}
    assert speculative.sign_test(0, 6) == pytest.approx(2 / 64)
    assert speculative.sign_test(27, 32) == pytest.approx(0.603, abs=1e-3)  # seed 003's paired A/B


class ScriptedHead(MTPDriver):
    """An MTP-shaped drafter (its driver's begin / propose / observe) that checks the rows the loop commits and
    proposes ``truth``."""

    def __init__(self, truth: list[int], prompt_ids: list[int]):
        self.truth, self.committed = truth, list(prompt_ids[:1])  # row p holds the token at position p (p >= 1)
        self.functions = self
        self.sequence = list(prompt_ids) + truth

    def reset(self) -> None:
        pass

    def accept(self, tokens, hidden, p0):
        assert p0 == len(self.committed)  # rows arrive in order, after positional rollback of draft rows
        assert tokens == self.sequence[p0 : p0 + len(tokens)]  # the committed tokens, nothing else
        assert len(hidden) == len(tokens)
        self.committed += tokens
        return self.sequence[len(self.committed)], np.zeros(4, dtype=np.float32)

    def step(self, token, hidden, position):
        assert token == self.sequence[position]
        return self.sequence[position + 1], hidden


def test_mtp_loop_commits_rows_in_order(target):
    tokens = 17
    ids = prompt()
    truth, _ = target.greedy(ids, tokens + WIDTH)
    head = ScriptedHead(truth, ids)
    run, _ = speculative.speculate(target, head, ids, tokens)
    assert run.output == truth[:tokens]
    assert {r.accepted for r in run.rounds} == {WIDTH - 1}


def test_target_taps_feed_the_dflash2_drafter_as_the_runtime_does(tmp_path):
    """The target's export modules produce the taps (equal to transformers' hidden_states[i+1]), the speculative
    driver writes them into the drafter's ring in runtime-sized fp16 chunks; the draft equals the eager reference
    fed the same fp16 rows (fp32 arithmetic)."""
    from transformers import Qwen3ForCausalLM

    from convert.models import dflash2
    from tests.helpers.dflash2_checkpoints import random_reference, tiny_config

    taps = [2, 0, 1]  # not sorted: the concatenation follows this order (the last layer, 3, would be HF's normed one)
    write_checkpoint(tmp_path / "t", hidden_size=64, num_hidden_layers=4)
    hf = Qwen3ForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).eval()
    args = Qwen3Args.from_config(read_json(tmp_path / "t" / "config.json"))
    spec = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=96, taps=taps)
    target_modules = build_modules(args, spec, load_tensors(tmp_path / "t"), torch.float32)
    driver = module_driver(target_modules)
    ids = torch.randint(4, 4000, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    out = driver.prefill(ids)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1][0] for i in taps], dim=-1)
    assert np.abs(out["taps"] - features.numpy()).max() < 1e-4

    config = tiny_config(vocab_size=4096, dflash_config={
        "target_layer_ids": taps, "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2, "conv_group_size": 16,
        "selector_rank": 16, "selector_top_k": 8})
    reference = random_reference(config, seed=2)
    drafter_args = dflash2.DFlash2Args.from_config(config)
    embed, lm_head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    drafter_modules = dflash2.build_modules(drafter_args, reference.drafter_state(), lm_head, embed[3], torch.float32,
                                            max_positions=96, ring_rows=64, update_width=16, append_width=8)
    drafter = DFlash2Driver(ModuleFunctions(drafter_modules), drafter_modules.widths,
                                        embed.numpy())
    drafter.add_context(out["taps"], 0, "context_update")  # 37 rows: chunks of 16, the last one padded
    anchor = int(out["argmax_ids"][-1])
    got = drafter_modules.call("draft", anchor_embedding=embed[anchor][None, None], anchor_id=[[anchor]],
                               position_ids=[list(range(37, 45))])
    shipped = torch.from_numpy(out["taps"]).half().float()  # the runtime's taps input is fp16
    ref = reference.draft(shipped, embed[anchor], embed[3], lm_head, anchor, 37)
    assert float((got["logits"][0] - ref.logits).abs().max()) < 1e-4
    assert got["draft_ids"][0].tolist() == ref.draft_ids.tolist()
    assert drafter.draft(anchor, 37) == ref.draft_ids.tolist()


def test_a_quantized_drafter_that_loses_acceptance_is_refused():
    from convert.errors import GateError
    from convert.pipeline.drafter_accept import ab_verdict, raise_if_lossy

    base = [speculative.PromptRun([0], [], [speculative.Round(i, (1,), 1) for i in range(0, 20, 2)])]
    worse = [speculative.PromptRun([0], [], [speculative.Round(i, (2,), 0) for i in range(0, 20, 2)])]
    verdict = ab_verdict(speculative.paired_ab(base, worse), max_p=0.05)
    assert verdict["base_more"] == 10 and verdict["sign_test_p"] == pytest.approx(2 / 1024)
    assert verdict["significant_loss"] is True
    assert ab_verdict(speculative.paired_ab(worse, base), max_p=0.05)["significant_loss"] is False  # it gains
    run = speculative.PromptRun([0], [3], divergence={"offset": 0, "speculative": 3, "greedy": 4, "logit_gap": 2.0,
                                                       "kind": "real_flip"})
    with pytest.raises(GateError, match="not lossless: at output offset 0 it produced 3 where plain greedy"):
        raise_if_lossy(speculative.acceptance_stats([run], WIDTH), [run])


def test_an_ane_target_decodes_speculatively_as_the_stateful_one(tmp_path):
    """A DFlash2 drafter (stateful) and prompt lookup with the target in either layout: the ane target's taps, ids and
    rollbacks through the host give the same rounds, the same accepted drafts and the same output, which equals plain
    greedy decoding."""
    from convert.models import dflash2
    from tests.helpers.dflash2_checkpoints import random_reference, tiny_config

    taps = [2, 0, 1]
    write_checkpoint(tmp_path / "t", hidden_size=64, num_hidden_layers=4)
    args = Qwen3Args.from_config(read_json(tmp_path / "t" / "config.json"))
    tensors = load_tensors(tmp_path / "t")
    config = tiny_config(vocab_size=4096, dflash_config={
        "target_layer_ids": taps, "block_size": 8, "mask_token_id": 3, "conv_kernel_size": 2, "conv_group_size": 16,
        "selector_rank": 16, "selector_top_k": 8})
    reference = random_reference(config, seed=2)
    embed, lm_head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    prompt = torch.randint(4, 4000, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {}
    for layout in ("stateful", "ane"):
        target = Target(source="path:x", graphs=Graphs(prefill=16, verify=8), context=96, taps=taps, layout=layout)
        driver = module_driver(build_modules(args, target, tensors, torch.float32))
        drafter_modules = dflash2.build_modules(dflash2.DFlash2Args.from_config(config), reference.drafter_state(),
                                                lm_head, embed[3], torch.float32, max_positions=96, ring_rows=64,
                                                update_width=16, append_width=8)
        drafter = DFlash2Driver(ModuleFunctions(drafter_modules), drafter_modules.widths, embed.numpy())
        run, _ = speculative.speculate(driver, drafter, prompt, 40)
        lookup, _ = speculative.speculate(driver, speculative.NGramDrafter(), prompt, 60)
        runs[layout] = (run, lookup, driver.greedy(prompt, 60)[0])
    (stateful, stateful_lookup, greedy), (ane, ane_lookup, ane_greedy) = runs["stateful"], runs["ane"]
    assert ane.output == stateful.output == greedy[:40] and ane_lookup.output == stateful_lookup.output == greedy
    assert ane_greedy == greedy
    for a, b in ((ane, stateful), (ane_lookup, stateful_lookup)):
        assert [(r.proposal, r.accepted) for r in a.rounds] == [(r.proposal, r.accepted) for r in b.rounds]
    # prompt lookup's drafts are partly accepted at times: the ane target rolled back through its host buffers
    assert sum(0 < r.accepted < len(r.proposal) for r in ane_lookup.rounds) >= 3
