"""Quantized linears in the export modules, and their weights as the packages store them.

``apply_quantized`` swaps named ``nn.Linear`` modules of an export core for ``QuantizedLinear``s, each
carrying one ``QuantizedWeight`` (4-bit or 2-bit codes and per-group tables, see ``quant/types.py``). One module
serves every consumer, so every function of every package is built from the same tensors:

- torch (eager, and ``torch.jit.trace`` for Core ML): ``F.linear`` with the fp16 weight
  ``QuantizedWeight.dequantize()`` returns, held as the ``weight`` parameter.
- ``torch.export`` (only the Core AI backend exports): the weight is computed from codes and tables by
  coreai-torch's ``PalettizeModule`` (``coreai::lut_to_dense``, lut [O/G, 1, 16, 1]) or
  ``WeightDequantizeModule`` (``coreai::constexpr_blockwise_shift_scale``, scale and uint4 zero point
  [O, I/G]), held as the ``packed`` child. coreai-torch stores the codes (and zero points) as packed ui4
  and the tables as they are; the dense ``weight`` is unused there and left out of the asset.
- Core ML: ``add_coreml_compression`` marks each quantized weight as compressed (coremltools'
  ``_COREML_/weight/compression_type`` buffer) on the backend's tracing copy, where the weight itself is a
  placeholder; during ``ct.convert`` the backend builds each marked weight's ``constexpr_lut_to_dense`` /
  ``constexpr_blockwise_shift_scale`` from our codes and tables (``convert/backends/coreml.py``,
  ``_weights_from_codes``): the same ops coremltools makes when it derives the codes from a dense weight
  (measured: the packages are byte for byte those of the derivation), without a dense copy of any weight and
  with any codes, a lut4 code at a later equal table entry included.

exact2 (2-bit codes, an fp16 scale and a zero point per group of columns) takes the cheapest exact form of each:

- Core AI: ``WeightDequantizeModule`` with ``input_dtype=torch.uint2``: coreai-torch stores the codes and zero
  points as packed ui2 (``_compression/utils.py``, ``_inject_subbyte_in_quant``: ``QUANTIZATION_SUPPORT_NBITS``
  is (2, 4, 8)), a uniform zero point as one inline splat: measured 2.13 bits a weight at groups of 128
  (a per-group table through ``PalettizeModule``, lut [O, I/G, 4, 1], would take 2.50).
- Core ML (coremltools 9, iOS18): ``constexpr_blockwise_shift_scale`` takes no 2-bit data (its ``SrcT`` is
  int4, uint4, int8, uint8, fp16, fp32: ``mil/ops/defs/iOS18/compression.py``), and a 2-bit quantization
  is stored as uint4 (``frontend/_utils.py``, ``_construct_constexpr_dequant_op``). The frontend's weight is
  a palettization with one 4-entry fp16 table per group (``exact2_tables``, lut [O, I/G, 4, 1]: each entry is
  bit for bit the weight of its code), 2.5 bits a weight; a palettization scale cannot help, being divided into
  the weight per channel only (``frontend/torch/converter.py``, ``_construct_palettization_op``). The backend's
  conversion pass (``convert/backends/coreml.py``) then turns each such table back into its scale and zero point
  (``exact2_parameters``, checked bit for bit) and ships ``constexpr_lut_to_dense`` of the uint2 codes through
  one int8 table ``[0, 1, 2, 3] - z`` into ``constexpr_blockwise_shift_scale`` with the fp16 scales (and int8
  zero points as its offset where they are not all ``z``): coremltools' own joint palettization + quantization
  form (``_construct_quantization_op``), measured 2.13 bits a weight at groups of 128.

The packages are read back by ``convert/backends/stored.py``.
"""

from __future__ import annotations

import copy
import functools
import math
import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from convert.errors import PackageError
from convert.export.hadamard import SignedHadamard
from convert.export.lockstep import blocked_linear
from quant.types import QuantizedWeight

BITS = 4
ENTRIES = 2**BITS
COREML_PREFIX = "_COREML_"
_COREML_PALETTIZATION, _COREML_QUANTIZATION = 2, 3  # coremltools' CompressionType values
EXACT2_ENTRIES = 4  # an exact2 group's codes 0..3
# each method's tables, by their QuantizedWeight fields
TABLES = {"lut4": ("lut",), "affine4": ("scale", "zero_point"), "exact2": ("scale", "zero_point")}
_CODE_BITS = {"lut4": BITS, "affine4": BITS, "exact2": 2}  # codes and zero points, as both formats store them


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight ships as a ``QuantizedWeight`` (see the module docstring for its forms).

    ``weight`` (fp16 parameter, no grad) is the dequantized weight (a placeholder once released:
    ``release_dense_weights``); ``packed`` holds the codes and tables;
    ``bias`` is the replaced linear's own. The input is computed on in its own dtype (the fp16 weight is
    cast to it, exactly).
    """

    def __init__(self, name: str, quantized: QuantizedWeight, bias: nn.Parameter | None = None):
        super().__init__()
        _validate(name, quantized)
        self.name = name
        self.method, self.group_size = quantized.method, quantized.group_size
        self.weight = nn.Parameter(quantized.dequantize(), requires_grad=False)
        self.released = False  # release_dense_weights: the weight is a placeholder, computed from ``packed``
        self.bias = bias
        self.packed = _packed_module(quantized)
        self.rotation = _rotation_module(quantized, inverse=isinstance(self, QuantizedEmbedding))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            x = self.rotation(x)
        return nn.functional.linear(x, self.shipped_weight().to(x.dtype), self.bias)

    def shipped_weight(self) -> torch.Tensor:
        """The fp16 weight [O, I] as the call computes it: from the packed codes where they ship (``torch.export`` is
        the Core AI path; Core ML traces with ``torch.jit.trace``) or once released, else the dense weight."""
        return self.packed() if torch.compiler.is_exporting() or self.released else self.weight

    def quantized_weight(self) -> QuantizedWeight:
        """The ``QuantizedWeight`` this layer ships (its codes and tables, not copies)."""
        p = self.packed
        if self.method == "lut4":
            return QuantizedWeight("lut4", p.indices, self.group_size, lut=p.lut.reshape(-1, ENTRIES))
        return QuantizedWeight(self.method, p.quantized_data, self.group_size, scale=p.scale, zero_point=p.zero_point,
                               rotation=self.rotation.rotation() if self.rotation is not None else None)

    def shipped_nbytes(self) -> int:
        """Bytes this layer takes in a package: codes and zero points at 4 bits (exact2: 2), tables, a rotation's
        constants and bias as they are."""
        bits = _CODE_BITS[self.method]
        rotation = [] if self.rotation is None else list(self.rotation.buffers())
        tensors = [*self.packed.buffers(), *rotation, *([] if self.bias is None else [self.bias])]
        return sum(t.nbytes if t.is_floating_point() else math.ceil(t.numel() * bits / 8) for t in tensors)

class QuantizedEmbedding(QuantizedLinear):
    """An ``nn.Embedding`` whose table ships as a ``QuantizedWeight``: the same storage as ``QuantizedLinear``
    (the table is a [vocab, hidden] weight), read with a gather instead of a matmul."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(ids, self.shipped_weight())
        return rows if self.rotation is None else rotated_rows(self.rotation, rows)


def rotated_rows(rotation: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Looked-up rows of a rotated (exact2) table turned back (``s * H(row)``) in fp32 and rounded to the rows' dtype
    once, as mlx-vlm's lookup computes them (``convert/inputs/prism.py``): an fp32 island of the fp16 graph (Core AI
    keeps it; Core ML's fp16 program computes it in fp16), so the rows equal ``embedding_rows``' bit for bit and not
    the butterflies' fp16 roundings at every stage."""
    return rotation(rows.float()).to(rows.dtype)


class _SharedTensors(nn.Module):
    """A module whose ``SHARED`` buffers (the weight as shipped) every ``copy.deepcopy`` shares and ``.to(dtype)``
    leaves as they are: a compute copy in another dtype holds no second copy of them."""

    SHARED: tuple[str, ...] = ()

    def __deepcopy__(self, memo):
        for name in self.SHARED:
            if self._buffers.get(name) is not None:
                memo[id(self._buffers[name])] = self._buffers[name]  # shared by every copy: they never change
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__ = copy.deepcopy(self.__dict__, memo)
        return clone

    def _apply(self, fn, recurse=True):
        shared = {name: self._buffers.pop(name) for name in self.SHARED}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers.update({name: _moved(fn, t) for name, t in shared.items()})
        return self


def _moved(fn, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A shared tensor where ``fn`` (a ``Module._apply`` function) puts tensors, in its own dtype: a move to another
    torch device moves it (``HeldTarget`` holds a target's codes on the accelerator), a cast leaves it as it is
    (an integer probe on its device tells the two apart)."""
    if tensor is None:
        return None
    where = fn(torch.empty(0, dtype=torch.uint8, device=tensor.device)).device
    return tensor if where == tensor.device else tensor.to(where)


class CodesLinear(_SharedTensors):
    """A quantized linear (or embedding table) held only as it ships: its codes packed to their bits (exact2: four a
    byte; lut4 and affine4: two), the group tables, the rotation and the bias. Each call computes the fp16 weight
    (``QuantizedWeight.dequantize``, bit for bit the weight a ``QuantizedLinear`` holds) a block of rows at a time
    (``dense_rows``, ``row_blocks``), so its outputs are a ``QuantizedLinear``'s computing in the same dtype, bit for
    bit (each block's GEMM gives the whole one's rows from ``MIN_BLOCK_ROWS`` rows up: tests/test_exact2.py checks it
    at the 27B width).

    The drafter stage runs a parted target this way (``convert.weights.shipped.PartLoader.load(lean=True)``): it
    runs the target for hours and never packages it, and at 27B the target's weights are 54 GB in fp16 with a 108 GB
    fp32 compute copy beside them, where a 2-bit pack's codes are 6.8 GB. The shipped tensors never change dtype and
    are never copied: ``.to(dtype)`` sets the dtype an embedding's rows are computed in (a linear computes in its
    input's) and moves the rotation and the bias, and ``copy.deepcopy`` (``export.functions.compute_copy``) shares
    them, so the fp16 modules and their fp32 compute copy hold one set."""

    SHARED = ("words", "scale", "zero_point", "lut")

    def __init__(self, name: str, quantized: QuantizedWeight, bias: nn.Parameter | None = None,
                 embedding: bool = False):
        super().__init__()
        _validate(name, quantized)
        self.name, self.embedding = name, embedding
        self.method, self.group_size, self.shape = quantized.method, quantized.group_size, quantized.shape
        self.bits = _CODE_BITS[quantized.method]
        self.compute_dtype = torch.float16  # an embedding's rows (a linear computes in its input's dtype)
        self.register_buffer("words", pack_codes(quantized.codes, self.bits, name))
        for field in ("scale", "zero_point", "lut"):
            self.register_buffer(field, getattr(quantized, field))
        self.bias = bias
        self.rotation = _rotation_module(quantized, inverse=embedding)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        return self

    def quantized_weight(self, lo: int = 0, hi: int | None = None) -> QuantizedWeight:
        """Rows ``lo .. hi-1`` (all by default) as a ``QuantizedWeight`` (codes unpacked; lut4 rows on whole tables)."""
        hi = self.shape[0] if hi is None else hi
        codes = unpack_codes(self.words[lo:hi], self.bits, self.shape[1])
        rotation = self.rotation.rotation() if self.rotation is not None else None
        if self.method == "lut4":
            g = self.group_size
            return QuantizedWeight("lut4", codes, g, lut=self.lut[lo // g : -(-hi // g)])
        return QuantizedWeight(self.method, codes, self.group_size, scale=self.scale[lo:hi],
                               zero_point=self.zero_point[lo:hi], rotation=rotation)

    def rows(self, lo: int, hi: int) -> CodesLinear:
        """Output rows ``lo .. hi-1`` as a ``CodesLinear`` over views of these codes and tables (nothing copied; a
        lut4 split falls on whole tables), the rotation shared."""
        g = self.group_size
        if self.method == "lut4" and (lo % g or (hi % g and hi != self.shape[0])):
            raise ValueError(f"lut4 rows {lo}..{hi} split a table of {g} rows")
        piece = copy.copy(self)  # then its own dicts: the copy's would be this module's
        piece._parameters, piece._modules = dict(self._parameters), dict(self._modules)
        tables = {"lut": slice(lo // g, -(-hi // g))} if self.method == "lut4" else {}
        piece._buffers = {name: None if tensor is None else tensor[tables.get(name, slice(lo, hi))]
                          for name, tensor in self._buffers.items()}
        if self.bias is not None:
            piece.bias = nn.Parameter(self.bias[lo:hi], requires_grad=False)
        piece.name, piece.shape = f"{self.name}[{lo}:{hi}]", (hi - lo, self.shape[1])
        return piece

    def dense_rows(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``lo .. hi-1`` of the fp16 weight (``quantized_weight(lo, hi).dequantize()``, bit for bit) in ``dtype``,
        written into a reused workspace (valid until the next call): each packed byte's codes read from a 256-entry
        table, the group tables broadcast, not repeated, and the arithmetic in fp32: ``(code - zero_point) * scale``
        is exact there (a 4-bit integer times an 11-bit significand), so its one rounding to fp16 is the fp16
        product's. At the 27B width this is 6x the speed of ``dequantize`` (``bench/lean_target.py``)."""
        count, device = (hi - lo) * self.shape[1], self.words.device
        indices = _workspace("indices", count // (8 // self.bits), torch.int32, device)
        indices.copy_(self.words[lo:hi].reshape(-1))
        if self.method == "lut4":
            g = self.group_size
            codes = _workspace("codes", count, torch.int32, device).view(hi - lo, -1)
            torch.index_select(_byte_codes(self.bits, torch.int32, device), 0, indices,
                               out=codes.view(-1, 8 // self.bits))
            first = torch.arange(lo, hi, dtype=torch.int32, device=device)[:, None] // g - lo // g  # each row's table
            codes.add_(first * (1 << self.bits))
            weight = _workspace("weight16", count, torch.float16, device)
            torch.index_select(self.lut[lo // g : -(-hi // g)].reshape(-1), 0, codes.view(-1), out=weight)
        else:
            values = _workspace("values", count, torch.float32, device)
            torch.index_select(_byte_codes(self.bits, torch.float32, device), 0, indices,
                               out=values.view(-1, 8 // self.bits))
            grouped = values.view(hi - lo, -1, self.group_size)
            grouped.sub_(self.zero_point[lo:hi, :, None]).mul_(self.scale[lo:hi, :, None])
            weight = _workspace("weight16", count, torch.float16, device)
            weight.copy_(values)
        if dtype == torch.float16:
            return weight.view(hi - lo, self.shape[1])
        dense = _workspace("dense", count, dtype, device)
        dense.copy_(weight)
        return dense.view(hi - lo, self.shape[1])

    def row_blocks(self) -> list[tuple[int, int]]:
        """``row_blocks`` of this weight (whole lut4 tables); on an accelerator, blocks of ``DEVICE_BLOCK_WEIGHTS``."""
        weights = ROW_BLOCK_WEIGHTS if self.words.device.type == "cpu" else DEVICE_BLOCK_WEIGHTS
        return row_blocks(*self.shape, self.group_size if self.method == "lut4" else 1, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding:
            return self._lookup(x)
        if self.rotation is not None:
            x = self.rotation(x)
        dense = self.__dict__.get("dense")
        if dense is not None:  # laid out once (``dense_products``); another dtype's values are its exactly
            return F.linear(x, dense if dense.dtype == x.dtype else dense.to(x.dtype), self.bias)
        return blocked_linear(self, x, self.row_blocks(), functools.partial(self.dense_rows, dtype=x.dtype), self.bias)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        codes = unpack_codes(self.words[flat], self.bits, self.shape[1])
        if self.method == "lut4":
            rows = self.lut[(flat // self.group_size)[:, None], codes.long()]
        else:
            rows = QuantizedWeight(self.method, codes, self.group_size, scale=self.scale[flat],
                                   zero_point=self.zero_point[flat]).dequantize()
        rows = rows.to(self.compute_dtype).reshape(*ids.shape, self.shape[1])
        return rows if self.rotation is None else rotated_rows(self.rotation, rows)

    def shipped_nbytes(self) -> int:
        """Bytes this layer takes in a package (``QuantizedLinear.shipped_nbytes``'s count)."""
        rotation = [] if self.rotation is None else list(self.rotation.buffers())
        tables = [t for t in (self.scale, self.lut) if t is not None]
        zero_points = 0 if self.zero_point is None else math.ceil(self.zero_point.numel() * self.bits / 8)
        bias = [] if self.bias is None else [self.bias]
        return math.ceil(self.shape[0] * self.shape[1] * self.bits / 8) + zero_points + sum(
            t.nbytes for t in [*tables, *rotation, *bias])


def dense_products(core: nn.Module, dtype: torch.dtype | None = None, budget: int | None = None) -> int:
    """Each quantized linear of ``core`` held as codes (``CodesLinear``, not an embedding) computes from its whole
    weight dequantized once, in ``dtype`` (default the dtype the core computes in; ``dense_rows`` a block at a time:
    the values each block's call takes), for as long as the module lives: a copy computing many calls on an
    accelerator, whose memory holds a piece's dense weights beside the target's codes (the gate's candidate there,
    ``verify/gates.py``; the drafter stage's target, ``pipeline/drafter_build.py``). Weights held in fp16 for an fp32
    core are cast on each call (exactly: the fp16 weight's values). With ``budget`` (bytes), the linears whose weights
    still fit it, in ``core``'s order; the rest compute from their codes. The codes stay; packaging never sees such
    a copy. Returns the bytes laid out."""
    laid = 0
    for module in core.modules():
        if isinstance(module, CodesLinear) and not module.embedding:
            held = module.compute_dtype if dtype is None else dtype
            size = module.shape[0] * module.shape[1] * held.itemsize
            if budget is not None and laid + size > budget:
                continue
            dense = torch.empty(module.shape, dtype=held, device=module.words.device)
            for lo, hi in module.row_blocks():
                dense[lo:hi] = module.dense_rows(lo, hi, held)
            module.dense, laid = dense, laid + size
    return laid


def pack_codes(codes: torch.Tensor, bits: int, name: str = "weight") -> torch.Tensor:
    """uint8 codes [rows, columns] below 2**bits -> uint8 [rows, columns * bits / 8], code k of each byte in bits
    k*bits .. (k+1)*bits - 1."""
    per = 8 // bits
    rows, columns = codes.shape
    if columns % per:
        raise PackageError(f"quantized weight {name!r}: {columns} columns do not pack {per} codes a byte")
    lanes = codes.reshape(rows, columns // per, per)
    words = lanes[..., 0].clone()
    for k in range(1, per):
        words |= lanes[..., k] << (bits * k)
    return words


ROW_BLOCK_WEIGHTS = 1 << 20
"""A ``CodesLinear``'s dense block: 4 MB in fp32 stays in cache and its workspace is reused (64 MB blocks ran at a
sixth of the speed: each fresh block was a fresh mapping of memory, page-faulted in)."""
DEVICE_BLOCK_WEIGHTS = 1 << 26
"""A ``CodesLinear``'s dense block on an accelerator: a 27B matrix in one or two blocks (a GPU's kernels are launched
per block: the CPU's 4 MB blocks would be 85 GEMMs a matrix), 256 MB in fp32, so that the workspaces of the threads
of sessions in step (one set a thread) stay near 1 GB each."""
MIN_BLOCK_ROWS = 16
"""A block's fp32 product is the whole matrix's bit for bit only from this many rows up: a GEMM over 9 output rows or
fewer sums in another order on this project's CPUs (16 and more matched at every width and shape tried)."""
_WORKSPACES = threading.local()


def _workspace(role: str, count: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A flat buffer of ``count`` elements for ``role`` on ``device`` (default the CPU), grown as needed and reused by
    every ``CodesLinear`` and ``HalfLinear`` call of this thread: one set a thread, since the drafter stage's sessions
    run in threads (``export.lockstep``), and an anchor row made in one (``embedding_rows``) must not write the buffers
    a group's linear is computing from in another."""
    buffers = _WORKSPACES.__dict__
    key = (role, dtype, torch.device(device or "cpu"))
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = buffers[key] = torch.empty(count, dtype=dtype, device=key[2])
    return buffer[:count]


def row_blocks(rows: int, columns: int, multiple: int = 1, weights: int = ROW_BLOCK_WEIGHTS) -> list[tuple[int, int]]:
    """Row ranges of about ``weights`` weights (a multiple of ``multiple`` rows), none under ``MIN_BLOCK_ROWS`` rows (a
    short tail joins the block before it): one block's dense copy at a time."""
    step = max(MIN_BLOCK_ROWS, weights // columns)
    step = multiple * -(-step // multiple)
    starts = list(range(0, rows, step))
    if len(starts) > 1 and rows - starts[-1] < MIN_BLOCK_ROWS:
        starts.pop()
    return list(zip(starts, [*starts[1:], rows], strict=True))


class HalfLinear(_SharedTensors):
    """A linear whose fp16 weight is shared with the module it was made from (``half_linears``) and that
    computes in its input's dtype: the fp32 copies of a drafter (calibration, acceptance, the A/B) hold no second
    copy of its weights (at 27B the drafter's are 3.85 GB in fp16, 7.7 in fp32, and the stage held three fp32 copies).
    In fp32 each block of rows (``row_blocks``) is upcast into a reused workspace, so the outputs are those of the
    fp32 weight bit for bit (tests/test_exact2.py checks the blocks at the 27B width)."""

    SHARED = ("weight",)

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None, rotation: nn.Module | None = None):
        super().__init__()
        self.register_buffer("weight", weight.detach())
        self.bias, self.rotation = bias, rotation

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            x = self.rotation(x)
        if x.dtype == self.weight.dtype:
            return nn.functional.linear(x, self.weight, self.bias)

        def upcast(lo: int, hi: int) -> torch.Tensor:
            dense = _workspace("dense", (hi - lo) * self.weight.shape[1], x.dtype, x.device).view(hi - lo, -1)
            return dense.copy_(self.weight[lo:hi])

        return blocked_linear(self, x, row_blocks(*self.weight.shape), upcast, self.bias)


def half_linears(core: nn.Module) -> dict[int, HalfLinear]:
    """A ``HalfLinear`` over each ``nn.Linear`` and dense ``QuantizedLinear`` of ``core`` (its weight shared, its bias
    and rotation copied), by the id of the module it stands for: the ``copy.deepcopy`` memo of a copy that holds no
    second copy of them (``export.functions.compute_copy(share_weights=True)``). A linear whose weight is tied to
    another module (a tied lm_head's embedding table) is left to be copied with it."""
    tied = {id(p) for m in core.modules() if not _dense_linear(m) for p in m.parameters(recurse=False)}
    return {id(m): HalfLinear(m.weight, copy.deepcopy(m.bias), copy.deepcopy(getattr(m, "rotation", None)))
            for m in core.modules() if _dense_linear(m) and id(m.weight) not in tied}


def _dense_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear or (type(module) is QuantizedLinear and not module.released)


@functools.cache
def _byte_codes(bits: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """[256, 8 / bits]: the codes a packed byte holds (``pack_codes``' order), in ``dtype``, on ``device`` (the CPU)."""
    return unpack_codes(torch.arange(256, dtype=torch.uint8)[:, None], bits, 8 // bits).to(device or "cpu", dtype)


def unpack_codes(words: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """``pack_codes``' inverse: uint8 [rows, columns] codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device)
    return ((words[..., None] >> shifts) & (2**bits - 1)).reshape(*words.shape[:-1], columns)


def table_shape(embedding: nn.Module) -> tuple[int, int]:
    """[rows, columns] of an embedding's table, held as codes (``CodesLinear``) or as a weight."""
    return tuple(embedding.shape if isinstance(embedding, CodesLinear) else embedding.weight.shape)


def embedding_rows(embedding: nn.Module, lo: int = 0, hi: int | None = None, block_rows: int = 4096) -> torch.Tensor:
    """Rows ``lo .. hi-1`` (all by default) of an embedding's table as its lookups return them, fp16: the weight
    itself, or for a rotated (exact2) table, whose stored rows ``W'`` are in the pack's rotated basis, each row after
    its rotation (``S H W'``: the unfolded table) computed in fp32 a block of rows at a time and rounded to fp16 (each
    row's value is the same whichever block it is computed in). What a host feeds a drafter as a token's embedding
    (the anchor, the mask row): the stored row would be another vector."""
    hi = table_shape(embedding)[0] if hi is None else hi
    if isinstance(embedding, CodesLinear):
        columns = embedding.shape[1]
        blocks = row_blocks(hi - lo, columns)
        dense = functools.partial(embedding.dense_rows, dtype=torch.float32)
    elif isinstance(embedding, QuantizedEmbedding) and embedding.rotation is not None:
        columns, shipped = embedding.weight.shape[1], embedding.quantized_weight()
        blocks = [(a, min(a + block_rows, hi - lo)) for a in range(0, hi - lo, block_rows)]

        def dense(a: int, b: int) -> torch.Tensor:
            return shipped.rows(a, b).dequantize().float()
    else:
        return embedding.weight.detach()[lo:hi]
    rows = torch.empty(hi - lo, columns, dtype=torch.float16)
    for a, b in blocks:
        block = dense(lo + a, lo + b)
        rows[a:b] = block if embedding.rotation is None else embedding.rotation(block).to(torch.float16)
    return rows


def apply_quantized(core: nn.Module, weights: dict[str, QuantizedWeight], codes_only: bool = False) -> None:
    """Swap each named ``nn.Linear`` (or ``nn.Embedding``) of ``core`` (names as in ``core.named_modules()``) for a
    ``QuantizedLinear`` (or ``QuantizedEmbedding``); ``codes_only``: for a ``CodesLinear``, which holds the packed codes
    alone (a module that is run, never packaged).

    A linear module reachable under several names is swapped under all of them by one ``QuantizedLinear``;
    naming two of its aliases with different ``QuantizedWeight`` objects is refused. A linear whose weight is
    tied to a parameter elsewhere (a tied ``lm_head`` sharing the embedding table) is refused: quantizing it
    would untie the two and ship the table twice.
    """
    aliases: dict[int, list[str]] = {}
    for path, module in core.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(path)
    chosen: dict[int, tuple[str, nn.Linear, QuantizedWeight]] = {}
    for name, quantized in weights.items():
        linear = _linear(core, name)
        if isinstance(linear, RowParts):  # each part takes its rows of the weight
            core.set_submodule(name, linear.of_weight(name, quantized, codes_only))
            continue
        first = chosen.setdefault(id(linear), (name, linear, quantized))
        if first[2] is not quantized:
            raise PackageError(
                f"{name!r} and {first[0]!r} are one shared linear given two different quantized weights; give it one"
            )
    for name, linear, quantized in chosen.values():
        paths = aliases[id(linear)]
        _refuse_tied(core, name, linear, {f"{p}.weight" for p in paths})
        if tuple(linear.weight.shape) != quantized.shape:
            raise PackageError(
                f"quantized weight {name!r} is {list(quantized.shape)} but the linear's weight is "
                f"{list(linear.weight.shape)}; quantize the checkpoint tensor this module loads"
            )
        if codes_only:
            layer = CodesLinear(name, quantized, getattr(linear, "bias", None), isinstance(linear, nn.Embedding))
        elif isinstance(linear, nn.Embedding):
            layer = QuantizedEmbedding(name, quantized)
        else:
            layer = QuantizedLinear(name, quantized, linear.bias)
        for path in paths:
            core.set_submodule(path, layer)


def linear_rows(module: nn.Module, lo: int, hi: int) -> nn.Module:
    """Output rows ``lo .. hi-1`` of a linear or an embedding table (the module itself when that is all of it): views of
    its weight, or of a quantized one's codes and tables."""
    if (lo, hi) == (0, _rows_of(module)):
        return module
    if isinstance(module, CodesLinear):
        return module.rows(lo, hi)
    if isinstance(module, QuantizedLinear):
        kind = QuantizedEmbedding if isinstance(module, QuantizedEmbedding) else QuantizedLinear
        return kind(f"{module.name}[{lo}:{hi}]", module.quantized_weight().rows(lo, hi))
    rows = nn.Parameter(module.weight[lo:hi], requires_grad=False)
    if isinstance(module, nn.Embedding):
        return nn.Embedding.from_pretrained(rows, freeze=True)
    linear = nn.Linear(module.in_features, hi - lo, bias=False, device="meta")
    linear.weight = rows
    return linear


def _rows_of(module: nn.Module) -> int:
    return module.shape[0] if isinstance(module, CodesLinear) else module.weight.shape[0]


class RowParts(nn.Module):
    """A linear computed in parts of its output rows (``ranges``, consecutive), each its own module, so that each
    ships as its own constant: the ane layout's head over more rows than the ANE's largest dimension
    (``export.ane.head_outputs``). Called on rows it returns the whole product, the parts' side by side."""

    def __init__(self, parts: list[nn.Module], ranges: list[tuple[int, int]]):
        super().__init__()
        self.parts, self.ranges = nn.ModuleList(parts), tuple(tuple(r) for r in ranges)

    @classmethod
    def split(cls, module: nn.Module, ranges: list[tuple[int, int]]) -> RowParts:
        """``module``'s rows in ``ranges`` (``linear_rows``: views, nothing copied but a quantized part's dense
        weight)."""
        return cls([linear_rows(module, lo, hi) for lo, hi in ranges], ranges)

    def of_weight(self, name: str, quantized: QuantizedWeight, codes_only: bool = False) -> RowParts:
        """These ranges of ``quantized`` (``apply_quantized``): each part a ``QuantizedLinear`` of its rows, or with
        ``codes_only`` a ``CodesLinear``."""
        if quantized.shape[0] != self.ranges[-1][1]:
            raise PackageError(f"quantized weight {name!r} is {list(quantized.shape)} but its row parts end at row "
                               f"{self.ranges[-1][1]}; quantize the checkpoint tensor this module loads")
        kind = CodesLinear if codes_only else QuantizedLinear
        return RowParts([kind(f"{name}[{lo}:{hi}]", quantized.rows(lo, hi)) for lo, hi in self.ranges], self.ranges)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def packaged_from_codes(core: nn.Module) -> None:
    """Swap every ``CodesLinear`` of ``core`` (a drafter's tables borrowed from a lean target) for the
    ``QuantizedLinear`` (or ``QuantizedEmbedding``) a package is made from, its dense weight released
    (``release_dense_weights``): the same codes and tables, the same outputs."""
    swapped: dict[int, QuantizedLinear] = {}
    for path, module in list(core.named_modules(remove_duplicate=False)):
        if isinstance(module, CodesLinear):
            if id(module) not in swapped:
                kind = QuantizedEmbedding if module.embedding else QuantizedLinear
                layer = kind(module.name, module.quantized_weight(), module.bias)
                release_dense_weights(layer)
                swapped[id(module)] = layer
            core.set_submodule(path, swapped[id(module)])


def release_dense_weights(module: nn.Module) -> None:
    """Free the fp16 dense ``weight`` of every ``QuantizedLinear`` of ``module`` (2 bytes a weight of a part), once
    its calls are recorded: the packages are made from codes and tables alone (Core AI exports ``packed``; Core ML
    builds its ops from the codes, ``convert/backends/coreml.py``), and the checks compare the codes, the tables and
    each format's decompression of them with ``QuantizedWeight.dequantize``. The parameter stays, a placeholder of
    its shape (one zero, expanded); an eager forward afterwards computes the weight from ``packed``, the same
    values, more slowly."""
    for layer in module.modules():
        if isinstance(layer, QuantizedLinear) and not layer.released:
            placeholder = torch.zeros((), dtype=layer.weight.dtype).expand(layer.weight.shape)
            layer.weight = nn.Parameter(placeholder, requires_grad=False)
            layer.released = True


def dense_weight_names(module: nn.Module) -> set[str]:
    """The names of the ``QuantizedLinear`` dense weights among ``module.named_parameters()``: copies of what their
    codes and tables hold, which the checks and the cache keys read from those instead."""
    layers = {path for path, m in module.named_modules(remove_duplicate=False) if isinstance(m, QuantizedLinear)}
    return {f"{path}.weight" for path in layers}


def quantized_weights(module: nn.Module) -> dict[str, QuantizedWeight]:
    """Every ``QuantizedLinear`` of ``module`` by its (first) name, with the ``QuantizedWeight`` it ships."""
    return {name: m.quantized_weight() for name, m in module.named_modules() if isinstance(m, QuantizedLinear)}


def shipped_nbytes(module: nn.Module, skip: set[str]) -> int:
    """Bytes of the weights of ``module`` in a package: parameters and buffers once each (but the names in
    ``skip``), every ``QuantizedLinear`` counted packed (``QuantizedLinear.shipped_nbytes``)."""
    quantized = {name: m for name, m in module.named_modules() if isinstance(m, QuantizedLinear)}
    total = sum(m.shipped_nbytes() for m in quantized.values())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name not in skip and not any(name.startswith(f"{q}.") for q in quantized):
            total += tensor.nbytes
    return total


def add_coreml_compression(module: nn.Module) -> None:
    """Mark the weight of every ``QuantizedLinear`` of ``module`` as compressed for coremltools (a
    ``_COREML_/weight/compression_type`` buffer), on the Core ML backend's tracing copy, never the live modules (the
    buffers would travel into the Core AI export too). The backend builds each marked weight's op from its codes and
    tables (``convert/backends/coreml.py``, ``_weights_from_codes``)."""
    layers = [m for m in module.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        kind = _COREML_PALETTIZATION if layer.method in ("lut4", "exact2") else _COREML_QUANTIZATION
        layer.register_buffer(f"{COREML_PREFIX}/weight/compression_type", torch.tensor([kind]))
    if layers:
        module.register_buffer(f"{COREML_PREFIX}/metadata_version", torch.tensor(1))


def exact2_tables(scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Each group's weights for codes 0..3, [out, groups, 4] fp16, by ``QuantizedWeight.dequantize``'s own fp16
    arithmetic: entry k is bit for bit the weight of a code k."""
    codes = torch.arange(EXACT2_ENTRIES, dtype=torch.float16)
    return (codes - zero_point[..., None].to(torch.float16)) * scale[..., None]


def exact2_parameters(tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fp16 scale and uint8 zero point [out, groups] whose ``exact2_tables`` are ``tables`` bit for bit, or None.

    A group's one zero entry is its zero point; the entry after it is ``1 * scale``, exactly (for zero point 3,
    the entry before it is ``-1 * scale``).
    """
    if tables.dtype != torch.float16 or tables.dim() != 3 or tables.shape[-1] != EXACT2_ENTRIES:
        return None
    zeros = tables == 0
    if not bool((zeros.sum(-1) == 1).all()):
        return None
    zero_point = zeros.to(torch.uint8).argmax(-1).to(torch.uint8)
    z = zero_point.long()[..., None]
    after = tables.gather(-1, (z + 1).clamp(max=EXACT2_ENTRIES - 1))[..., 0]
    before = tables.gather(-1, (z - 1).clamp(min=0))[..., 0]
    scale = torch.where(zero_point < EXACT2_ENTRIES - 1, after, -before)
    rebuilt = exact2_tables(scale, zero_point)
    return (scale, zero_point) if torch.equal(rebuilt.view(torch.int16), tables.view(torch.int16)) else None


def _validate(name: str, q: QuantizedWeight) -> None:
    """Refuse what the packages cannot store exactly, naming the tensor."""

    def refuse(problem: str) -> None:
        raise PackageError(f"quantized weight {name!r}: {problem}")

    if q.method not in TABLES:
        refuse(f"method {q.method!r} is not one of {sorted(TABLES)}")
    if q.codes.dtype != torch.uint8 or q.codes.dim() != 2:
        refuse(f"codes must be a 2-D uint8 tensor, got {q.codes.dtype} {list(q.codes.shape)}")
    bits = _CODE_BITS[q.method]
    if q.rotation is not None:
        _validate_rotation(refuse, q)
    if int(q.codes.max()) >= 2**bits:
        refuse(f"codes go up to {int(q.codes.max())}, above the {bits}-bit maximum {2**bits - 1}")
    (_validate_lut if q.method == "lut4" else _validate_affine)(refuse, q, bits)


def _validate_rotation(refuse: Callable[[str], None], q: QuantizedWeight) -> None:
    signs, block = q.rotation.signs, q.rotation.block
    if q.method != "exact2":
        refuse(f"a {q.method} weight has a rotation; only a pre-quantized (exact2) weight ships with one")
    if signs.shape != (q.shape[1],) or not bool(((signs == 1) | (signs == -1)).all()):
        refuse(f"the rotation's signs {list(signs.shape)} are not +-1 over the {q.shape[1]} input columns")
    if block < 1 or block & (block - 1) or q.shape[1] % block:
        refuse(f"the rotation's block {block} is not a power of two dividing the {q.shape[1]} input columns")


def _validate_lut(refuse: Callable[[str], None], q: QuantizedWeight, bits: int) -> None:
    rows = q.shape[0]
    if q.group_size <= 0 or rows % q.group_size:
        refuse(f"{rows} rows do not split into groups of {q.group_size}")
    _check_table(refuse, "lut", q.lut, torch.float16, (rows // q.group_size, ENTRIES))
    if not bool(q.lut.isfinite().all()):
        refuse("the lut holds inf or NaN; coremltools matches weights to entries by distance")


def _validate_affine(refuse: Callable[[str], None], q: QuantizedWeight, bits: int) -> None:
    """An affine4 or exact2 weight's scales and zero points (a group a row's ``group_size`` columns)."""
    rows, columns = q.shape
    if q.group_size <= 0 or columns % q.group_size:
        refuse(f"{columns} columns do not split into groups of {q.group_size}")
    groups = (rows, columns // q.group_size)
    _check_table(refuse, "scale", q.scale, torch.float16, groups)
    _check_table(refuse, "zero_point", q.zero_point, torch.uint8, groups)
    if not bool((q.scale.isfinite() & (q.scale != 0)).all()):
        derivation = {
            "affine4": "round(w / scale) + zero_point",
            "exact2": "the entry equal to w of its group's table scale * (k - zero_point), k = 0..3",
        }[q.method]
        refuse(f"a scale is zero, inf or NaN; Core ML derives each code as {derivation}")
    if int(q.zero_point.max()) >= 2**bits:
        refuse(f"a zero point is {int(q.zero_point.max())}; Core AI stores {q.method} zero points as uint{bits}")
    if q.method == "exact2" and not bool(exact2_tables(q.scale, q.zero_point).isfinite().all()):
        refuse(f"scale * (code - zero_point) overflows fp16 for a code 0..3 of some group (scales up to "
               f"{float(q.scale.abs().max())})")


def _check_table(refuse: Callable[[str], None], field: str, tensor, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != shape:
        got = "nothing" if not isinstance(tensor, torch.Tensor) else f"{tensor.dtype} {list(tensor.shape)}"
        refuse(f"{field} must be {dtype} {list(shape)}, got {got}")


def _rotation_module(q: QuantizedWeight, inverse: bool) -> nn.Module | None:
    """The weight's activation transform as a graph module (``convert/export/hadamard.py``): before a linear, after an
    embedding's lookup (``inverse``); None when the weight has none."""
    if q.rotation is None:
        return None

    return SignedHadamard(q.rotation.signs, q.rotation.block, inverse=inverse)


def _packed_module(q: QuantizedWeight) -> nn.Module:
    from coreai_torch._compression.custom_layers import PalettizeModule, WeightDequantizeModule

    codes = q.codes.contiguous()
    if q.method == "lut4":
        return PalettizeModule(codes, q.lut.reshape(-1, 1, ENTRIES, 1).contiguous())
    return WeightDequantizeModule(
        codes,
        q.scale.contiguous(),
        zero_point=q.zero_point.contiguous(),
        input_dtype=torch.uint2 if q.method == "exact2" else torch.uint4,
        output_dtype=torch.float16,
    )


def _linear(core: nn.Module, name: str) -> nn.Linear | nn.Embedding:
    try:
        module = core.get_submodule(name)
    except AttributeError:
        linears = [n for n, m in core.named_modules() if isinstance(m, nn.Linear)]
        raise PackageError(
            f"{name!r} is not a module of the export core; quantized weights are named as in "
            f"core.named_modules(), e.g. {linears[:2]}"
        ) from None
    if not isinstance(module, (nn.Linear, nn.Embedding, RowParts)):
        raise PackageError(
            f"{name!r} is a {type(module).__name__}; only nn.Linear and nn.Embedding weights are quantized"
        )
    return module


def _refuse_tied(core: nn.Module, name: str, linear: nn.Linear, own: set[str]) -> None:
    tied = [n for n, p in core.named_parameters(remove_duplicate=False) if p is linear.weight and n not in own]
    if tied:
        raise PackageError(
            f"{name}.weight is tied to {tied[0]} (e.g. tie_word_embeddings): quantizing it alone would untie them "
            f"and store the table twice; keep {name!r} unquantized"
        )
