"""The tiny recipes tests build from, written by one function: ``recipe(folder, name, target=..., drafter=...,
backends=...)`` dumps the fields as the recipe's YAML (``folder / f"{name}.yaml"``), so a test spells only what it sets.
``tiny_target`` and ``tiny_dflash2`` hold the fields most tiny builds share; their keyword arguments add or replace."""

from __future__ import annotations

from pathlib import Path

import yaml

GRAPHS = {"prefill": 16, "decode": 1, "verify": 8}
# random weights have near-flat logits: fp16 rounding flips a few argmax ids
FLAT_LOGITS = {"device_top1_min": 0.95, "top1_min": 0.95, "greedy_match_min": 0.5}


def gate(samples: int, length: int, greedy_tokens: int | None = None, **thresholds) -> dict:
    """``target.gate``: its data, its greedy tokens where given, its thresholds where given."""
    fields: dict = {"data": {"samples": samples, "length": length}}
    if greedy_tokens is not None:
        fields["greedy_tokens"] = greedy_tokens
    if thresholds:
        fields["thresholds"] = thresholds
    return fields


def tiny_target(source: Path | str, **fields) -> dict:
    """A tiny target's fields: ``source`` as a ``path:`` source, graphs of 16 / 1 / 8 tokens, a context of 128."""
    return {"source": f"path:{source}", "graphs": dict(GRAPHS), "context": 128, **fields}


def tiny_dflash2(source: Path | str, **fields) -> dict:
    """A tiny DFlash2 drafter's fields: ``source`` as a ``path:`` source, a context update of 16 and a ring of 64,
    lut4, acceptance on 2 prompts of 24 tokens, 16 generated."""
    return {"kind": "dflash2", "source": f"path:{source}", "context_update": 16, "ring": 64,
            "quantization": {"method": "lut4"}, "accept": {"samples": 2, "length": 24, "tokens": 16}, **fields}


def recipe(where: Path, name: str, *, target: dict, drafter: dict | None = None, backends: list[str] | None = None,
           **fields) -> Path:
    """Writes ``where / f"{name}.yaml"`` (or ``where`` itself, a ``.yaml`` path): ``name``, ``target``, ``backends``
    and ``drafter`` where given, then ``fields`` (top-level keys: ``output``...). Returns its path."""
    document: dict = {"name": name, "target": target}
    if backends is not None:
        document["backends"] = list(backends)
    if drafter is not None:
        document["drafter"] = drafter
    document.update(fields)
    path = Path(where) if str(where).endswith(".yaml") else Path(where) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False, default_flow_style=None))
    return path
