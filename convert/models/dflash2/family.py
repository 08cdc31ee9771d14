"""The DFlash2 block drafter behind the drafter registry (``convert.models.DRAFTERS``): the hooks every drafter family
defines with the same signatures (``convert.models.contracts.DrafterFamily``), which the pipeline and the runtime call
instead of naming the family."""

from __future__ import annotations

from pathlib import Path

import torch

from convert.errors import InputError
from convert.inputs.contract import MISSING, as_config, lookup
from convert.inputs.sources import check_safetensors
from convert.models.dflash2.ane import host_contract as ane_contract
from convert.models.dflash2.checkpoint import checkpoint_files, load_checkpoint, sanitize
from convert.models.dflash2.config import DFlash2Args, expected_shapes
from convert.models.dflash2.driver import DFlash2Driver
from convert.models.dflash2.export import build_modules, function_specs
from manifests.schema import TAP_CONVENTION

KIND = "dflash2"
SOURCE_REQUIRED = True  # its own checkpoint (the drafter reads the target's taps, not its tensors)
Args = DFlash2Args
driver = DFlash2Driver  # (functions, widths, embeddings): the runtime's ``DrafterDriver``


def recipe_problems(recipe) -> list[str]:
    """What in a recipe this drafter cannot be built with (checked before anything is read)."""
    drafter, verify = recipe.drafter, recipe.target.graphs.verify
    if drafter.context_append < verify:
        return [f"drafter.context_append {drafter.context_append} is below target.graphs.verify {verify}: one round "
                "can accept that many rows"]
    return []


def check_checkpoint(args: DFlash2Args, directory: Path, recipe, where, config_path: Path) -> str:
    """Refuse a checkpoint whose tensors are not its config's, or that does not fit the recipe's target; returns its
    tensors' layout (the architecture)."""
    sanitize({f.name: check_safetensors(f) for f in checkpoint_files(directory)}, args)
    check_fits(args, recipe, where, config_path)
    return args.architecture


def check_fits(args: DFlash2Args, recipe, where, source) -> None:
    taps = list(recipe.target.taps or [])
    if taps != list(args.target_layer_ids):
        raise InputError(f"{where}: target.taps {taps or None} must equal the drafter's dflash_config.target_layer_ids "
                         f"{list(args.target_layer_ids)} ({source}), in that order")
    verify = recipe.target.graphs.verify
    if verify > args.block_size:
        raise InputError(f"{where}: target.graphs.verify {verify} exceeds the drafter's block_size {args.block_size} "
                         f"({source})")


def specs(args: DFlash2Args, recipe, dtype: torch.dtype, head_ranges) -> list:
    """The drafter's functions for the recipe (its widths, ring and layout)."""
    config = recipe.drafter
    return function_specs(args, config.context_update, config.context_append, config.ring, dtype,
                          draft_width=recipe.target.graphs.verify, layout=config.layout, head_ranges=head_ranges)


def host_contract(args: DFlash2Args, config, head_ranges) -> dict:
    """The ane layout's host contract (``config``: the recipe's drafter section)."""
    return ane_contract(args, config.ring, head_ranges)


def own_shapes(args: DFlash2Args) -> dict[str, tuple[int, ...]]:
    return expected_shapes(args)


def stream_scale(target_scale: float) -> float:
    """The factor the drafter's residual stream starts at: its block starts from the target's embedding rows and reads
    its taps, so the target's residual scale."""
    return target_scale


def modules(args: DFlash2Args, directory: Path, recipe, lm_head: torch.Tensor, table, dtype: torch.dtype,
            head_ranges, target_scale: float, own_scale: float):
    """Export modules in ``dtype`` with the target's ``lm_head`` and embedding ``table`` (its mask row), the range
    scales folded."""
    config = recipe.drafter
    _, tensors = load_checkpoint(directory)
    return build_modules(
        args, tensors, lm_head, torch.from_numpy(table[args.mask_token_id]), dtype,
        max_positions=recipe.target.context, ring_rows=config.ring, update_width=config.context_update,
        append_width=config.context_append, mask_scale=config.mask_scale, draft_width=recipe.target.graphs.verify,
        layout=config.layout, head_ranges=head_ranges, residual_scale=target_scale * own_scale,
        taps_scale=target_scale)


def recorded_bytes(inputs: dict[str, int], widths: dict[str, int], length: int, tokens: int) -> int:
    """At most the input bytes one prompt of ``length`` tokens and ``tokens`` generated passes the drafter: the
    prompt's context calls, then a round a token (``inputs``: a call's bytes by function)."""
    prompt = -(-length // widths["context_update"]) * inputs["context_update"]
    return prompt + tokens * (inputs["context_append"] + inputs["draft"])


def binding(args: DFlash2Args) -> dict:
    """What the drafter takes from its target beside its tables (the manifest's ``target`` record): the mask row's
    token."""
    return {"mask_token_id": args.mask_token_id, "hidden_convention": None}


def architecture(args: DFlash2Args, config, widths: dict[str, int], core) -> dict:
    """The manifest's ``architecture`` fields the family decides."""
    runtime = {"draft_width": widths["draft"], "block_size": args.block_size,
               "context_update": config.context_update, "context_append": config.context_append,
               "ring_rows": config.ring, "sliding_window": max((w or 0) for w in args.layer_windows) or None,
               "mask_token_id": args.mask_token_id, "mask_scale": config.mask_scale,
               "conv_kernel_size": args.conv_kernel_size, "conv_group_size": args.conv_group_size,
               "selector_rank": args.selector_rank, "selector_top_k": args.selector_top_k,
               "tap_convention": TAP_CONVENTION}
    return {"kind": "dflash2" if args.has_selector else "dflash", "architectures": [args.architecture],
            "num_layers": args.num_hidden_layers, "runtime": runtime}


def plan_lines(args: DFlash2Args, config) -> list[str]:
    """The plan's lines on the drafter beyond its shapes."""
    return [f"    taps {list(args.target_layer_ids)} (output of layer i, 0-based), block {args.block_size}, mask id "
            f"{args.mask_token_id} x {config.mask_scale}, ring {config.ring} rows, selector rank "
            f"{args.selector_rank} top-k {args.selector_top_k}"]


UNPINNED = {"intermediate_size": 1, "dflash_config.mask_token_id": 0}
"""Fields no function's shape depends on, which a contract may leave unpinned (their placeholders: for shapes only,
never shipped); the drafter stage's memory is then planned at build time."""


def contract_plan(recipe, recipe_path: Path, pinned: dict) -> tuple[list[str], DFlash2Args | None, str | None]:
    """The drafter planned from the recipe's contracts (``build --dry-run`` without its checkpoint; ``pinned``: the
    target contract's config): the plan's lines on it, the args its functions are planned with (placeholders where
    ``UNPINNED`` fields are not pinned), and its checkpoint layout (None where a field is left unpinned: its memory is
    then planned at build time)."""
    drafter, target = recipe.drafter, recipe.target
    config = as_config(drafter.contract)
    unpinned = [k for k in UNPINNED if lookup(config, k) is MISSING]
    where = f"{recipe_path}: drafter.contract"
    args = DFlash2Args.from_config(as_config({**{k: UNPINNED[k] for k in unpinned}, **drafter.contract}), where)
    taps = list(target.taps or [])
    if list(args.target_layer_ids) != taps:
        raise InputError(f"{where}: dflash_config.target_layer_ids {list(args.target_layer_ids)} differ from "
                         f"target.taps {taps}")
    lines = [f"  drafter dflash2 {drafter.source}: {args.num_hidden_layers} layers, hidden {args.hidden_size}, heads "
             f"{args.num_attention_heads}/{args.num_key_value_heads} (head_dim {args.head_dim}), taps {taps}, "
             f"selector rank {args.selector_rank} top-k {args.selector_top_k}, block {args.block_size}, ring "
             f"{drafter.ring}, mask scale {drafter.mask_scale}, quantization {drafter.quantization.method}, layout "
             f"{drafter.layout}"]
    if unpinned:
        return [*lines, f"    not pinned (read from config.json at build time): {', '.join(unpinned)}"], args, None
    windows = [w for w in args.layer_windows if w]
    return [*lines, f"    mask id {args.mask_token_id}, {len(windows)} sliding layers (windows "
                    f"{sorted(set(windows))})"], args, args.architecture
