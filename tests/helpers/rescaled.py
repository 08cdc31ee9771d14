"""Function-preserving rescales of a checkpoint (issue #40): the magnitudes real checkpoints carry, with the same
function. RMSNorm divides a row by its own scale, so multiplying the residual stream by B (the embedding rows and every
projection that writes into it) leaves every normed input, the final norm and the logits as they were; multiplying an
MLP's ``up_proj`` by B and dividing its ``down_proj`` by B raises the intermediate alone. Factors are powers of two:
exact in any float format until a value leaves its range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

# the projections that write into a decoder's residual stream (Qwen3 / Qwen3.5 / their MTP layers)
RESIDUAL_WRITERS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


def rescaled(source: Path, out: Path, factors) -> Path:
    """A copy of the checkpoint ``source`` at ``out`` with each tensor multiplied by ``factors(key)`` (1: unchanged),
    in its own dtype."""
    config = json.loads((source / "config.json").read_text())
    if config.get("tie_word_embeddings") or config.get("text_config", {}).get("tie_word_embeddings"):
        raise ValueError(f"{source}: a tied lm_head would scale the logits too")
    shutil.copytree(source, out)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        changed = {k: (v.float() * factors(k)).to(v.dtype) for k, v in tensors.items() if factors(k) != 1}
        if changed:
            save_file({**tensors, **changed}, str(path), metadata={"format": "pt"})
    return out


def residual_scaled(source: Path, out: Path, factor: float) -> Path:
    """The target's residual stream times ``factor``: its embedding rows and every residual writer of its decoder
    layers (not an MTP head's: its own residual stream starts from its fc)."""
    def factors(key: str) -> float:
        target = not key.startswith("mtp.")
        return factor if target and (key.endswith("embed_tokens.weight") or key.endswith(RESIDUAL_WRITERS)) else 1
    return rescaled(source, out, factors)


def mlp_rebalanced(source: Path, out: Path, factor: float) -> Path:
    """Every target MLP's intermediate times ``factor``: ``up_proj`` times it, ``down_proj`` divided by it."""
    def factors(key: str) -> float:
        if key.startswith("mtp."):
            return 1
        return factor if key.endswith("mlp.up_proj.weight") else 1 / factor if key.endswith("mlp.down_proj.weight") \
            else 1
    return rescaled(source, out, factors)


def drafter_residual_scaled(source: Path, out: Path, factor: float) -> Path:
    """A DFlash2 drafter's residual stream times ``factor``, as its target's is by ``residual_scaled``: the drafter's
    block starts from the target's embedding rows (the anchor's and the mask's), so with the target's rows times
    ``factor`` its draft layers' residual writers take the same factor (its ``fc`` reads the taps through a norm)."""
    return rescaled(source, out, lambda key: factor if key.endswith(RESIDUAL_WRITERS) else 1)


def mtp_residual_scaled(source: Path, out: Path, factor: float) -> Path:
    """An MTP head's residual stream times ``factor``: its ``fc`` (where the stream starts, from normed rows) and its
    layers' residual writers."""
    def factors(key: str) -> float:
        return factor if key.startswith("mtp.") and (key == "mtp.fc.weight" or key.endswith(RESIDUAL_WRITERS)) else 1
    return rescaled(source, out, factors)


class DrafterCalls:
    """Records a pair's drafter calls in the devices' arithmetic (``drafter_accept.DeviceFunctions`` replaced by
    ``DrafterCalls.functions()``): each call's argmax id and top-two logit margin per row. Two runs accept the same away
    from near ties (``part_at_a_near_tie``) when their drafter calls agree id for id, or part first at a row whose two
    best logits are a near tie in both."""

    def __init__(self):
        self.calls: list[dict] = []

    def functions(self):
        import numpy as np

        from convert.runtime.host import DeviceFunctions
        calls = self.calls

        class Recording(DeviceFunctions):
            def call(self, function, inputs):
                out = super().call(function, inputs)
                logits = [v.reshape(-1, v.shape[-1]) for k, v in sorted(out.items()) if k.startswith("logits")]
                if self.peaks is not None and logits:  # the drafter side: the one whose peaks are watched
                    joined = np.concatenate(logits, axis=-1)
                    top = np.sort(joined, axis=-1)[:, -2:]
                    calls.append({"function": function, "ids": joined.argmax(-1).tolist(),
                                  "margin": (top[:, 1] - top[:, 0]).tolist()})
                return out
        return Recording


def first_parting(a: list[dict], b: list[dict]) -> int | None:
    """The index of the first drafter call whose ids differ between two recordings, None when none does."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x["ids"] != y["ids"]), None)


def part_at_a_near_tie(a: list[dict], b: list[dict], margin: float) -> bool:
    """Whether the first call at which two recordings part has, at every row whose id differs, its two best logits
    closer than ``margin`` in both runs (a near tie: fp16 at two magnitudes may order them either way)."""
    first = first_parting(a, b)
    x, y = a[first], b[first]
    rows = [r for r, (i, j) in enumerate(zip(x["ids"], y["ids"], strict=True)) if i != j]
    return all(x["margin"][r] < margin and y["margin"][r] < margin for r in rows)
