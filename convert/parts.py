"""Parts: a target split into packages a device can load, chained by the host.

A 27B target is 54 GB in fp16 and about 14 GB at 4 bits; a device loads packages of about 1-2 GB
(``../shared/reference/hybrid-27b.md``: forge keeps parts under 2 GB). When the whole target is over the recipe's
``target.max_part_mb``, it ships as parts, in this order:

- the embedding lookup (``embed``), split along the vocabulary when the table is over the limit: each part looks up
  the ids in its rows (zero rows for the others) and adds them to the rows the previous part passed on, so exactly
  one part contributes to each row and the sum is the table's row, exactly;
- chunks of consecutive decoder layers (``layers-A-B``), as many as fit: each takes the rows ``hidden_states`` and
  returns its last layer's as ``hidden_states_out``; it holds the states of its own layers (their rows of each state
  kind, counted from its first layer) and returns the taps of the tapped layers it owns (recipe order among them);
- the head (``head``): the final norm and the lm_head, split along the vocabulary when over the limit; each split
  part returns its rows' best id (``argmax_ids``, a vocabulary id) and logit (``max_logit``), and the host keeps the
  first part's id on ties, which is the whole head's argmax (the lowest id among equal maxima).

Every part has the same functions (prefill / decode / verify, at the same widths) over one weight copy. A target
that fits the limit ships as one part, the whole core, exactly as before. ``Chain`` calls the parts' functions in
order as one target (``convert.host.Functions``), for the torch part modules and the Core AI runtime alike; the
identity hashes (lm_head, embeddings) are the whole tables'.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from convert.backends.base import FunctionSpec, TensorSpec, size_text
from convert.errors import InputError
from convert.fp16 import like_the_runtime

MB = 10**6
GB = 10**9
# Host memory of a build, measured (docs/benchmarks.md, "A build larger than memory"; sampled VmRSS): a process
# holds about BASE_BYTES before it loads a part (torch, coremltools and transformers); above that, converting a part
# to Core ML and checking it take up to PACKAGING_BYTES_PER_LAYER_WEIGHT bytes per weight of its decoder layers
# (13.3 measured at the 27B width) and PACKAGING_BYTES_PER_TABLE_WEIGHT per weight of its embedding or head rows
# (a 424M-weight embedding part at the 27B width peaked at 14.0 GiB in a process of its own: 32.6 above the base;
# the fp16 and fp32 tracing copies, the MIL program's constants, the converter's passes). A parted target's stages
# run in a process of their own (convert/processes.py) beside the build process, which holds its own base:
# PARTED_BASE_BYTES. A whole target built in memory holds about WHOLE_BYTES_PER_PARAMETER per parameter (the
# checkpoint, the fp16 modules, an fp32 copy, conversion).
BASE_BYTES = 1_200_000_000
PARTED_BASE_BYTES = 2 * BASE_BYTES
PACKAGING_BYTES_PER_LAYER_WEIGHT = 14
PACKAGING_BYTES_PER_TABLE_WEIGHT = 33
# the build's finish (the embedding and the lm_head loaded together for the identity hashes and the drafter interface,
# in the build process alone): 9.2 GiB measured for the two 248320 x 5120 tables, about 3.7 bytes a table weight
FINISH_BYTES_PER_TABLE_WEIGHT = 4
WHOLE_BYTES_PER_PARAMETER = 12
HIDDEN_OUT = "hidden_states_out"  # a part's rows for the next part (Core ML refuses one name for an input and output)
ROW_ALIGN = 64  # vocabulary splits fall on multiples of this many rows (and of a lut4 table's rows)


@dataclass(frozen=True)
class Part:
    """One package of a target: the vocabulary rows of the embedding it looks up, the decoder layers ``first ..
    end-1`` it runs, the vocabulary rows of the head it computes (None / an empty range: not this part's)."""

    name: str
    vocab: int
    embedding: tuple[int, int] | None = None
    layers: tuple[int, int] = (0, 0)
    head: tuple[int, int] | None = None

    @classmethod
    def whole(cls, args) -> Part:
        v = args.vocab_size
        return cls("model", v, (0, v), (0, args.num_hidden_layers), (0, v))

    @property
    def layer_indices(self) -> range:
        return range(*self.layers)

    @property
    def takes_hidden(self) -> bool:
        """Whether the part reads the rows the previous part returns (every part but the first)."""
        return self.embedding is None or self.embedding[0] > 0

    @property
    def splits_head(self) -> bool:
        return self.head is not None and self.head != (0, self.vocab)

    @property
    def is_whole(self) -> bool:
        return self.embedding == (0, self.vocab) and self.head == (0, self.vocab) and not self.takes_hidden

    def own_taps(self, taps) -> tuple[int, ...]:
        """The tapped layers this part runs, in the recipe's order."""
        return tuple(t for t in taps or () if t in self.layer_indices)

    @classmethod
    def from_record(cls, record, vocab: int) -> Part:
        """The part a manifest's ``parts`` entry describes."""
        def rows(value):
            return tuple(value) if value is not None else None

        return cls(record.name, vocab, rows(record.embedding_rows), tuple(record.layers), rows(record.head_rows))

    def record(self, taps) -> dict:
        """The manifest's description of the part (besides its functions and packages)."""
        return {"name": self.name, "embedding_rows": list(self.embedding) if self.embedding else None,
                "layers": list(self.layers), "head_rows": list(self.head) if self.head else None,
                "taps": list(self.own_taps(taps))}


# ------------------------------------------------------------------------------------------------ the core's ends


def build_embedding(core: nn.Module, args) -> None:
    """The part's embedding rows as ``core.embed_tokens`` (none without an embedding)."""
    part = core.part
    if part.embedding is not None:
        core.embed_tokens = nn.Embedding(part.embedding[1] - part.embedding[0], args.hidden_size)


def build_head(core: nn.Module, args, norm: type[nn.Module]) -> None:
    """The part's final ``norm`` and lm_head rows (tied to the embedding when the config ties them and the part
    holds both whole)."""
    part = core.part
    if part.head is None:
        return
    core.norm = norm(args.hidden_size, args.rms_norm_eps)
    core.lm_head = nn.Linear(args.hidden_size, part.head[1] - part.head[0], bias=False)
    if args.tie_word_embeddings and part.embedding == part.head == (0, part.vocab):
        core.lm_head.weight = core.embed_tokens.weight


def part_input(core: nn.Module, input_ids, hidden_states) -> torch.Tensor:
    """The rows [S, H] a part's layers start from: its embedding rows of ``input_ids`` (zero for ids outside them)
    added to the previous part's ``hidden_states``, or those rows alone."""
    part = core.part
    if hidden_states is not None:  # in the core's dtype: a tracing copy computes in fp32 on the fp16 rows given
        hidden_states = hidden_states.to(next(core.parameters()).dtype)
    if part.embedding is None:
        return hidden_states[0]
    ids = input_ids[0].long()
    lo, hi = part.embedding
    if (lo, hi) == (0, part.vocab):
        x = core.embed_tokens(ids)
    else:
        rows = core.embed_tokens((ids - lo).clamp(0, hi - lo - 1))
        x = torch.where(((ids >= lo) & (ids < hi))[:, None], rows, torch.zeros_like(rows))
    return x if hidden_states is None else hidden_states[0] + x


def part_outputs(core: nn.Module, x: torch.Tensor, tapped: list) -> dict[str, torch.Tensor]:
    """Every output a part's function may expose, from its last layer's rows ``x`` [S, H] and the ``tapped``
    (index among the part's taps, layer output) pairs: with the head, argmax ids (and the best logit when the head is
    split), logits and the final-norm hidden states; without it the rows for the next part; and the taps."""
    out = {}
    if tapped:
        out["taps"] = torch.cat([t for _, t in sorted(tapped, key=lambda p: p[0])], dim=-1)[None]
    part = core.part
    if part.head is None:
        out[HIDDEN_OUT] = x[None]
        return out
    hidden = core.norm(x)[None]
    logits = core.lm_head(hidden)
    ids = logits.argmax(-1)
    if part.splits_head:
        out["max_logit"] = logits.amax(-1)
        ids = ids + part.head[0]
    out.update(argmax_ids=ids.to(torch.int32), logits=logits, hidden=hidden)
    return out


def part_tensors(args, target, part: Part, width: int, dtype: str) -> tuple[tuple[TensorSpec, ...], tuple]:
    """The inputs and outputs every family's function of ``part`` has at ``width`` (the family adds its own inputs,
    e.g. a hybrid's ``accept`` / ``valid``). The whole target's: ``input_ids``, ``position_ids`` in; ``argmax_ids``
    [1,S] int32 (the host reads the row of its last real token, so a prompt's final chunk may be right-padded), then
    ``taps``, ``hidden`` and ``logits`` when the recipe asks for them."""
    h = args.hidden_size
    inputs = []
    if part.embedding is not None:
        inputs.append(TensorSpec("input_ids", (1, width), "int32"))
    if part.takes_hidden:
        inputs.append(TensorSpec("hidden_states", (1, width, h), dtype))
    if part.layer_indices:
        inputs.append(TensorSpec("position_ids", (1, width), "int32"))
    outputs = []
    if part.head is not None:
        outputs.append(TensorSpec("argmax_ids", (1, width), "int32"))
        if part.splits_head:
            outputs.append(TensorSpec("max_logit", (1, width), dtype))
    else:
        outputs.append(TensorSpec(HIDDEN_OUT, (1, width, h), dtype))
    taps = part.own_taps(target.taps)
    if taps:
        outputs.append(TensorSpec("taps", (1, width, len(taps) * h), dtype))
    if part.head is not None and target.hidden and part.head[0] == 0:
        outputs.append(TensorSpec("hidden", (1, width, h), dtype))
    if part.head is not None and target.logits:
        outputs.append(TensorSpec("logits", (1, width, part.head[1] - part.head[0]), dtype))
    return tuple(inputs), tuple(outputs)


# ------------------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class Sizes:
    """Shipped bytes of the pieces of a target (weights as the recipe quantizes them, constants as stored)."""

    embedding_row: float
    layers: tuple[int, ...]
    layer_constants: int  # RoPE tables and masks a part with layers holds
    norm: int
    head_row: float
    row_align: int
    row_weights: int  # weights of one vocabulary row of the embedding or the head (the hidden size)
    layer_weights: tuple[int, ...]

    def total(self, vocab: int, tied: bool) -> int:
        head = self.norm + (0 if tied else self.head_row * vocab)
        return int(self.embedding_row * vocab + sum(self.layers) + self.layer_constants + head)


def piece_sizes(args, target) -> Sizes:
    """Bytes of each piece from a parameterless core and the recipe's quantization (nothing is read)."""
    from convert.models import family_of
    from convert.quantize import kept_modules
    from convert.stream import parameters_on_meta

    with parameters_on_meta():
        core = family_of(args).build_core(args, target)
    quant = target.quantization
    keep = kept_modules(core, quant) if quant.format else set()

    def weight_bytes(prefix: str) -> int:
        total = 0
        for name, module in core.get_submodule(prefix).named_modules(prefix=prefix):
            for p in module.parameters(recurse=False):
                quantized = p.dim() == 2 and quant.format and name not in keep
                total += matrix_bytes(quant.format, quant.resolved_group_size, tuple(p.shape)) if quantized \
                    else 2 * p.numel()
        return total

    vocab = args.vocab_size
    constants = sum(b.numel() * (2 if b.is_floating_point() else b.element_size()) for b in core.buffers())
    align = math.lcm(ROW_ALIGN, quant.resolved_group_size if quant.format == "lut4" else 1)
    layers = tuple(weight_bytes(f"layers.{i}") for i in range(len(core.layers)))
    layer_weights = tuple(sum(p.numel() for p in layer.parameters()) for layer in core.layers)
    return Sizes(weight_bytes("embed_tokens") / vocab, layers, constants, weight_bytes("norm"),
                 weight_bytes("lm_head") / vocab, align, args.hidden_size, layer_weights)


def matrix_bytes(method: str | None, group: int, shape: tuple[int, int]) -> int:
    """A 2-D weight's bytes in a package: 4-bit (exact2: 2-bit) codes and zero points, fp16 tables and scales; fp16
    unquantized."""
    rows, columns = shape
    if method == "lut4":
        return math.ceil(rows * columns / 2) + math.ceil(rows / group) * 16 * 2
    if method == "affine4":
        groups = rows * (columns // group)
        return math.ceil(rows * columns / 2) + 2 * groups + math.ceil(groups / 2)
    if method == "exact2":  # 2-bit codes and an fp16 scale a group; the zero point 1 is one inline constant
        return math.ceil(rows * columns / 4) + 2 * rows * (columns // group)
    return 2 * rows * columns


def parted_build_bytes(args, target, parts: list[Part], window_cache_bytes: int) -> int:
    """Host memory of building a parted target, streamed: the largest of packaging its largest part, the streamed
    reference (its fp32 lm_head, one window's fp32 logits (every window's go to disk as they are computed), every
    window's caches, ``window_cache_bytes`` each, a decoder layer) and the streamed candidate (a window's logits, the
    reference's and its own, its largest piece in fp16 and fp32, one window's log-probabilities in fp64; the states
    between passes are on disk), each beside the build process, and the build's finish alone (the tables)."""
    sizes = piece_sizes(args, target)
    data = target.gate.data
    table, logits = args.vocab_size * sizes.row_weights, 4 * data.length * args.vocab_size
    largest_layer = max(sizes.layer_weights)
    # a decoder layer's fp32 weights and what its forward holds: 4.4 bytes a weight measured at the 27B width
    reference = 4 * table + logits + data.samples * window_cache_bytes + 5 * largest_layer
    candidate = 2 * logits + 6 * max(table, largest_layer) + 16 * data.length * args.vocab_size
    finish = BASE_BYTES + FINISH_BYTES_PER_TABLE_WEIGHT * table * (1 if args.tie_word_embeddings else 2)
    return max(PARTED_BASE_BYTES + max(max(packaging_bytes(p, sizes) for p in parts), reference, candidate), finish)


def build_memory_bytes(args, target, parts: list[Part], specs: list[FunctionSpec]) -> int:
    """Estimate of a build's peak host memory: in memory for a whole target, streamed for a parted one."""
    states = specs[0].states
    if parts[0].is_whole:
        return whole_build_bytes(args.parameter_count) + 2 * sum(s.nbytes for s in states)
    return parted_build_bytes(args, target, parts, window_cache_bytes(target, states))


def window_cache_bytes(target, states) -> int:
    """One gate window's reference cache: every state in fp32, the KV caches only as long as the window."""
    grown = min(1.0, (target.gate.data.length + target.gate.greedy_tokens) / target.context)
    return int(sum(2 * s.nbytes * (grown if s.name in ("key_cache", "value_cache") else 1) for s in states))


def memory_line(target, peak: int) -> str:
    return (f"  estimated peak host memory: {peak / GB:.1f} GB (target.max_host_memory_gb "
            f"{target.max_host_memory_gb:g})")


def packaging_room(target) -> int:
    """The bytes packaging a part may take above the bases (the build process's and the part's) for the build to stay
    within ``target.max_host_memory_gb``."""
    return int(target.max_host_memory_gb * GB - PARTED_BASE_BYTES)


def whole_build_bytes(parameters: int) -> int:
    """Host memory of building a target whole, in memory (the path of a target that is one part)."""
    return BASE_BYTES + WHOLE_BYTES_PER_PARAMETER * parameters


def plan_parts(args, target) -> list[Part]:
    """The parts of a target: the whole core when it fits ``target.max_part_mb`` and its build in memory fits
    ``target.max_host_memory_gb``; else the embedding, chunks of consecutive layers and the head, the tables split
    along the vocabulary, so that no part is over ``max_part_mb`` and packaging none takes more than
    ``packaging_room``."""
    limit, room = int(target.max_part_mb * MB), packaging_room(target)
    if room <= 0:
        raise InputError(f"target.max_host_memory_gb: {target.max_host_memory_gb:g} GB is below the "
                         f"{PARTED_BASE_BYTES / GB:g} GB a parted build takes before it loads any weight; raise it")
    sizes = piece_sizes(args, target)
    vocab, layers = args.vocab_size, len(sizes.layers)
    if sizes.total(vocab, args.tie_word_embeddings) <= limit and \
            whole_build_bytes(args.parameter_count) <= target.max_host_memory_gb * GB:
        return [Part.whole(args)]
    row_cost = PACKAGING_BYTES_PER_TABLE_WEIGHT * sizes.row_weights
    parts = [Part(name, vocab, embedding=rows) for name, rows in _vocab_split(
        "embed", vocab, sizes.embedding_row, 0, limit, sizes.row_align, row_cost, room)]
    first = 0
    while first < layers:
        end, free, memory = first, limit - sizes.layer_constants, room
        while end < layers and sizes.layers[end] <= free and _layer_cost(sizes, end) <= memory:
            free -= sizes.layers[end]
            memory -= _layer_cost(sizes, end)
            end += 1
        if end == first:
            if _layer_cost(sizes, first) > room:
                raise InputError(f"target.max_host_memory_gb: {target.max_host_memory_gb:g} GB cannot package "
                                 f"decoder layer {first} (about {size_text(_layer_cost(sizes, first))} above the "
                                 f"{PARTED_BASE_BYTES / GB:g} GB base); raise it")
            raise InputError(f"target.max_part_mb: {target.max_part_mb:g} MB is below decoder layer {first}'s "
                             f"{size_text(sizes.layers[first] + sizes.layer_constants)}; raise it (a part holds "
                             "whole layers)")
        parts.append(Part(f"layers-{first}-{end - 1}", vocab, layers=(first, end)))
        first = end
    parts += [Part(name, vocab, head=rows) for name, rows in _vocab_split(
        "head", vocab, sizes.head_row, sizes.norm, limit, sizes.row_align, row_cost, room)]
    return parts


def _layer_cost(sizes: Sizes, layer: int) -> int:
    return PACKAGING_BYTES_PER_LAYER_WEIGHT * sizes.layer_weights[layer]


def packaging_bytes(part: Part, sizes: Sizes) -> int:
    """Host memory packaging ``part`` takes above the base (the measured costs per weight)."""
    rows = sum(held[1] - held[0] for held in (part.embedding, part.head) if held)
    return sum(_layer_cost(sizes, i) for i in part.layer_indices) + \
        PACKAGING_BYTES_PER_TABLE_WEIGHT * rows * sizes.row_weights


def _vocab_split(name: str, vocab: int, row_bytes: float, fixed: int, limit: int, align: int, row_cost: int,
                 room: int) -> list[tuple[str, tuple[int, int]]]:
    """Row ranges of a [vocab, hidden] table, each under ``limit`` with ``fixed`` bytes beside it and packaged within
    ``room`` (``row_cost`` a row), in as few equal parts (multiples of ``align`` rows but the last) as it takes."""
    fits = min(int((limit - fixed) // row_bytes), room // row_cost) // align * align
    if fits <= 0:
        raise InputError(f"target.max_part_mb / max_host_memory_gb: {limit / MB:g} MB and {size_text(room)} of "
                         f"packaging room cannot hold {align} rows of the {name} table "
                         f"({size_text(int(align * row_bytes))}); raise them")
    count = math.ceil(vocab / fits)
    step = math.ceil(vocab / count / align) * align
    ranges = [(lo, min(lo + step, vocab)) for lo in range(0, vocab, step)]
    if len(ranges) == 1:
        return [(name, ranges[0])]
    return [(f"{name}-{k + 1}of{len(ranges)}", r) for k, r in enumerate(ranges)]


def shipped_line(args, target) -> str:
    """The plan's line on the weights as the recipe ships them (every part together), against fp16."""
    total = piece_sizes(args, target).total(args.vocab_size, args.tie_word_embeddings)
    return (f"  shipped weights: {size_text(total)} per format ({8 * total / args.parameter_count:.2f} bits a "
            f"parameter; {size_text(2 * args.parameter_count)} in fp16)")


def part_bytes(part: Part, sizes: Sizes) -> int:
    """The planned bytes of ``part``."""
    total = sum(sizes.layers[i] for i in part.layer_indices) + (sizes.layer_constants if part.layer_indices else 0)
    if part.embedding:
        total += sizes.embedding_row * (part.embedding[1] - part.embedding[0])
    if part.head:
        total += sizes.norm + sizes.head_row * (part.head[1] - part.head[0])
    return int(total)


def plan_lines(args, target, parts: list[Part]) -> list[str]:
    """The plan's lines on the parts: each with what it holds and its planned size."""
    if len(parts) == 1:
        return []
    sizes = piece_sizes(args, target)
    lines = [f"  parts: {len(parts)} (target.max_part_mb {target.max_part_mb:g}, target.max_host_memory_gb "
             f"{target.max_host_memory_gb:g}), chained by the host in this order:"]
    for part in parts:
        held = []
        if part.embedding:
            held.append(f"embedding rows {part.embedding[0]}..{part.embedding[1] - 1}")
        if part.layer_indices:
            held.append(f"layers {part.layers[0]}..{part.layers[1] - 1}")
        if part.own_taps(target.taps):
            held.append(f"taps {list(part.own_taps(target.taps))}")
        if part.head:
            held.append(f"norm + lm_head rows {part.head[0]}..{part.head[1] - 1}")
        lines.append(f"    {part.name}: {', '.join(held)}: {size_text(part_bytes(part, sizes))} (packaging about "
                     f"{(PARTED_BASE_BYTES + packaging_bytes(part, sizes)) / GB:.1f} GB)")
    return lines


# ------------------------------------------------------------------------------------------------ part modules


def part_modules(modules, target, parts: list[Part]) -> list:
    """The export modules (``TargetModules``) of each part, computing with the whole ``modules``' tensors (shared,
    not copied; a table split along the vocabulary is a view of its rows, a quantized one's codes and tables sliced):
    the same weights, the part's own states."""
    from convert.models import family_of
    from convert.stream import parameters_on_meta
    from convert.target import modules_over

    core = modules.core
    args = core.args
    dtype = next(p for p in core.parameters() if p.is_floating_point()).dtype
    family = family_of(args)
    built = []
    for part in parts:
        if part.is_whole:
            built.append(modules)
            continue
        with parameters_on_meta():
            piece = family.build_core(args, target, part)
        piece = piece.to(dtype).eval()
        _share_part(piece, core, part)
        built.append(modules_over(piece, args, target, dtype, part))
    return built


def _share_part(piece: nn.Module, core: nn.Module, part: Part) -> None:
    for j, i in enumerate(part.layer_indices):
        _share(piece.layers[j], core.layers[i])
    if part.embedding is not None:
        piece.embed_tokens = _rows(core.embed_tokens, *part.embedding)
    if part.head is not None:
        piece.norm = core.norm
        piece.lm_head = _rows(core.lm_head, *part.head)


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


def _rows(module: nn.Module, lo: int, hi: int) -> nn.Module:
    """Rows ``lo .. hi-1`` of an embedding table or an lm_head (the module itself when that is all of it)."""
    from convert.compress import QuantizedEmbedding, QuantizedLinear

    if (lo, hi) == (0, module.weight.shape[0]):
        return module
    if isinstance(module, QuantizedLinear):
        kind = QuantizedEmbedding if isinstance(module, QuantizedEmbedding) else QuantizedLinear
        return kind(f"{module.name}[{lo}:{hi}]", module.quantized_weight().rows(lo, hi))
    rows = nn.Parameter(module.weight[lo:hi], requires_grad=False)
    if isinstance(module, nn.Embedding):
        return nn.Embedding.from_pretrained(rows, freeze=True)
    linear = nn.Linear(module.in_features, hi - lo, bias=False, device="meta")
    linear.weight = rows
    return linear


# ------------------------------------------------------------------------------------------------ the chain


class Chain:
    """The parts' functions called in order as one target: ``convert.host.Functions`` over one ``Functions`` per
    part (torch part modules or Core AI sessions), each given the inputs its spec names and the previous part's
    ``hidden_states``; returns what the whole target returns (taps in the recipe's order, the head's argmax over
    every split, logits concatenated where the parts return them)."""

    def __init__(self, links: list[tuple[Part, dict[str, FunctionSpec], object]], taps):
        self.links, self.taps = links, tuple(taps or ())

    def reset(self) -> None:
        for _, _, functions in self.links:
            functions.reset()

    def states(self) -> dict[str, np.ndarray]:
        """Every part's states, named ``part/state``."""
        return {f"{part.name}/{k}": v for part, _, functions in self.links for k, v in functions.states().items()}

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, tapped, out = None, {}, {}
        best = logits = None
        for part, specs, functions in self.links:
            got = functions.call(function, link_inputs(specs[function], inputs, rows))
            own = part.own_taps(self.taps)
            if own:
                for layer, value in zip(own, np.split(np.asarray(got["taps"]), len(own), axis=-1), strict=True):
                    tapped[layer] = value
            if HIDDEN_OUT in got:
                rows = got[HIDDEN_OUT]
            if part.head is None:
                continue
            ids = np.asarray(got["argmax_ids"])
            top = np.asarray(got["max_logit"]) if part.splits_head else None
            if best is None:
                out["argmax_ids"], best = ids, top
            else:  # a later part wins only with a strictly larger logit: ties keep the lower id, as argmax does
                better = top > best
                out["argmax_ids"], best = np.where(better, ids, out["argmax_ids"]), np.where(better, top, best)
            if "hidden" in got and "hidden" not in out:
                out["hidden"] = got["hidden"]
            if "logits" in got:
                logits = [*(logits or []), np.asarray(got["logits"])]
        if tapped:
            out["taps"] = np.concatenate([tapped[t] for t in self.taps], axis=-1)
        if logits:
            out["logits"] = np.concatenate(logits, axis=-1)
        return out


def link_inputs(spec: FunctionSpec, inputs: dict[str, np.ndarray], rows: np.ndarray | None) -> dict[str, np.ndarray]:
    """What one part's function takes of a whole target's call ``inputs`` and the previous part's ``rows``."""
    given = {**inputs, "hidden_states": rows}
    return {t.name: np.asarray(given[t.name], dtype=t.dtype) for t in spec.inputs}


class Recorder:
    """``Functions`` that records every call (function, inputs, all outputs) and reset, for a part's check to
    replay on its package (``checks.replay_coreai``)."""

    def __init__(self, functions):
        self.functions, self.calls = functions, []

    def reset(self) -> None:
        self.functions.reset()
        self.calls.append(("reset", {}, {}))

    def states(self) -> dict[str, np.ndarray]:
        return self.functions.states()

    def call(self, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.functions.call(function, inputs)
        self.calls.append((function, dict(inputs), out))
        return out


def module_chain(parts: list[Part], pieces: list, taps, wrap=None) -> Chain:
    """A ``Chain`` over the parts' torch modules (each ``ModuleFunctions``, wrapped by ``wrap`` when given)."""
    from convert.host import ModuleFunctions

    functions = [ModuleFunctions(m) if wrap is None else wrap(ModuleFunctions(m)) for m in pieces]
    specs = [{name: spec for name, (_, spec) in m.functions.items()} for m in pieces]
    return Chain(list(zip(parts, specs, functions, strict=True)), taps)


def recorded_calls(parts: list[Part], pieces: list, taps, contract: dict, vocab: int, short: bool) -> list[list]:
    """Each part's calls in the check's session (``checks.check_calls``) run through the chained torch parts: what
    each part's package check replays on its own, computed as this CPU's runtime computes
    (``fp16.like_the_runtime``)."""
    from convert.checks import check_calls
    from convert.host import TargetDriver

    chain = module_chain(parts, pieces, taps, Recorder)
    widths = {name: spec.width for name, (_, spec) in pieces[0].functions.items()}
    driver = TargetDriver(chain, widths, contract)
    driver.reset()
    with like_the_runtime():
        check_calls(lambda f, tokens, p0: [int(t) for t in driver.run(f, tokens, p0)["argmax_ids"]], widths,
                    contract, vocab, short=short)
    return [recorder.calls for _, _, recorder in chain.links]


def part_calls(piece, schedule: list[tuple[str, dict]], rows: list) -> tuple[list, list]:
    """One part's calls of a fixed ``schedule`` ((function, whole-target inputs): ``checks.short_schedule`` through
    the host contract) on its torch modules from a fresh session, each given the previous part's ``rows`` for that
    call: ``recorded_calls`` of that schedule, one part in memory at a time. Returns the recorded calls and the rows
    for the next part (computed as in ``recorded_calls``)."""
    from convert.host import ModuleFunctions

    recorder = Recorder(ModuleFunctions(piece))
    recorder.reset()
    returned = []
    for (function, inputs), given in zip(schedule, rows, strict=True):
        with like_the_runtime():
            out = recorder.call(function, link_inputs(piece.functions[function][1], inputs, given))
        returned.append(out.get(HIDDEN_OUT, given))  # a head part passes on the rows it was given, as ``Chain`` does
    return recorder.calls, returned


def manifest_parts(manifest) -> list[Part]:
    """The parts of a target bundle's manifest, in order (the whole target when it has none)."""
    vocab = manifest.architecture.vocab_size
    return [Part.from_record(r, vocab) for r in manifest.parts] if manifest.parts else []


@contextmanager
def coreai_target(folder: Path, manifest) -> Iterator[object]:
    """A target bundle's Core AI packages as one ``convert.host.Functions``: its session, or its parts' sessions
    chained in the manifest's order."""
    from convert import backends

    packages = {p.part: p for p in manifest.packages if p.format == "coreai"}
    if not packages:
        raise InputError(f"{folder}: no .aimodel package (built without the coreai backend); use --runtime torch")
    parts = manifest_parts(manifest)
    if not parts:
        with backends.load("coreai").open_session(folder / packages[None].path) as session:
            yield session
        return
    with coreai_chain(parts, [folder / packages[p.name].path for p in parts],
                      manifest.taps.layers if manifest.taps else ()) as chain:
        yield chain


@contextmanager
def coreai_chain(parts: list[Part], paths: list[Path], taps) -> Iterator[Chain]:
    """A ``Chain`` over a Core AI session of each part's ``.aimodel`` (``paths``, in the parts' order)."""
    from convert import backends

    coreai = backends.load("coreai")
    with ExitStack() as stack:
        sessions = [stack.enter_context(coreai.open_session(path)) for path in paths]
        yield Chain([(p, s.specs(), s) for p, s in zip(parts, sessions, strict=True)], taps)
