"""Recipe contracts: config.json values a recipe pins for each role, checked against the checkpoint.

A release contract (hidden size, vocabulary, taps, drafter shape ...) written into the recipe turns an upstream
change into a refused build instead of a silently different bundle: ``check`` compares every pinned field with
the checkpoint's config.json and names the first that differs. Keys are config.json fields; nested ones are
dotted (``dflash_config.target_layer_ids``, ``rope_parameters.rope_theta``).

When a pinned source is not on this machine (no network, not in the Hugging Face cache), ``build --dry-run`` plans from
the contracts instead (``as_config``, read by ``convert.pipeline.plan_text.describe_contract``): the drafter's functions
fully when its contract holds its config, the target's as far as the contract goes. A real build still needs the
checkpoints.
"""

from __future__ import annotations

from convert.errors import InputError, quote

MISSING = object()


def lookup(config: dict, key: str):
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def check(config: dict, contract: dict, where: str, field: str) -> None:
    """Refuse a config that differs from ``contract`` in any pinned field, naming it."""
    for key, pinned in contract.items():
        found = lookup(config, key)
        if found is MISSING:
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


