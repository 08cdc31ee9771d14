"""A target's shipped modules loaded a few pieces at a time: for a target that ships as parts and may be larger than
host memory (a 27B is 54 GB in fp16, 14 GB as 4-bit codes).

``PartLoader.load(parts)`` builds a skeleton core (``convert/stream.py``: parameters on meta, buffers real), fills
only the modules those parts hold from the checkpoint (memory-mapped; cast to the shipping dtype) and swaps in their
quantized weights read back from the quantize stage's cache entries (``QuantizeResult.unit``), then returns the
parts' export modules (``convert.parts.part_modules``). They are the tensors of ``build.shipped_modules`` bit for
bit; whatever a stage drops is freed. ``units`` are the pieces the streamed gate walks: the embedding, each decoder
layer, the head.
"""

from __future__ import annotations

import torch

from convert.compress import apply_quantized
from convert.export import compute_copy
from convert.parts import Part, part_modules
from convert.quantize import QuantizeResult
from convert.sources import CheckpointReader
from convert.stream import Streamer, release_free_memory, skeleton
from convert.target import TargetModules, modules_over

SHIP_DTYPE = torch.float16


class PartLoader:
    """Loads parts of ``plan``'s target with the weights as they ship (``result``: the quantize stage's, or None)."""

    def __init__(self, plan, result: QuantizeResult | None):
        self.plan, self.result = plan, result
        self.reader = CheckpointReader(plan.snapshot.directory)
        self.outline = modules_over(skeleton(plan.args, plan.recipe.target, SHIP_DTYPE, SHIP_DTYPE, "cpu"), plan.args,
                                    plan.recipe.target, SHIP_DTYPE)

    def load(self, parts: list[Part], compute: torch.dtype | None = None) -> list[TargetModules]:
        """The export modules of ``parts`` (one core shared by them), holding only those parts' weights;
        ``compute``: as ``export.compute_copy`` in that dtype makes them (made in place)."""
        plan = self.plan
        release_free_memory()
        core = skeleton(plan.args, plan.recipe.target, SHIP_DTYPE, SHIP_DTYPE, "cpu")
        streamer = Streamer(core, self.reader, plan.layout, SHIP_DTYPE, SHIP_DTYPE, "cpu")
        prefixes = list(dict.fromkeys(p for part in parts for p in held_modules(part)))
        quantized = {}
        if self.result is not None:
            for prefix in prefixes:
                quantized.update(self.result.unit(prefix))
        skip = frozenset(f"{name}.weight" for name in quantized)  # never read: the quantized weight replaces it
        for prefix in prefixes:
            streamer.fill(prefix, skip)
        if plan.args.tie_word_embeddings and {"embed_tokens", "lm_head"} <= set(prefixes):
            core.lm_head.weight = core.embed_tokens.weight  # one table, as the whole core holds it
        if quantized:
            apply_quantized(core, quantized)
        del quantized
        for p in core.parameters():
            p.requires_grad_(False)
        pieces = part_modules(modules_over(core, plan.args, plan.recipe.target, SHIP_DTYPE), plan.recipe.target,
                              parts)
        return pieces if compute is None else [compute_copy(piece, compute, in_place=True) for piece in pieces]

    def units(self) -> list[Part]:
        """The embedding, each decoder layer, the head: what the streamed gate loads one at a time."""
        vocab, layers = self.plan.args.vocab_size, self.plan.args.num_hidden_layers
        return [Part("embed", vocab, embedding=(0, vocab)),
                *(Part(f"layer-{i}", vocab, layers=(i, i + 1)) for i in range(layers)),
                Part("head", vocab, head=(0, vocab))]


def held_modules(part: Part) -> list[str]:
    """The core modules whose weights ``part`` computes with (tied tables: one read serves both)."""
    prefixes = ["embed_tokens"] if part.embedding is not None else []
    prefixes += [f"layers.{i}" for i in part.layer_indices]
    if part.head is not None:
        prefixes += ["norm", "lm_head"]
    return prefixes
