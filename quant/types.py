"""What a quantizer hands the rest of the pipeline: a weight exactly as it will ship.

Three formats, each chosen so that both package formats store it natively and dequantize it with
the same arithmetic (bit for bit what ``dequantize`` returns here):

- ``affine4``: uint4 codes per weight; per group of ``group_size`` consecutive input columns of a row,
  an fp16 ``scale`` and an integer ``zero_point``: ``w = scale * (code - zero_point)`` evaluated in
  fp16 (the difference is an exact small integer, so there is one rounding). Core AI:
  ``WeightDequantizeModule`` (``constexpr_blockwise_shift_scale``); Core ML: the same op.
- ``lut4``: uint4 indices per weight; per group of ``group_size`` consecutive output rows, a table of
  16 fp16 values: ``w = lut[row // group_size, index]``. Core AI: ``PalettizeModule``
  (``lut_to_dense``); Core ML: ``constexpr_lut_to_dense``.
- ``exact2``: affine4's arithmetic over 2-bit codes (0..3) and zero points (0..3), for weights that arrive
  already quantized (Prism ML's Ternary Bonsai 2 packs: codes 0, 1, 2 with zero point 1 and an fp16 scale per
  128 input columns, so ``-s, 0, +s``; a code 3 is ``2 s``). Shipped as they are, never re-quantized. Core AI:
  ``WeightDequantizeModule`` with uint2 data (``constexpr_blockwise_shift_scale``); Core ML, whose
  ``constexpr_blockwise_shift_scale`` takes no 2-bit data: ``constexpr_lut_to_dense`` of the uint2 codes
  through a 4-entry int8 table, into ``constexpr_blockwise_shift_scale`` (see ``convert/export/quantized.py``).

A quantizer over a whole matrix is two steps, so GPTQ can put its column sweep between them:
``fit`` (the group parameters, from the whole matrix) and ``round`` (nearest codes for given columns
under those parameters). ``QuantizedWeight`` carries the result and its own dequantization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

Method = Literal["affine4", "lut4", "exact2"]
DEQUANTIZE_ELEMENTS = 1 << 24
GROUP_TENSORS = ("scale", "zero_point", "lut")  # a QuantizedWeight's tensors beside its codes (None where unused)


@dataclass(frozen=True)
class Rotation:
    """The activation transform a pre-quantized weight was stored under (Prism packs, ``convert/inputs/prism.py``): the
    weight computes on ``H(signs * x)``, ``H`` the normalised Walsh-Hadamard transform of each ``block`` consecutive
    input features; an embedding's looked-up rows become ``signs * H(row)``."""

    signs: torch.Tensor  # fp32 [in], +-1
    block: int


@dataclass
class QuantizedWeight:
    """A 2-D weight [out_features, in_features] in a 4-bit or 2-bit shipping format.

    codes: uint8 [out, in], values 0..15 (exact2: 0..3; unpacked, backends pack them).
    affine4 and exact2: scale fp16 [out, in // group_size]; zero_point uint8 [out, in // group_size] (integral;
    exact2: 0..3).
    lut4: lut fp16 [out // group_size, 16].
    """

    method: Method
    codes: torch.Tensor
    group_size: int
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    lut: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)  # e.g. weight MSE, output error, GPTQ damping used
    rotation: Rotation | None = None  # exact2 of a rotated pack: the transform in the graph before (or after) it

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def bits_per_weight(self) -> float:
        out, inp = self.shape
        if self.method == "affine4":
            return 4 + (16 + 8) / self.group_size  # fp16 scale + uint8 zero point per group
        if self.method == "exact2":
            return 2 + (16 + 2) / self.group_size  # fp16 scale + 2-bit zero point per group (Core AI's form)
        return 4 + 16 * 16 / (self.group_size * inp)  # a 16-entry fp16 table per group of rows

    def rows(self, lo: int, hi: int) -> QuantizedWeight:
        """Output rows ``lo .. hi-1`` (a vocabulary split of a table): the same codes and group tensors, sliced; a
        lut4 split falls on whole tables."""
        if self.method == "lut4":
            if lo % self.group_size or (hi % self.group_size and hi != self.shape[0]):
                raise ValueError(f"lut4 rows {lo}..{hi} split a table of {self.group_size} rows")
            g = self.group_size
            return QuantizedWeight("lut4", self.codes[lo:hi], g, lut=self.lut[lo // g : -(-hi // g)])
        return QuantizedWeight(self.method, self.codes[lo:hi], self.group_size, scale=self.scale[lo:hi],
                               zero_point=self.zero_point[lo:hi], rotation=self.rotation)

    def dequantize(self) -> torch.Tensor:
        """The fp16 weight the packages compute, bit for bit (affine4 and exact2: ``(code - zero_point) * scale`` in
        fp16, an exact small integer times the scale, so one rounding); in row chunks of about
        ``DEQUANTIZE_ELEMENTS``, so the temporaries stay small (a 248320-row table's int64 indices alone would be
        10 GB)."""
        rows, columns = self.shape
        out = torch.empty(rows, columns, dtype=torch.float16, device=self.codes.device)
        step = max(1, DEQUANTIZE_ELEMENTS // columns)
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            codes = self.codes[lo:hi]
            if self.method == "lut4":
                groups = torch.arange(lo, hi, device=codes.device) // self.group_size
                out[lo:hi] = self.lut[groups[:, None], codes.long()]
            else:
                scale = self.scale[lo:hi].repeat_interleave(self.group_size, dim=1)
                zero = self.zero_point[lo:hi].repeat_interleave(self.group_size, dim=1).to(torch.float16)
                out[lo:hi] = (codes.to(torch.float16) - zero) * scale
        return out


def hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester Walsh-Hadamard matrix of order n (a power of two), fp64 and symmetric."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix has a power-of-two order, not {n}")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(n)


def walsh_hadamard(rows: torch.Tensor, block: int) -> torch.Tensor:
    """``rows`` times the block-diagonal ``hadamard(block)`` over its last dimension, in ``rows``' dtype: the Sylvester
    matrix of order a * b is the Kronecker product of those of orders a and b, so each block, read as an a x b matrix
    X, becomes H_a X H_b with +-1 matrices (sums and differences only), then one division by sqrt(block). Equal to the
    matrix product up to rounding (in fp64 the sums of a 2-bit pack's values are exact, so every order of summation
    gives the same result), in 2 (a + b) operations an element instead of 2 block: what unfolding a 27B pack needs."""
    if block < 1 or block & (block - 1) or rows.shape[-1] % block:
        raise ValueError(f"a block of {block} columns does not split rows of {rows.shape[-1]}")
    a = 1 << (block.bit_length() - 1) // 2
    b = block // a
    signs_a, signs_b = (torch.round(hadamard(n) * math.sqrt(n)).to(rows.device, rows.dtype) for n in (a, b))
    blocks = rows.reshape(-1, a, b)
    turned = torch.matmul(torch.matmul(signs_a, blocks), signs_b)
    return (turned / math.sqrt(block)).reshape(rows.shape)
