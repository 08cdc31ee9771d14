"""The MTP head behind the drafter registry (``convert.models.DRAFTERS``): the hooks every drafter family defines with
the same signatures (``convert.models.contracts.DrafterFamily``), which the pipeline and the runtime call instead of
naming the family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from convert.errors import InputError
from convert.inputs.contract import as_config
from convert.inputs.sources import tensor_shapes
from convert.models.mtp.ane import host_contract as ane_contract
from convert.models.mtp.checkpoint import load_head, sanitize
from convert.models.mtp.config import MTPArgs, canonical_shapes
from convert.models.mtp.driver import MTPDriver
from convert.models.mtp.export import build_modules, function_specs

KIND = "mtp"
SOURCE_REQUIRED = False  # the head may sit in the target's own checkpoint
Args = MTPArgs
driver = MTPDriver  # (functions, widths, embeddings): the runtime's ``DrafterDriver``
HIDDEN_CONVENTION = "target final-norm output at position t (what its lm_head reads), vLLM's convention"


def recipe_problems(recipe) -> list[str]:
    """What in a recipe this drafter cannot be built with (checked before anything is read)."""
    if recipe.target.graphs.verify < 2:
        return ["an MTP drafter needs target.graphs.verify >= 2 (the bonus token and one draft)"]
    return []


def check_checkpoint(args: MTPArgs, directory: Path, recipe, where, config_path: Path) -> str:
    """Refuse a checkpoint whose head tensors are not its config's, or a target that does not return its hidden
    states; returns the head's tensor layout."""
    layout = sanitize(tensor_shapes(directory), args, f"checkpoint {directory}")
    if not recipe.target.hidden:
        raise InputError(f"{where}: target.hidden: an MTP drafter reads the target's final-norm hidden states; set "
                         "target.hidden: true")
    return layout


def specs(args: MTPArgs, recipe, dtype: torch.dtype, head_ranges) -> list:
    """``accept`` and ``draft_step`` for the recipe: a draft per verify row after the bonus token."""
    return function_specs(args, recipe.target.graphs.verify - 1, recipe.target.context, dtype,
                          layout=recipe.drafter.layout, head_ranges=head_ranges)


def host_contract(args: MTPArgs, config, head_ranges) -> dict:
    """The ane layout's host contract (``config``: the recipe's drafter section)."""
    return ane_contract(args, head_ranges)


def own_shapes(args: MTPArgs) -> dict[str, tuple[int, ...]]:
    return canonical_shapes(args)


def stream_scale(target_scale: float) -> float:
    """The factor the head's residual stream starts at: it starts from its fc over normed rows, so 1 whatever the
    target's."""
    return 1.0


def modules(args: MTPArgs, directory: Path, recipe, lm_head: torch.Tensor, table, dtype: torch.dtype,
            head_ranges, target_scale: float, own_scale: float):
    """Export modules in ``dtype`` with the target's ``lm_head`` and embedding ``table``, the head's range scale
    folded."""
    tables = {"model.embed_tokens.weight": torch.from_numpy(np.asarray(table)), "lm_head.weight": lm_head}
    return build_modules(args, load_head(directory, args), tables, recipe.target.context,
                         recipe.target.graphs.verify - 1, dtype, layout=recipe.drafter.layout,
                         head_ranges=head_ranges, residual_scale=own_scale)


def recorded_bytes(inputs: dict[str, int], widths: dict[str, int], length: int, tokens: int) -> int:
    """At most the input bytes one prompt of ``length`` tokens and ``tokens`` generated passes the head: the prompt's
    accept calls, then a round a token (``inputs``: a call's bytes by function)."""
    prompt = -(-length // widths["accept"]) * inputs["accept"]
    return prompt + tokens * (inputs["accept"] + (widths["accept"] - 2) * inputs["draft_step"])


def binding(args: MTPArgs) -> dict:
    """What the head takes from its target beside its tables (the manifest's ``target`` record): which hidden state."""
    return {"mask_token_id": None, "hidden_convention": HIDDEN_CONVENTION}


def architecture(args: MTPArgs, config, widths: dict[str, int], core) -> dict:
    """The manifest's ``architecture`` fields the family decides."""
    runtime = {"draft_steps": widths["accept"] - 1, "accept_width": widths["accept"], "context": core.context,
               "zero_centred_norm": args.zero_centred_norm, "attn_output_gate": args.attn_output_gate,
               "rotary_dim": args.rotary_dim, "hidden_convention": HIDDEN_CONVENTION}
    return {"kind": "mtp", "architectures": [f"{args.model_type or 'qwen3'}-mtp"], "num_layers": args.mtp_layers,
            "runtime": runtime}


def plan_lines(args: MTPArgs, config) -> list[str]:
    """The plan's lines on the head beyond its shapes: none."""
    return []


def contract_plan(recipe, recipe_path: Path, pinned: dict) -> tuple[list[str], MTPArgs | None, str | None]:
    """The head planned from the recipe's contracts (``build --dry-run`` without its checkpoint): it has the target's
    attention geometry and is declared in the target's config (``pinned``, the target contract's), with the drafter's
    contract over it. Returns the plan's lines, its args and its layout (None, None where the contracts do not plan
    it)."""
    drafter, target = recipe.drafter, recipe.target
    steps = target.graphs.verify - 1
    own = as_config(drafter.contract)
    config = {**pinned, **own}
    if "text_config" in pinned:
        config["text_config"] = {**pinned["text_config"], **own.get("text_config", {})}
    source = drafter.source or f"{target.source} (its own mtp.* tensors)"
    try:
        args = MTPArgs.from_config(config, f"{recipe_path}: target.contract + drafter.contract")
    except InputError as missing:
        return [f"  drafter mtp {source}: {steps} draft steps, the head's shapes from config.json at build time (the "
                f"contracts do not plan it: {missing})"], None, None
    return [f"  drafter mtp {source}: {steps} draft steps, hidden {args.hidden_size}, heads "
            f"{args.num_attention_heads}/{args.num_key_value_heads} (head_dim {args.head_dim}), quantization "
            f"{drafter.quantization.method}, layout {drafter.layout}"], args, "mtp"
