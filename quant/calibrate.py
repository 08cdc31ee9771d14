"""Calibration for GPTQ: token samples from a corpus, and layer-sequential Hessian capture over a target's export core.

Samples: the corpus text goes through the real tokenizer as one token stream; ``n`` windows of ``length`` tokens
start at offsets drawn from a seeded generator. ``CalibrationSet`` records the text's sha256, n, length and seed
(the calibration identity the manifest records).

Capture (as in the GPTQ reference's layer-sequential loop): the embeddings of every sample, then for each decoder
layer, each group of its linears in turn (the architecture's ``linear_groups``; for attention q/k/v, then o, then
gate/up, then down: "true sequential", so o_proj's Hessian sees the already-quantized q/k/v; for a Gated DeltaNet
in_proj_qkv/in_proj_z, then out_proj): run the layer over every sample, as far as that group's inputs, with hooks
that accumulate the group's input Hessians, hand each linear to the caller's ``quantize_linear``, put the
dequantized weight back. Then the layer's outputs, computed with its quantized weights, become the next layer's
inputs; only one layer's activations are held at a time. Layers run unbatched (the export core works on one
sequence), causally over the sample itself from zeroed states (the architecture's ``calibration_runner``).

The token mixer (the attention or the Gated DeltaNet recurrence) is most of a pass's work, and the MLP's
gate_proj/up_proj matmuls much of the rest. Each of these blocks (the architecture's ``cached_blocks``) returns its
last linear's output (o_proj / out_proj; down_proj), and once the linears before that one are quantized, that
linear's input is fixed for each sample: the pass that captures the linear keeps its inputs, and the later passes
run the linear on them in the block's place (``BlockCache``). The recurrence or the attention then runs in the
o_proj / out_proj pass only (the input projections' pass stops before it), not in four of the five, and the outputs
pass runs neither the mixer nor gate/up (the down pass ran them with the same weights). A layer's caches are granted
block by block within ``cache_budget`` (half the free CUDA memory at the layer's start; 1 GiB on CPU); a block
without one runs in every pass: the same ops on the same values either way, so the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from quant.gptq import HessianAccumulator
from quant.types import QuantizedWeight

# (transformers name without ".weight", weight [out, in], Hessian [in, in]) -> quantized weight, or None to keep it
QuantizeLinear = Callable[[str, torch.Tensor, torch.Tensor], "QuantizedWeight | None"]
# the same for linears that share one Hessian (they read one input): names, weights -> one result per name
QuantizeLinears = Callable[[list[str], list[torch.Tensor], torch.Tensor], "list[QuantizedWeight | None]"]


def each_linear(quantize: QuantizeLinear) -> QuantizeLinears:
    """A ``QuantizeLinears`` that quantizes the linears sharing a Hessian one by one."""
    return lambda names, weights, hessian: [quantize(n, w, hessian) for n, w in zip(names, weights, strict=True)]


@dataclass(frozen=True)
class CalibrationSet:
    tokens: torch.Tensor  # int64 [n, length]
    corpus_sha256: str  # of the UTF-8 text that was tokenized
    n: int
    length: int
    seed: int

    def identity(self) -> dict:
        return {"corpus_sha256": self.corpus_sha256, "n": self.n, "length": self.length, "seed": self.seed}


def fixture_corpus_text(split: str = "train") -> str:
    """A fixture corpus split as the model was trained on it: every file as ``<|bos|> text <|eos|>``.

    The train split is rebuilt by ``python -m fixtures.build_corpus``; validation and eval are shipped.
    """
    from fixtures.corpus import read_split
    from fixtures.train_tokenizer import BOS, EOS

    return "".join(f"{BOS}{f.text}{EOS}" for f in read_split(split))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` through a ``tokenizers.Tokenizer`` or a transformers tokenizer, no added specials."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(encoded, "ids", encoded))


def sample_calibration(text: str, tokenizer, n: int = 128, length: int = 2048, seed: int = 0) -> CalibrationSet:
    """``n`` windows of ``length`` tokens of ``text``, at offsets drawn from ``seed`` (windows may overlap)."""
    ids = torch.tensor(encode(tokenizer, text), dtype=torch.int64)
    if ids.numel() < length:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than one sample of {length}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length + 1, (n,), generator=generator)
    tokens = ids[starts[:, None] + torch.arange(length)]
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return CalibrationSet(tokens=tokens, corpus_sha256=sha, n=n, length=length, seed=seed)


class _Captured(Exception):
    """Raised by the hook of a capture pass's last linear: the rest of the layer is not needed for this sample."""


# How many bytes a layer's block caches may take (``cache_budget``): above it, a block is recomputed in every pass,
# for the same bytes. A cache is samples x length x its last linear's input features in the activations' dtype; at
# the 27B geometry (128 x 2048, fp32) the mixer's is 6 GiB (out_proj and o_proj both take 6144) and the MLP's
# 18.3 GB (down_proj takes 17408).
# CUDA: half of what is free on the device when the layer starts (the driver's free memory and the blocks the
# caching allocator holds unused, e.g. the previous layer's caches). The other half is for what the layer still
# allocates while its caches are held: its outputs (as large as its inputs, 5 GiB at 27B), each sample's transients
# (a recurrence's chunks, the MLP's 2 x 2048 x 17408 fp32 products), and the GPTQ solve of down_proj, the largest
# matrix (its 17408^2 fp32 Hessian is 1.1 GiB; a solve holds a few copies), which runs after the down pass with both
# caches full. The lm_head's 50 GiB peak at this geometry comes after the last layer, when no cache is held. On a
# 141 GB H200 with the 27B activations held that is a budget of about 65 GB: both caches (24.7 GB) with room to spare.
# CPU: a fixed 1 GiB: a 27B build is to stay within 16 GB of host memory, of which the activations and outputs already
# take 10 GiB; that still covers the small models and short calibrations a CPU build is for.
CPU_CACHE_BYTES = 1 << 30
CUDA_FREE_SHARE = 0.5
# When set, the budget on every device instead (tests; ``bench/scale.py --compare-recompute`` sets 0: caches off)
CACHE_BYTES: int | None = None


def cache_budget(device: torch.device) -> int:
    """The most bytes a layer's block caches may take on ``device``, when the layer starts (see above)."""
    if CACHE_BYTES is not None:
        return CACHE_BYTES
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((free + unused) * CUDA_FREE_SHARE)
    return CPU_CACHE_BYTES if device.type == "cpu" else 0


class BlockCache:
    """The inputs of a decoder-layer block's last linear, one per calibration sample, for the passes after the one
    that captures that linear's Hessian.

    A block (the family's ``cached_blocks``: the token mixer, returning ``o_proj(...)`` / ``out_proj(...)``, and the
    MLP, returning ``down_proj(...)``) returns exactly ``last(input)``, and once the linears before it are quantized
    that input is fixed for each sample; so the later passes (for the mixer: the MLP's groups and the outputs; for
    the MLP: the outputs) put a stand-in into the layer that returns ``last(kept input)``: the same op on the same
    tensor as the block would run, with ``last``'s weight as it is then, without the rest of the block (the
    recurrence or the attention; gate_proj and up_proj). (The mixer's state writes are scratch in calibration: every
    sample starts from zeroed states or writes every row before reading it.) ``sample`` is the sample the next
    runner call runs (the caller sets it)."""

    def __init__(self, layer: torch.nn.Module, block: str, last: str, samples: int):
        parent, _, self.child = block.rpartition(".")
        self.parent = layer.get_submodule(parent)
        self.block = layer.get_submodule(block)
        self.last_name, self.last = last, layer.get_submodule(last)
        self.inputs: list[torch.Tensor | None] = [None] * samples
        self.sample = 0

    @staticmethod
    def group(groups: tuple[tuple[str, ...], ...], block: str, last: str) -> int | None:
        """The index of the group that captures ``last``, or None where kept inputs of it would not hold: ``last``
        in no group, or another linear of ``block`` quantized in that group or later (the inputs would go stale)."""
        at = next((i for i, names in enumerate(groups) if last in names), None)
        if at is None or any(n != last and n.startswith(f"{block}.") for names in groups[at:] for n in names):
            return None
        return at

    @classmethod
    def for_layer(cls, layer: torch.nn.Module, groups: tuple[tuple[str, ...], ...], x: torch.Tensor,
                  blocks: tuple[tuple[str, str], ...], outputs: bool = True) -> tuple[BlockCache, ...]:
        """The caches for ``layer`` over the inputs ``x`` of the ``blocks`` (name, last linear; disjoint) that hold
        (``group``) and that a later pass reads (without an ``outputs`` pass, none reads one of the last group's),
        granted in order while their bytes together stay within ``cache_budget`` of ``x``'s device (a block that
        does not fit is skipped; a later, smaller one may still fit)."""
        budget, granted, caches = cache_budget(x.device), 0, []
        for block, last in blocks:
            at = cls.group(groups, block, last)
            if at is None or (at == len(groups) - 1 and not outputs):
                continue
            size = x.shape[0] * x.shape[1] * layer.get_submodule(last).in_features * x.element_size()
            if granted + size > budget:
                continue
            granted += size
            caches.append(cls(layer, block, last, x.shape[0]))
        return tuple(caches)

    @property
    def filled(self) -> bool:
        return all(t is not None for t in self.inputs)

    @contextmanager
    def around(self, names: tuple[str, ...]):
        """A capture pass for the linears ``names``: the one that captures the last linear keeps its inputs; once
        every sample's are kept, the passes run the stand-in instead of the block."""
        if self.last_name in names:
            hook = self.last.register_forward_pre_hook(self._keep, prepend=True)  # before capture's _Captured
            try:
                yield
            finally:
                hook.remove()
        elif self.filled:
            with self.standing_in():
                yield
        else:
            yield

    @contextmanager
    def standing_in(self):
        """The layer with the stand-in in its block's place."""
        setattr(self.parent, self.child, _StandIn(self))
        try:
            yield
        finally:
            setattr(self.parent, self.child, self.block)

    def _keep(self, _module, args):
        self.inputs[self.sample] = args[0]


class _StandIn(torch.nn.Module):
    """In a layer's block's place: the block's output, its last linear over the sample's kept input."""

    def __init__(self, cache: BlockCache):
        super().__init__()
        self.cache = cache

    def forward(self, *_args, **_kwargs) -> torch.Tensor:
        return self.cache.last(self.cache.inputs[self.cache.sample])


def capture_hessians(layer: torch.nn.Module, names: tuple[str, ...], x: torch.Tensor, runner: Callable,
                     caches: tuple[BlockCache, ...] = ()) -> dict[str, HessianAccumulator]:
    """Input Hessians of the linears ``names`` (e.g. ``mlp.down_proj``) of ``layer`` over the inputs ``x``.

    Each sample runs only until every one of the linears has seen its input (a q/k/v pass stops before attention
    is computed), one sample per runner call, in order: the same sums as a full pass, for less than its work. When
    the first sample gives every one of the linears the very same tensor (q/k/v, gate/up, a GDN's in_proj_qkv/z
    read one normed input), they share one Hessian: later samples stop at the first of them, before its matmul, and
    one sum is accumulated instead of one per linear (the same sums). Each of the ``caches`` keeps its last linear's
    inputs in this pass or puts its block's stand-in in (``BlockCache``)."""
    capture = _Capture(layer, names)
    try:
        with ExitStack() as stack:
            for cache in caches:
                stack.enter_context(cache.around(names))
            for i in range(x.shape[0]):
                for cache in caches:
                    cache.sample = i
                capture.run(layer, x[i : i + 1], runner)
                if i == 0 and len(names) > 1:
                    capture.shared = all(capture.seen[n] is capture.seen[names[0]] for n in names)
    finally:
        capture.remove()
    return capture.result()


class _Capture:
    """``capture_hessians``' hooks on the linears ``names``: each adds its input to its accumulator (to the first
    one's alone once ``shared``) and stops the sample once every one has seen its input."""

    def __init__(self, layer: torch.nn.Module, names: tuple[str, ...]):
        self.names, self.seen, self.shared, self.accumulators, self.hooks = names, {}, False, {}, []
        for name in names:
            linear = layer.get_submodule(name)
            self.accumulators[name] = HessianAccumulator(linear.in_features, linear.weight.device)
            self.hooks.append(linear.register_forward_pre_hook(partial(self.add, name)))

    def add(self, name: str, _module, args) -> None:
        if self.shared:
            self.accumulators[self.names[0]].add(args[0])
            raise _Captured
        self.accumulators[name].add(args[0])
        self.seen[name] = args[0]
        if len(self.seen) == len(self.names):
            raise _Captured

    def run(self, layer: torch.nn.Module, sample: torch.Tensor, runner: Callable) -> None:
        self.seen.clear()
        try:
            runner(layer, sample)
        except _Captured:
            pass

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def result(self) -> dict[str, HessianAccumulator]:
        if self.shared:
            self.accumulators.update({name: self.accumulators[self.names[0]] for name in self.names[1:]})
        return self.accumulators


def layer_outputs(layer: torch.nn.Module, x: torch.Tensor, runner: Callable,
                  caches: tuple[BlockCache, ...] = ()) -> torch.Tensor:
    """``layer``'s outputs over the inputs ``x``; with filled ``caches``, sample by sample through their blocks'
    stand-ins (the same values as the full pass). The last pass: each sample's kept inputs are dropped once its
    outputs are computed (the outputs take their place in memory)."""
    filled = [cache for cache in caches if cache.filled]
    if not filled:
        return runner(layer, x)
    outputs = []
    with ExitStack() as stack:
        for cache in filled:
            stack.enter_context(cache.standing_in())
        for i in range(x.shape[0]):
            for cache in filled:
                cache.sample = i
            outputs.append(runner(layer, x[i : i + 1]))
            for cache in filled:
                cache.inputs[i] = None
    return torch.cat(outputs)


@dataclass
class SequentialResult:
    quantized: dict[str, QuantizedWeight]  # by transformers name, without ".weight"
    hidden: torch.Tensor  # [n, length, hidden]: the last decoder layer's outputs


@torch.no_grad()
def quantize_layer(layer: torch.nn.Module, index: int, groups: tuple[tuple[str, ...], ...], x: torch.Tensor,
                   runner: Callable, quantize_linears: QuantizeLinears, *,
                   blocks: tuple[tuple[str, str], ...] = (),
                   outputs: bool = False,
                   ) -> dict[str, QuantizedWeight] | tuple[dict[str, QuantizedWeight], torch.Tensor]:
    """Quantize decoder layer ``index``'s linears in place, group by group over its inputs ``x``: each group's
    Hessians are captured with the earlier groups already quantized (their dequantized weights put back).

    ``blocks``: the family's ``cached_blocks`` (each block's name and its last linear's), which lets the passes
    after a last linear's group skip its block (one ``BlockCache`` per block, within ``cache_budget``). Returns the
    quantized weights by transformers name; with ``outputs``, also the quantized layer's outputs over ``x``."""
    caches = BlockCache.for_layer(layer, groups, x, blocks, outputs)
    quantized = {}
    for names in groups:
        accumulators = capture_hessians(layer, names, x, runner, caches)
        shared = all(accumulators[n] is accumulators[names[0]] for n in names)
        for sharing in [list(names)] if shared else [[n] for n in names]:
            full_names = [f"model.layers.{index}.{name}" for name in sharing]
            linears = [layer.get_submodule(name) for name in sharing]
            results = quantize_linears(full_names, [linear.weight for linear in linears],
                                       accumulators[sharing[0]].hessian())
            for full_name, linear, qw in zip(full_names, linears, results, strict=True):
                if qw is not None:
                    linear.weight.copy_(qw.dequantize().to(linear.weight.dtype))
                    quantized[full_name] = qw
    if not outputs:
        return quantized
    return quantized, layer_outputs(layer, x, runner, caches)


