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

from convert import fields
from convert.errors import InputError, SourceUnavailable, quote
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
            if not isinstance(node, dict):
                raise InputError(f"contract: {quote(key)} pins a field inside {quote(part)}, which the contract also "
                                 f"pins as {quote(node)}; pin one or the other")
        node[last] = value
    return config


def describe(recipe: Recipe, recipe_path: Path, unavailable: SourceUnavailable) -> list[str]:
    """The plan of a recipe whose sources are not here, from its contracts (``build --dry-run``)."""
    target = recipe.target
    pinned = as_config(target.contract)
    where = f"{recipe_path}: target.contract"
    text = fields.section(pinned, where)  # Qwen3.5-style configs nest the text model's fields
    if not pinned:
        raise InputError(f"{unavailable} (and target.contract is empty: nothing to plan from)")
    need = [k for k in ("hidden_size", "vocab_size") if k not in text]
    if need:
        raise InputError(f"{where}: pin {', '.join(need)} to plan without the checkpoint")
    hidden, vocab = fields.integer(text, "hidden_size", where), fields.integer(text, "vocab_size", where)
    layers = text.get("num_hidden_layers")
    if layers is not None:
        layers = fields.check_integer(layers, "num_hidden_layers", where, maximum=fields.MAX_LAYERS)
    taps = list(target.taps or [])
    if layers is not None and any(t >= layers for t in taps):
        raise InputError(f"{recipe_path}: target.taps {taps}: a layer is out of range (the contract pins "
                         f"{layers} layers)")
    lines = [f"{recipe.name}: planned from the recipe's contracts, not from checkpoints: {unavailable}",
             "  (a build needs the pinned checkpoints; it checks every contract field against their config.json)",
             f"  target {target.source}: hidden {hidden}, vocab {vocab}, layers {layers or 'not pinned'}, "
             f"context {target.context}"]
    lines += _target_lines(pinned, target, recipe.backends, f"{recipe_path}: target.contract")
    drafter = recipe.drafter
    if drafter is None:
        return lines
    if drafter.kind == "dflash2":
        return lines + _dflash2_lines(recipe, recipe_path, hidden, vocab, taps)
    return lines + _mtp_lines(recipe, recipe_path, pinned)


def _mtp_lines(recipe: Recipe, recipe_path: Path, pinned: dict) -> list[str]:
    """The MTP head's functions from the target's contract (the head has the target's attention geometry and
    is declared in its config) with the drafter's contract over it."""
    from convert.backends.base import function_lines, size_lines
    from convert.models import mtp

    drafter, target = recipe.drafter, recipe.target
    steps = target.graphs.verify - 1
    config = {**pinned, **as_config(drafter.contract)}
    if "text_config" in pinned:
        config["text_config"] = {**pinned["text_config"], **as_config(drafter.contract).get("text_config", {})}
    source = drafter.source or f"{target.source} (its own mtp.* tensors)"
    try:
        args = mtp.MTPArgs.from_config(config, f"{recipe_path}: target.contract + drafter.contract")
    except InputError as missing:
        return [f"  drafter mtp {source}: {steps} draft steps, the head's shapes from config.json at build time "
                f"(the contracts do not plan it: {missing})"]
    specs = mtp.function_specs(args, steps, target.context, torch.float16)
    return [f"  drafter mtp {source}: {steps} draft steps, hidden {args.hidden_size}, heads "
            f"{args.num_attention_heads}/{args.num_key_value_heads} (head_dim {args.head_dim}), quantization "
            f"{drafter.quantization.method}", *size_lines(args.parameter_count, recipe.backends, "    "),
            *function_lines(specs)]


def _target_lines(pinned: dict, target, backends: list[str], where: str) -> list[str]:
    """The target's architecture, functions and states from a contract that pins the architecture (architectures or
    model_type) and every field its shapes depend on (the family's ``PLAN_FIELDS``); otherwise what is missing."""
    from convert.backends.base import function_lines, size_lines
    from convert.models import family_for

    text = pinned.get("text_config", pinned)
    if not any(k in c for c in (pinned, text) for k in ("architectures", "model_type")):
        return ["  functions: pin architectures or model_type (and the architecture's shape fields) in "
                "target.contract to plan them"]
    family = family_for(pinned, where)
    missing = [f for f in family.PLAN_FIELDS if lookup(text, f) is _MISSING and not
               any(lookup(text, alt) is not _MISSING for alt in family.PLAN_ALTERNATIVES.get(f, ()))]
    if missing:
        prefix = "text_config." if "text_config" in pinned else ""
        return [f"  functions: the contract does not pin {', '.join(prefix + f for f in missing)}; the "
                f"{family.FAMILY} functions are planned from config.json at build time"]
    args = family.Args.from_config(pinned, where)
    specs = family.function_specs(args, target, torch.float16)
    total = sum(s.nbytes for s in specs[0].states) / 2**20
    from convert.hadamard import rotation_lines
    from convert.parts import build_memory_bytes, memory_line, plan_lines, plan_parts, shipped_line
    from convert.prism import BLOCK_FIELD
    from convert.quantize import estimate_lines

    parts = plan_parts(args, target)
    block = lookup(pinned, BLOCK_FIELD)
    if block is not _MISSING:
        fields.check_integer(block, BLOCK_FIELD, where)
    rotations = rotation_lines(args, target, None if block is _MISSING else block) \
        if target.quantization.method == "exact" else []
    return [*family.plan_lines(args, target), "  functions:", *function_lines(specs),
            *size_lines(args.parameter_count, backends), shipped_line(args, target), *plan_lines(args, target, parts),
            *rotations, f"  states: {total:.1f} MiB in all", *estimate_lines(args, target),
            memory_line(target, build_memory_bytes(args, target, parts, specs))]


def _dflash2_lines(recipe: Recipe, recipe_path: Path, hidden: int, vocab: int, taps: list[int]) -> list[str]:
    """The drafter's functions from its contract. Fields that no shape depends on (intermediate_size,
    dflash_config.mask_token_id) may be left unpinned: they are read from config.json at build time."""
    from convert.backends.base import function_lines, size_lines
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
    else:
        lines.append(f"    mask id {args.mask_token_id}, {len([w for w in args.layer_windows if w])} sliding layers "
                     f"(windows {sorted({w for w in args.layer_windows if w})})")
        lines += size_lines(args.parameter_count, recipe.backends, "    ")
    return lines + function_lines(specs)
