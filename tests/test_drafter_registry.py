"""The drafter registry (issue #42): a drafter family is a module of hooks behind ``convert.models.DRAFTERS``, and the
pipeline and the runtime reach it only through them. A throwaway family, registered here in the test alone, drafts
through the driver protocol what followed the anchor token's previous occurrence in the text (a bigram lookup, padded
with the anchor; its one function passes the ids through); ``spec-convert accept`` plans it, builds its modules and
measures it with no pipeline file knowing it, and its acceptance equals what that drafter accepts on the target's own
greedy continuation, worked out here from the ids alone."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from convert.cli import main
from convert.errors import InputError
from convert.export.functions import ExportModules, FunctionModule
from convert.export.spec import FunctionSpec, TensorSpec
from convert.models import DRAFTERS, drafter_family
from convert.models.contracts import DrafterFamily
from convert.pipeline.build import shipped_modules
from convert.pipeline.drafter_build import held_out_prompts, stage_copy
from convert.pipeline.plan import make_plan
from convert.runtime.host import module_driver
from tests.helpers import recipes
from tests.helpers.checkpoints import write_checkpoint
from tests.helpers.recipes import gate, tiny_target

VERIFY = 4


# ---- the throwaway family: every hook of ``contracts.DrafterFamily``, in a module of its own ----

KIND = "previous"
SOURCE_REQUIRED = False  # it reads the target's config, like an MTP head


@dataclass(frozen=True)
class Args:
    hidden_size: int
    vocab_size: int
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 1
    intermediate_size: int = 0
    rope_theta: float = 1.0
    rms_norm_eps: float = 1e-6
    parameter_count: int = 1

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> Args:
        return cls(hidden_size=config["hidden_size"], vocab_size=config["vocab_size"])


class Core(nn.Module):
    """One parameter (the economics meter a drafter's bytes) and no layer; its drafts are the ids it is given."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1, dtype=torch.float16))
        self.layers = nn.ModuleList()

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"draft_ids": input_ids.to(torch.int32) * self.gain.to(torch.int32)}


def lookup(text: list[int], count: int) -> list[int]:
    """What followed the last token's previous occurrence in ``text`` (``count`` ids, padded with that token)."""
    anchor = text[-1]
    found = next((text[j + 1 : j + 1 + count] for j in range(len(text) - 2, -1, -1) if text[j] == anchor), [])
    return found + [anchor] * (count - len(found))


class Modules(ExportModules):
    def call(self, name: str, **inputs) -> dict[str, torch.Tensor]:
        return self.call_with(name, inputs)


def recipe_problems(recipe) -> list[str]:
    return [] if recipe.target.graphs.verify >= 2 else ["a previous-token drafter needs target.graphs.verify >= 2"]


def check_checkpoint(args, directory, recipe, where, config_path) -> str:
    return "previous-token"


def specs(args, recipe, dtype, head_ranges) -> list[FunctionSpec]:
    count = recipe.target.graphs.verify - 1
    return [FunctionSpec("propose", (TensorSpec("input_ids", (1, count), "int32"),),
                         (TensorSpec("draft_ids", (1, count), "int32"),))]


def host_contract(args, config, head_ranges) -> dict:
    return {}


def own_shapes(args) -> dict[str, tuple[int, ...]]:
    return {"gain": (1,)}


def stream_scale(target_scale: float) -> float:
    return 1.0


def modules(args, directory, recipe, lm_head, table, dtype, head_ranges, target_scale, own_scale):
    spec = specs(args, recipe, dtype, head_ranges)[0]
    core = Core()
    return Modules(core, {"propose": (FunctionModule(core, spec, {}), spec)})


def recorded_bytes(inputs, widths, length, tokens) -> int:
    return (length + tokens) * inputs["propose"]


def binding(args) -> dict:
    return {"mask_token_id": None, "hidden_convention": None}


def architecture(args, config, widths, core) -> dict:
    return {"kind": KIND, "architectures": ["previous-token"], "num_layers": 0, "runtime": {}}


def plan_lines(args, config) -> list[str]:
    return ["    drafts the previous token again"]


def contract_plan(recipe, recipe_path, pinned):
    return ["  drafter previous: from the target's config"], None, None


class Driver:
    def __init__(self, functions, widths, embeddings):
        self.functions = functions

    def begin(self, prompt, out) -> None:
        self.functions.reset()

    def propose(self, text, position, count) -> list[int]:
        out = self.functions.call("propose", {"input_ids": np.asarray([lookup(text, count)], dtype=np.int32)})
        return [int(t) for t in np.asarray(out["draft_ids"])[0][:count]]

    def observe(self, accepted, verified, position) -> None:
        pass


driver = Driver
THIS = sys.modules[__name__]


# ---- the tests ----

@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(DRAFTERS, KIND, THIS)


@pytest.fixture
def recipe(tmp_path) -> Path:
    """A seeded tiny target's recipe with the throwaway drafter (its greedy text repeats itself, as a random model's
    does: the lookup's drafts are accepted at times)."""
    write_checkpoint(tmp_path / "target", hidden_size=64, num_hidden_layers=2)
    target = tiny_target(tmp_path / "target", graphs={"prefill": 32, "decode": 1, "verify": VERIFY}, context=256,
                         gate=gate(1, 64))
    return recipes.recipe(tmp_path, "previous", target=target, backends=["coreai"], drafter={
        "kind": KIND, "quantization": {"method": "none"}, "accept": {"samples": 2, "length": 32, "tokens": 24}})


def test_the_throwaway_family_has_every_hook():
    """The throwaway family is a ``contracts.DrafterFamily`` as the registered ones are (``tests/test_contracts.py``
    checks those), every hook present."""
    assert isinstance(THIS, DrafterFamily) and THIS.KIND == KIND


def test_an_unknown_drafter_kind_is_refused_naming_the_kinds(recipe):
    result = CliRunner().invoke(main, ["build", str(recipe), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "drafter.kind: 'previous' is not a drafter kind; one of dflash2, mtp" in result.output
    with pytest.raises(InputError, match="is not a drafter kind"):
        drafter_family("eagle3")


def expected_acceptance(prompts: list[list[int]], greedy: list[list[int]], tokens: int,
                        width: int) -> tuple[float, list[float]]:
    """Tokens a round and acceptance by draft position of the bigram lookup, worked out from each prompt and its
    greedy ids (the first one the prefill's) alone."""
    rounds, reached, accepted = [], [0] * (width - 1), [0] * (width - 1)
    for prompt, ids in zip(prompts, greedy, strict=True):
        i = 1  # ids[0] comes from the prefill; a round starts from the anchor ids[i - 1]
        while i < tokens:
            proposal, k = lookup(prompt + ids[:i], width - 1), 0
            while k < width - 1 and ids[i + k] == proposal[k]:
                k += 1
            rounds.append(k + 1)
            for j in range(width - 1):
                reached[j] += j <= k
                accepted[j] += j < k
            i += k + 1
    return sum(rounds) / len(rounds), [a / n if n else None for a, n in zip(accepted, reached, strict=True)]


def test_accept_runs_a_drafter_family_registered_in_the_test_alone(recipe, registered):
    result = CliRunner().invoke(main, ["accept", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    acceptance = json.loads(result.stdout)["acceptance"]
    plan = make_plan(recipe)
    target, _ = shipped_modules(plan)
    prompts = held_out_prompts(plan)[0]
    tokens = plan.drafter.config.accept.tokens
    greedy = [module_driver(stage_copy(plan, target)).greedy(p, tokens + VERIFY)[0] for p in prompts]
    per_round, by_position = expected_acceptance(prompts, greedy, tokens, VERIFY)
    assert acceptance["lossless"] is True and acceptance["prompts"] == 2
    assert acceptance["tokens_per_round"] == pytest.approx(per_round)
    assert acceptance["acceptance_by_position"] == pytest.approx(by_position)
    assert by_position[0] > 0.05  # measured 0.098 (4 of 41 first drafts; 1.12 tokens a round)
