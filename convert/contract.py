"""Recipe contracts: config.json values a recipe pins for each role, checked against the checkpoint.

A release contract (hidden size, vocabulary, taps, drafter shape ...) written into the recipe turns an upstream
change into a refused build instead of a silently different bundle: ``check`` compares every pinned field with
the checkpoint's config.json and names the first that differs. Keys are config.json fields; nested ones are
dotted (``dflash_config.target_layer_ids``, ``rope_parameters.rope_theta``).

When a pinned source is not on this machine (no network, not in the Hugging Face cache), ``build --dry-run``
plans from the contracts instead (``describe``): the drafter's functions fully when its contract holds its
config, the target's as far as the contract goes. A real build still needs the checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

from convert.errors import InputError, SourceUnavailable
from convert.recipe import Recipe

_MISSING = object()


def lookup(config: dict, key: str):
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def check(config: dict, contract: dict, where: str, field: str) -> None:
    """Refuse a config that differs from ``contract`` in any pinned field, naming it."""
    for key, pinned in contract.items():
        found = lookup(config, key)
        if found is _MISSING:
            raise InputError(f"{where}: {field}.{key}: the recipe pins {pinned!r}; config.json has no such field")
        if found != pinned:
            raise InputError(f"{where}: {field}.{key}: the recipe pins {pinned!r}; config.json has {found!r}")


def as_config(contract: dict) -> dict:
    """The contract as a nested config dict (dotted keys expanded)."""
    config: dict = {}
    for key, value in contract.items():
        node = config
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def describe(recipe: Recipe, recipe_path: Path, unavailable: SourceUnavailable) -> list[str]:
    """The plan of a recipe whose sources are not here, from its contracts (``build --dry-run``)."""
    target = recipe.target
    pinned = as_config(target.contract)
    pinned = pinned.get("text_config", pinned)  # Qwen3.5-style configs nest the text model's fields
    if not pinned:
        raise InputError(f"{unavailable} (and target.contract is empty: nothing to plan from)")
    need = [k for k in ("hidden_size", "vocab_size") if k not in pinned]
    if need:
        raise InputError(f"{recipe_path}: target.contract: pin {', '.join(need)} to plan without the checkpoint")
    hidden, vocab, layers = pinned["hidden_size"], pinned["vocab_size"], pinned.get("num_hidden_layers")
    taps = list(target.taps or [])
    if layers is not None and any(t >= layers for t in taps):
        raise InputError(f"{recipe_path}: target.taps {taps}: a layer is out of range (the contract pins "
                         f"{layers} layers)")
    lines = [f"{recipe.name}: planned from the recipe's contracts, not from checkpoints: {unavailable}",
             "  (a build needs the pinned checkpoints; it checks every contract field against their config.json)",
             f"  target {target.source}: hidden {hidden}, vocab {vocab}, layers {layers or 'not pinned'}, "
             f"context {target.context}"]
    for name, width in (("prefill", target.graphs.prefill), ("decode", 1), ("verify", target.graphs.verify)):
        outputs = [f"argmax_ids [1, {width}] int32"]
        if taps:
            outputs.append(f"taps [1, {width}, {len(taps) * hidden}] float16 (layers {taps})")
        if target.hidden:
            outputs.append(f"hidden [1, {width}, {hidden}] float16")
        lines += [f"    {name}", f"      inputs:  input_ids [1, {width}] int32, position_ids [1, {width}] int32",
                  f"      outputs: {', '.join(outputs)}"]
    kv = [pinned.get(k) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")]
    lines.append("    states: key_cache, value_cache " + (
        f"[{kv[0]}, {kv[1]}, {target.context}, {kv[2]}] float16" if None not in kv
        else "(shapes from config.json: the contract does not pin num_key_value_heads and head_dim)"))
    drafter = recipe.drafter
    if drafter is None:
        return lines
    if drafter.kind == "dflash2":
        return lines + _dflash2_lines(recipe, recipe_path, hidden, vocab, taps)
    steps = target.graphs.verify - 1
    lines.append(f"  drafter mtp {drafter.source or target.source}: {steps} draft steps, the head's shapes from "
                 "config.json at build time")
    for name, width in (("accept", steps + 1), ("draft_step", 1)):
        lines += [f"    {name}", f"      inputs:  input_ids [1, {width}] int32, hidden [1, {width}, {hidden}] "
                  f"float16, position_ids [1, {width}] int32",
                  f"      outputs: draft_ids [1, {width}] int32, hidden_out [1, {width}, {hidden}] float16"]
    return lines


def _dflash2_lines(recipe: Recipe, recipe_path: Path, hidden: int, vocab: int, taps: list[int]) -> list[str]:
    """The drafter's functions from its contract. Fields that no shape depends on (intermediate_size,
    dflash_config.mask_token_id) may be left unpinned: they are read from config.json at build time."""
    from convert.backends.base import function_lines
    from convert.models import dflash2

    drafter, target = recipe.drafter, recipe.target
    config = as_config(drafter.contract)
    unpinned = [k for k in ("intermediate_size", "dflash_config.mask_token_id") if lookup(config, k) is _MISSING]
    placeholders = {"intermediate_size": 1, "dflash_config.mask_token_id": 0}  # for shapes only, never shipped
    planning = as_config({**{k: placeholders[k] for k in unpinned}, **drafter.contract})
    where = f"{recipe_path}: drafter.contract"
    args = dflash2.DFlash2Args.from_config(planning, where)
    if list(args.target_layer_ids) != taps:
        raise InputError(f"{where}: dflash_config.target_layer_ids {list(args.target_layer_ids)} differ from "
                         f"target.taps {taps}")
    for field, mine, theirs in (("hidden_size", args.hidden_size, hidden), ("vocab_size", args.vocab_size, vocab)):
        if mine != theirs:
            raise InputError(f"{where}: {field} {mine} differs from the target contract's {theirs}")
    specs = dflash2.function_specs(args, drafter.context_update, drafter.context_append, drafter.ring, torch.float16,
                                   draft_width=target.graphs.verify)

    lines = [f"  drafter dflash2 {drafter.source}: {args.num_hidden_layers} layers, hidden {args.hidden_size}, heads "
             f"{args.num_attention_heads}/{args.num_key_value_heads} (head_dim {args.head_dim}), taps {taps}, "
             f"selector rank {args.selector_rank} top-k {args.selector_top_k}, block {args.block_size}, ring "
             f"{drafter.ring}, mask scale {drafter.mask_scale}, quantization {drafter.quantization.method}"]
    if unpinned:
        lines.append(f"    not pinned (read from config.json at build time): {', '.join(unpinned)}")
    return lines + function_lines(specs)
