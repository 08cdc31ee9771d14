"""A target's shipped modules loaded a few pieces at a time: for a target that ships as parts and may be larger than
host memory (a 27B is 54 GB in fp16, 14 GB as 4-bit codes).

``PartLoader.load(parts)`` builds a skeleton core (``convert/weights/stream.py``: parameters on meta, buffers real),
fills only the modules those parts hold from the checkpoint (memory-mapped; cast to the shipping dtype) and swaps in
their quantized weights read back from the quantize stage's cache entries (``QuantizeResult.unit``), then returns the
parts' export modules (``convert.pipeline.partition.part_modules``). They are the tensors of ``build.shipped_modules``
bit for bit; whatever a stage drops is freed. ``units`` are the pieces the streamed gate walks: the embedding, each
decoder layer, the head.
"""

from __future__ import annotations

import torch
from torch import nn

from convert.export.functions import compute_copy, parameters_on_meta
from convert.export.quantized import apply_quantized, linear_rows
from convert.export.spec import SHIP_DTYPE
from convert.inputs.checkpoint import open_checkpoint
from convert.models import family_of
from convert.models.part import Part, core_dtype
from convert.weights import rescale
from convert.weights.quantize import QuantizeResult
from convert.weights.stream import Streamer, release_free_memory, skeleton
from convert.weights.target import TargetModules, modules_over


class PartLoader:
    """Loads parts of ``plan``'s target with the weights as they ship (``result``: the quantize stage's, or None;
    ``scales``: the range scales folded as the weights are read, ``convert/weights/rescale.py``)."""

    def __init__(self, plan, result: QuantizeResult | None, scales: rescale.Scales | None = None):
        self.plan, self.result, self.scales = plan, result, scales or rescale.Scales()
        self.reader = open_checkpoint(plan.snapshot.directory)
        self.outline = modules_over(skeleton(plan.args, plan.recipe.target, SHIP_DTYPE, SHIP_DTYPE, "cpu"), plan.args,
                                    plan.recipe.target, SHIP_DTYPE)

    def load(self, parts: list[Part], compute: torch.dtype | None = None, lean: bool = False) -> list[TargetModules]:
        """The export modules of ``parts`` (one core shared by them), holding only those parts' weights;
        ``compute``: as ``export.compute_copy`` in that dtype makes them (made in place). ``lean``: each quantized
        linear a ``CodesLinear`` (its codes packed to their bits, the weight computed at each call), applied a module
        at a time so that only one module's unpacked codes are held: modules that run (the drafter stage), never
        packaged."""
        plan = self.plan
        release_free_memory()
        core = skeleton(plan.args, plan.recipe.target, SHIP_DTYPE, SHIP_DTYPE, "cpu")
        streamer = Streamer(core, self.reader, plan.layout, SHIP_DTYPE, SHIP_DTYPE, "cpu",
                            rescale.weight_factors(core, self.scales))
        rescale.fold_constants(core, self.scales)
        prefixes = list(dict.fromkeys(p for part in parts for p in held_modules(part)))
        quantized = {}
        for prefix in prefixes:
            unit = self.result.unit(prefix) if self.result is not None else {}
            streamer.fill(prefix, frozenset(f"{name}.weight" for name in unit))  # the quantized weight replaces it
            if lean and unit:
                apply_quantized(core, unit, codes_only=True)
            else:
                quantized.update(unit)
            del unit
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


class HeldTarget:
    """The whole target read once, its quantized weights as packed codes (``PartLoader.load(lean=True)``: each
    ``CodesLinear`` computes its fp16 weight at each call, bit for bit the loaded one), moved to ``torch_device``:
    ``load`` gives the same pieces as ``PartLoader.load`` as views of it (``part_modules``), so that the streamed
    gate's candidate reads the checkpoint once instead of once a greedy pass (at 27B: 66 pieces x 16 passes, each
    unfolding its codes on the host). For an accelerator with room for it (``convert.pipeline.build.gate_loader``)."""

    def __init__(self, loader: PartLoader, torch_device: torch.device):
        self.plan, self.outline, self.units = loader.plan, loader.outline, loader.units
        self.whole = loader.load([Part.whole(loader.plan.args)], lean=True)[0]
        for module, _ in self.whole.functions.values():
            module.to(torch_device)  # the shared core once, each function's own constants

    def load(self, parts: list[Part]) -> list[TargetModules]:
        return part_modules(self.whole, self.plan.recipe.target, parts)


def held_modules(part: Part) -> list[str]:
    """The core modules whose weights ``part`` computes with (tied tables: one read serves both)."""
    prefixes = ["embed_tokens"] if part.embedding is not None else []
    prefixes += [f"layers.{i}" for i in part.layer_indices]
    if part.head is not None:
        prefixes += ["norm", "lm_head"]
    return prefixes


def part_modules(modules, target, parts: list[Part]) -> list:
    """The export modules (``TargetModules``) of each part, computing with the whole ``modules``' tensors (shared,
    not copied; a table split along the vocabulary is a view of its rows, a quantized one's codes and tables sliced):
    the same weights, the part's own states."""
    return [modules if part.is_whole else _shared(modules.core, target, part) for part in parts]


def at_context(modules: TargetModules, args, target) -> TargetModules:
    """The whole target's export modules at ``target``'s context (its states and position tables that many rows) over
    a core computing with ``modules``' tensors (shared, not copied): the drafter stage's sessions, which reach a few
    hundred positions of a context of thousands (``pipeline.drafter.stage_target``)."""
    return _shared(modules.core, target, Part.whole(args))


def _shared(core: nn.Module, target, part: Part) -> TargetModules:
    """The export modules of ``part`` at ``target``'s shapes over a fresh core (made on meta) computing with
    ``core``'s tensors."""
    args = core.args
    dtype = core_dtype(core)  # not an exact pack's norms, kept in fp32 (the rows' and tables' dtype is the core's)
    with parameters_on_meta():
        piece = family_of(args).build_core(args, target, part)
    piece = piece.to(dtype).eval()
    _share_part(piece, core, part)
    return modules_over(piece, args, target, dtype, part)


def _share_part(piece: nn.Module, core: nn.Module, part: Part) -> None:
    for j, i in enumerate(part.layer_indices):
        _share(piece.layers[j], core.layers[i])
    if part.embedding is not None:
        piece.embed_tokens = linear_rows(core.embed_tokens, *part.embedding)
        piece.residual_scale = core.residual_scale  # the range scale's multiplier of the rows (rescale.py)
    if part.head is not None:
        piece.norm = core.norm
        piece.lm_head = linear_rows(core.lm_head, *part.head)


def _share(mine: nn.Module, theirs: nn.Module) -> None:
    """``mine`` (a part's fresh module) computes with ``theirs``' tensors: the same parameter and buffer objects, and
    ``theirs``' own submodule where it is a leaf or of another type (a ``QuantizedLinear`` swapped into the whole
    core). Non-tensor attributes stay ``mine``'s (a layer's state rows, counted from the part's first layer)."""
    mine._parameters.update(theirs._parameters)
    mine._buffers.update(theirs._buffers)
    for name, child in theirs._modules.items():
        own = mine._modules[name]
        if type(own) is not type(child) or not child._modules:
            mine._modules[name] = child
        else:
            _share(own, child)
