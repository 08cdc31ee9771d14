"""Parts: a target split into packages a device can load, chained by the host.

A 27B target is 54 GB in fp16 and about 14 GB at 4 bits; a device loads packages of about 1-2 GB
(anemll-forge, github.com/Anemll/anemll-forge, keeps parts under 2 GB). When the whole target is over the recipe's
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

In the ``ane`` layout (docs/layouts.md) the host looks the embedding rows up, so there is no embedding part: the first
layer chunk holds the table for the host's lookup (its package does not) and takes the rows as ``hidden_states``; a
head part returns its logits, and the host takes the argmax over the split head's parts; a head part has at most
65,536 rows (the ANE's largest dim: its logits have one per row; forge ships Qwen3.8's 248,320 in 8 parts).

Every part has the same functions (prefill / decode / verify, at the same widths) over one weight copy. A target
that fits the limit ships as one part, the whole core, exactly as before. ``Chain`` calls the parts' functions in
order as one target (``convert.runtime.host.Functions``), for the torch part modules and the Core AI runtime alike; the
identity hashes (lm_head, embeddings) are the whole tables'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from convert.errors import InputError
from convert.export.ane import ANE_DIM_LIMIT, even_ranges
from convert.export.functions import parameters_on_meta
from convert.export.names import KEY_CACHE, VALUE_CACHE
from convert.export.spec import FunctionSpec, size_text
from convert.models import family_of
from convert.models.part import ROW_ALIGN, Part
from convert.weights.quantize import kept_modules

MB = 10**6
GB = 10**9
# Host memory of a build, measured (docs/benchmarks.md, "A build larger than memory" and "Where a part's packaging
# memory goes"; sampled VmRSS): a process holds about BASE_BYTES before it loads a part (torch, coremltools and
# transformers); above that, packaging a part (each format in turn: converted from the codes and tables alone, the
# dense weights released, then checked one function's program at a time) takes up to
# PACKAGING_BYTES_PER_LAYER_WEIGHT bytes per weight of its decoder layers (4.3 measured on a 4-layer part at the 27B
# width, in Core ML's multifunction merge: every function's codes) and PACKAGING_BYTES_PER_TABLE_WEIGHT per weight of
# its embedding or head rows (6.0 measured on a whole 248320-row head, in the Core AI runtime's load and first call;
# Core ML's trace computes the one matrix from a placeholder: 5.2). A parted target's stages run in a process of
# their own (convert/processes.py) beside the build process, which holds its own base: PARTED_BASE_BYTES. A whole
# target built in memory holds about WHOLE_BYTES_PER_PARAMETER per parameter (the checkpoint, the fp16 modules, an
# fp32 copy, conversion).
BASE_BYTES = 1_200_000_000
PARTED_BASE_BYTES = 2 * BASE_BYTES
PACKAGING_BYTES_PER_LAYER_WEIGHT = 5
PACKAGING_BYTES_PER_TABLE_WEIGHT = 7
# the build's finish (the embedding and the lm_head loaded together for the identity hashes and the drafter interface,
# in the build process alone): 9.2 GiB measured for the two 248320 x 5120 tables, about 3.7 bytes a table weight
FINISH_BYTES_PER_TABLE_WEIGHT = 4
WHOLE_BYTES_PER_PARAMETER = 12
# GPTQ of one linear on the CPU holds, above its weight and its Hessian, about GPTQ_HESSIAN_COPIES more matrices of
# the Hessian's size and GPTQ_WEIGHT_COPIES fp32 copies of the weight (bench/gptq_memory.py at the 27B drafters' fc,
# [5120, 25600], and down_proj, [5120, 17408]: 8.98 and 5.03 GB measured, 1.89 Hessians and 7.7 weights fitted)
GPTQ_HESSIAN_COPIES = 2
GPTQ_WEIGHT_COPIES = 8


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
    host_lookup: bool = False  # the ane layout: the host looks the embedding rows up; no package holds the table

    def total(self, vocab: int, tied: bool) -> int:
        """Bytes of every package together (a tied table once: the embedding's, or the head's when the host looks
        the embedding up)."""
        embedding = 0 if self.host_lookup else self.embedding_row * vocab
        head = self.norm + (0 if tied and not self.host_lookup else self.head_row * vocab)
        return int(embedding + sum(self.layers) + self.layer_constants + head)


def piece_sizes(args, target) -> Sizes:
    """Bytes of each piece from a parameterless core and the recipe's quantization (nothing is read)."""
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
    align = row_align(quant)
    layers = tuple(weight_bytes(f"layers.{i}") for i in range(len(core.layers)))
    layer_weights = tuple(sum(p.numel() for p in layer.parameters()) for layer in core.layers)
    return Sizes(weight_bytes("embed_tokens") / vocab, layers, constants, weight_bytes("norm"),
                 weight_bytes("lm_head") / vocab, align, args.hidden_size, layer_weights, target.layout == "ane")


def held_target_bytes(args, target, lean: bool) -> int:
    """Host memory of a target as the drafter stage holds it with its fp32 compute copy (nothing is read).

    ``lean`` (a parted build: ``PartLoader.load(lean=True)``): each quantized matrix as its packed codes and tables
    (``matrix_bytes``) with a byte a group for its zero points (``CodesLinear`` keeps them unpacked), shared by the
    fp16 modules and the copy; a quantized embedding's anchor rows are computed when read (``AnchorRows``).
    Otherwise (a whole build) each quantized linear as a ``QuantizedLinear``: its fp16 weight, its codes unpacked (a
    byte each) and tables, shared by the copy, and a quantized embedding both in fp16 and again in fp32.
    Either way an unquantized linear's fp16 weight is shared by the copy (``compute_copy(share_weights=True)``) and
    every other parameter is held in fp16 and in fp32."""
    with parameters_on_meta():
        core = family_of(args).build_core(args, target)
    quant = target.quantization
    keep = kept_modules(core, quant) if quant.format else set()
    holders: dict[int, int] = {}
    for module in core.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    total, seen = 0, set()
    for name, module in core.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:  # a tied table, held once
                continue
            seen.add(id(p))
            linear = isinstance(module, nn.Linear) and holders[id(p)] == 1
            if p.dim() == 2 and quant.format and name not in keep:
                shipped = matrix_bytes(quant.format, quant.resolved_group_size, tuple(p.shape))
                groups = 0 if quant.format == "lut4" else p.shape[0] * (p.shape[1] // quant.resolved_group_size)
                tables = shipped - math.ceil(p.numel() * (2 if quant.format == "exact2" else 4) / 8) + groups
                if lean:
                    total += shipped + groups
                else:
                    total += (3 if linear else 8) * p.numel() + (1 if linear else 2) * tables
            else:
                total += (2 if linear else 6) * p.numel()
    return total


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


def parted_build_bytes(args, target, parts: list[Part], window_bytes: int) -> int:
    """Host memory of building a parted target, streamed: the largest of packaging its largest part, the streamed
    candidate (its largest piece in fp16 and fp32, a window's logits and log-probabilities; the states between passes
    and every window's logits and taps are on disk), the streamed reference after it (its fp32 lm_head, one window's
    fp32 logits (every window's go to disk as they are computed), every window's caches and taps, ``window_bytes``
    each, a decoder layer) and the metrics (a window's logits, the reference's and the candidate's, and their
    log-probabilities in fp64), each beside the build process, and the build's finish alone (the tables)."""
    sizes = piece_sizes(args, target)
    data = target.gate.data
    table, logits = args.vocab_size * sizes.row_weights, 4 * data.length * args.vocab_size
    largest_layer = max(sizes.layer_weights)
    # a decoder layer's fp32 weights and what its forward holds: 4.4 bytes a weight measured at the 27B width
    reference = 4 * table + logits + data.samples * window_bytes + 5 * largest_layer
    candidate = 2 * logits + 6 * max(table, largest_layer) + 16 * data.length * args.vocab_size
    finish = BASE_BYTES + FINISH_BYTES_PER_TABLE_WEIGHT * table * (1 if args.tie_word_embeddings else 2)
    return max(PARTED_BASE_BYTES + max(max(packaging_bytes(p, sizes) for p in parts), reference, candidate), finish)


def build_memory_bytes(args, target, parts: list[Part], specs: list[FunctionSpec]) -> int:
    """Estimate of a build's peak host memory: in memory for a whole target, streamed for a parted one."""
    states = specs[0].states
    if parts[0].is_whole:
        return whole_build_bytes(args.parameter_count) + 2 * sum(s.nbytes for s in states)
    return parted_build_bytes(args, target, parts, reference_window_bytes(args, target))


def reference_window_bytes(args, target) -> int:
    """One gate window's share of the streamed reference: its cache (transformers' in fp32, whatever the target's
    layout: the stateful layout's states, the KV caches only as long as the window and its continuation) and its
    tapped layers' outputs in fp32."""
    states = family_of(args).function_specs(args, target.model_copy(update={"layout": "stateful"}))[0].states
    length = target.gate.data.length
    grown = min(1.0, (length + target.gate.greedy_tokens) / target.context)
    cache = sum(2 * s.nbytes * (grown if s.name in (KEY_CACHE, VALUE_CACHE) else 1) for s in states)
    return int(cache + 4 * length * args.hidden_size * len(target.taps or []))


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


def row_align(quant) -> int:
    """The rows a vocabulary split of a table quantized by ``quant`` falls on multiples of: ``ROW_ALIGN``, and whole
    lut4 tables."""
    return math.lcm(ROW_ALIGN, quant.resolved_group_size if quant.format == "lut4" else 1)


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
    head_rows = ANE_DIM_LIMIT if sizes.host_lookup else vocab  # an ane head returns logits: a dim per row
    if sizes.total(vocab, args.tie_word_embeddings) <= limit and vocab <= head_rows and \
            whole_build_bytes(args.parameter_count) <= target.max_host_memory_gb * GB:
        return [Part.whole(args)]
    row_cost = PACKAGING_BYTES_PER_TABLE_WEIGHT * sizes.row_weights
    parts = [] if sizes.host_lookup else [Part(name, vocab, embedding=rows) for name, rows in _vocab_split(
        "embed", vocab, sizes.embedding_row, 0, limit, sizes.row_align, row_cost, room)]
    first = 0
    while first < layers:
        table = host_table_bytes(sizes, vocab) if first == 0 else 0  # held beside the first chunk (ane)
        end, free, memory = first, limit - sizes.layer_constants, room - table
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
        table = (0, vocab) if sizes.host_lookup and first == 0 else None  # the host's, held beside the first layers
        parts.append(Part(f"layers-{first}-{end - 1}", vocab, embedding=table, layers=(first, end)))
        first = end
    parts += [Part(name, vocab, head=rows) for name, rows in _vocab_split(
        "head", vocab, sizes.head_row, sizes.norm, limit, sizes.row_align, row_cost, room, head_rows)]
    return parts


def _layer_cost(sizes: Sizes, layer: int) -> int:
    return PACKAGING_BYTES_PER_LAYER_WEIGHT * sizes.layer_weights[layer]


def packaging_bytes(part: Part, sizes: Sizes) -> int:
    """Host memory packaging ``part`` takes above the base (the measured costs per weight; the host's embedding table,
    which the first ane part holds for its checks' lookups but does not convert, as its shipped bytes)."""
    converted = [held for held in (None if sizes.host_lookup else part.embedding, part.head) if held]
    rows = sum(held[1] - held[0] for held in converted)
    held = host_table_bytes(sizes, part.embedding[1] - part.embedding[0]) if part.embedding else 0
    return sum(_layer_cost(sizes, i) for i in part.layer_indices) + \
        PACKAGING_BYTES_PER_TABLE_WEIGHT * rows * sizes.row_weights + held


def host_table_bytes(sizes: Sizes, rows: int) -> int:
    """What ``rows`` of the host's embedding table (the ane layout) take in the part that holds them for the host's
    lookups: their shipped bytes (the lean load keeps a quantized table as its codes); none in the stateful layout."""
    return int(sizes.embedding_row * rows) if sizes.host_lookup else 0


def _vocab_split(name: str, vocab: int, row_bytes: float, fixed: int, limit: int, align: int, row_cost: int,
                 room: int, max_rows: int | None = None) -> list[tuple[str, tuple[int, int]]]:
    """Row ranges of a [vocab, hidden] table, each under ``limit`` with ``fixed`` bytes beside it, packaged within
    ``room`` (``row_cost`` a row) and of at most ``max_rows`` rows, in as few equal parts (multiples of ``align`` rows
    but the last) as it takes."""
    fits = min(int((limit - fixed) // row_bytes), room // row_cost, max_rows or vocab) // align * align
    if fits <= 0:
        raise InputError(f"target.max_part_mb / max_host_memory_gb: {limit / MB:g} MB and {size_text(room)} of "
                         f"packaging room cannot hold {align} rows of the {name} table "
                         f"({size_text(int(align * row_bytes))}); raise them")
    ranges = even_ranges(vocab, fits, align)
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
    if part.embedding and not sizes.host_lookup:
        total += sizes.embedding_row * (part.embedding[1] - part.embedding[0])
    if part.head:
        total += sizes.norm + sizes.head_row * (part.head[1] - part.head[0])
    return int(total)


def bound_lines(target, vocab: int, sizes: Sizes) -> list[str]:
    """Which limit sized the parts: how many layers a chunk (from the first layer) and how many parts a table (the
    head's split, ``_vocab_split``) the device limit (``max_part_mb``) alone would allow, and how many the host memory
    (``max_host_memory_gb``) alone; the plan takes the smaller of each."""
    limit, room = int(target.max_part_mb * MB), packaging_room(target)
    device = _leading(sizes.layers, limit - sizes.layer_constants)
    host = _leading([_layer_cost(sizes, i) for i in range(len(sizes.layers))], room)
    chunk = "device" if device <= host else "host memory"
    row_cost, unbounded = PACKAGING_BYTES_PER_TABLE_WEIGHT * sizes.row_weights, 1 << 62

    def table_parts(part_limit: int, part_room: int, max_rows: int | None = None) -> int:
        return len(_vocab_split("head", vocab, sizes.head_row, sizes.norm, part_limit, sizes.row_align, row_cost,
                                part_room, max_rows))

    # the device's bound: its part size and, for an ane head (logits: a dim a row), the ANE's largest dim
    rows = ANE_DIM_LIMIT if sizes.host_lookup else None
    table_device, table_host = table_parts(limit, unbounded, rows), table_parts(unbounded, room)
    table = "device" if table_device >= table_host else "host memory"
    capped = f", at most {rows:,} rows a head part" if rows else ""
    return [f"  layer chunks: {min(device, host)} layers from the first, set by the {chunk} bound (the device's "
            f"{target.max_part_mb:g} MB alone: {device}; host memory alone: {host}, packaging about "
            f"{PACKAGING_BYTES_PER_LAYER_WEIGHT} bytes a layer weight within {size_text(room)})",
            f"  tables: {_parts(max(table_device, table_host))} each, set by the {table} bound (device alone: "
            f"{table_device}{capped}; host memory alone: {table_host}, about {PACKAGING_BYTES_PER_TABLE_WEIGHT} "
            "bytes a table weight)"]


def _parts(count: int) -> str:
    return f"{count} part" + ("s" if count != 1 else "")


def _leading(costs, budget: int) -> int:
    """How many of ``costs``, from the first, fit ``budget`` together."""
    count = 0
    while count < len(costs) and costs[count] <= budget:
        budget -= costs[count]
        count += 1
    return count


def plan_lines(args, target, parts: list[Part]) -> list[str]:
    """The plan's lines on the parts: which bound sized them, then each part with what it holds and its planned
    size."""
    if len(parts) == 1:
        return []
    sizes = piece_sizes(args, target)
    lines = [f"  parts: {len(parts)} (target.max_part_mb {target.max_part_mb:g}, target.max_host_memory_gb "
             f"{target.max_host_memory_gb:g}), chained by the host in this order:",
             *bound_lines(target, args.vocab_size, sizes)]
    for part in parts:
        held = []
        if part.embedding and sizes.host_lookup:
            held.append("the host's embedding table (not packaged)")
        elif part.embedding:
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
