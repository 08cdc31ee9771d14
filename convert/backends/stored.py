"""Quantized weights read back from the packages: ``ShippedWeight`` (a weight's codes and tables as a package stores
them, and the format's own decompression of its rows), read from the formats' ops by ``from_lut_to_dense``,
``from_blockwise_shift_scale`` and ``from_codes_then_scales`` (each refusing any layout but its method's), and
``difference``: how one differs from the ``QuantizedWeight`` that was meant to ship (``convert/export/quantized.py``
puts them in the graphs; the backends read them back, ``convert.verify.checks`` compares them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from convert.errors import PackageError
from convert.export.quantized import ENTRIES, EXACT2_ENTRIES, TABLES
from quant.types import QuantizedWeight

_ROW_BLOCK = 1024


@dataclass(frozen=True)
class ShippedWeight:
    """A compressed weight read back from a package: where it is, its codes and tables as stored, the format's own
    decompression of a range of its rows (``decompress_rows(start, stop)``, ``start`` a multiple of
    ``row_multiple``), and ``fingerprint(weight)`` (the checks match weights by it). The dense weight is
    computed when asked for, a block of rows at a time where it can be (``row_blocks``): a part's
    check holding one dense copy of every weight peaked at 12 bytes a weight above its modules
    (docs/benchmarks.md), and one whole dense copy of a 248320-row table is 2.5 GB."""

    where: str
    weight: QuantizedWeight
    decompress_rows: Callable[[int, int], np.ndarray]
    row_multiple: int
    fingerprint: str

    def row_blocks(self) -> list[tuple[int, int]]:
        """Row ranges of about 1024 rows (multiples of ``row_multiple``) covering the weight.

        The formats' reference decompressions (coremltools', coreai-torch's) gather from a table repeated to
        [rows, columns, 16]: 32 bytes per weight, which whole matrices of a large model would not fit."""
        rows = self.weight.shape[0]
        step = self.row_multiple * max(1, _ROW_BLOCK // self.row_multiple)
        return [(start, min(start + step, rows)) for start in range(0, rows, step)]

    @property
    def dense(self) -> np.ndarray:
        return np.concatenate([self.decompress_rows(a, b) for a, b in self.row_blocks()])


def from_lut_to_dense(where: str, indices: np.ndarray, lut: np.ndarray) -> QuantizedWeight:
    """A lut_to_dense op's operands as a ``QuantizedWeight``; refuses any layout but lut4's."""
    if indices.ndim != 2 or lut.ndim != 4 or lut.shape[1:] != (1, ENTRIES, 1) or indices.shape[0] % lut.shape[0]:
        raise PackageError(
            f"{where}: lut_to_dense of indices {list(indices.shape)} by a {list(lut.shape)} table is not lut4 "
            f"(one {ENTRIES}-entry table per group of rows, [O/G, 1, {ENTRIES}, 1])"
        )
    codes = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.uint8))
    table = torch.from_numpy(np.ascontiguousarray(lut.reshape(-1, ENTRIES)))
    return QuantizedWeight("lut4", codes, indices.shape[0] // lut.shape[0], lut=table)


def from_blockwise_shift_scale(where: str, data: np.ndarray, scale: np.ndarray, offset: np.ndarray,
                               method: str = "affine4") -> QuantizedWeight:
    """A blockwise_shift_scale op's operands (``scale * (data - offset)``) as a ``QuantizedWeight`` of ``method``
    (affine4, or exact2 where the data is 2-bit); refuses any layout but theirs."""
    if (
        data.ndim != 2
        or scale.ndim != 2
        or offset.shape != scale.shape
        or scale.shape[0] != data.shape[0]
        or data.shape[1] % scale.shape[1]
    ):
        raise PackageError(
            f"{where}: blockwise_shift_scale of data {list(data.shape)}, scale {list(scale.shape)} and offset "
            f"{list(offset.shape)} is not {method} (a scale and zero point per group of columns of each row)"
        )
    return QuantizedWeight(
        method,
        torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)),
        data.shape[1] // scale.shape[1],
        scale=torch.from_numpy(np.ascontiguousarray(scale)),
        zero_point=torch.from_numpy(np.ascontiguousarray(offset, dtype=np.uint8)),
    )


def from_codes_then_scales(where: str, indices: np.ndarray, lut: np.ndarray, scale: np.ndarray,
                           offset: np.ndarray | None) -> QuantizedWeight:
    """Core ML's exact2 form as a ``QuantizedWeight``: lut_to_dense of 2-bit ``indices`` through one integer table
    ``[0, 1, 2, 3] - z``, then blockwise_shift_scale by ``scale`` and ``offset`` (None: 0), so a code's weight is
    ``scale * (code - (z + offset))``; refuses any other layout."""
    layout = (
        lut.shape == (1, 1, EXACT2_ENTRIES, 1)
        and lut.dtype.kind in "iu"
        and indices.ndim == 2
        and scale.ndim == 2
        and scale.shape[0] == indices.shape[0]
        and indices.shape[1] % scale.shape[1] == 0
        and (offset is None or offset.shape == scale.shape)
    )
    shift = -int(lut.reshape(-1)[0]) if layout else 0
    zero_point = shift + (np.zeros(scale.shape, np.int64) if offset is None else offset.astype(np.int64))
    if (
        not layout
        or not np.array_equal(lut.reshape(-1), np.arange(EXACT2_ENTRIES) - shift)
        or zero_point.min() < 0
        or zero_point.max() >= EXACT2_ENTRIES
    ):
        raise PackageError(
            f"{where}: lut_to_dense of indices {list(indices.shape)} by a {list(lut.shape)} table into "
            f"blockwise_shift_scale by a {list(scale.shape)} scale is not exact2 (one table [0, 1, 2, 3] - z, a scale "
            "per group of columns of each row, zero points z + offset in 0..3)"
        )
    return QuantizedWeight(
        "exact2",
        torch.from_numpy(np.ascontiguousarray(indices, dtype=np.uint8)),
        indices.shape[1] // scale.shape[1],
        scale=torch.from_numpy(np.ascontiguousarray(scale)),
        zero_point=torch.from_numpy(zero_point.astype(np.uint8)),
    )


def difference(expected: QuantizedWeight, shipped: ShippedWeight) -> str | None:
    """How ``shipped`` differs from ``expected`` bit for bit (format, codes, tables, then the dense weight the
    format decompresses against ``expected.dequantize()``), or None."""
    found = shipped.weight
    if (found.method, found.group_size, found.shape) != (expected.method, expected.group_size, expected.shape):
        return (
            f"{shipped.where} is {found.method} with groups of {found.group_size} over {list(found.shape)}, "
            f"expected {expected.method} with groups of {expected.group_size} over {list(expected.shape)}"
        )
    for field in ("codes", *TABLES[expected.method]):
        problem = _bitwise(getattr(expected, field), getattr(found, field), field)
        if problem:
            return f"{shipped.where}: {problem}"
    differing = 0
    for a, b in shipped.row_blocks():  # a block of rows at a time: a whole table's two dense copies would be 5 GB
        want = expected.rows(a, b).dequantize()
        block = torch.from_numpy(np.ascontiguousarray(shipped.decompress_rows(a, b)))
        if block.dtype != want.dtype or block.shape != want.shape:
            return (f"{shipped.where}: dense weight rows {a}..{b - 1} are {block.dtype} {list(block.shape)}, expected "
                    f"{want.dtype} {list(want.shape)}")
        differing += _differing(want, block)
    if differing:
        return (f"{shipped.where}: dense weight: {differing} of {expected.codes.numel()} entries differ (decompressed "
                "by the format's own op)")
    return None


def fingerprint(weight: QuantizedWeight) -> str:
    """A digest of the method, group size, shape and the bytes of codes and tables: equal exactly when the stored
    forms are (a digest, not the bytes: a check holds one per weight of a part)."""
    hashed = hashlib.sha256(f"{weight.method}:{weight.group_size}:{tuple(weight.shape)}".encode())
    for field in ("codes", *TABLES[weight.method]):
        tensor = getattr(weight, field).contiguous()
        hashed.update(f":{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        hashed.update(tensor.view(torch.uint8).numpy() if tensor.dtype != torch.uint8 else tensor.numpy())
    return hashed.hexdigest()


def digest(array: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes: how the checks match a weight to the stored one."""
    a = np.ascontiguousarray(array)
    hashed = hashlib.sha256(f"{a.dtype}:{a.shape}:".encode())
    hashed.update(a.view(np.uint8))
    return hashed.hexdigest()


def _bitwise(expected: torch.Tensor, found: torch.Tensor, what: str) -> str | None:
    if found.dtype != expected.dtype or found.shape != expected.shape:
        return f"{what} is {found.dtype} {list(found.shape)}, expected {expected.dtype} {list(expected.shape)}"
    differing = _differing(expected, found)
    return f"{what}: {differing} of {expected.numel()} entries differ" if differing else None


def _differing(expected: torch.Tensor, found: torch.Tensor) -> int:
    """How many entries of two tensors of one dtype and shape differ bit for bit."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[expected.element_size()]
    # count_nonzero: a bool tensor's sum() widens it to int64 first, 8 bytes a weight of a whole table's codes
    return int(torch.count_nonzero(found.contiguous().view(as_int) != expected.contiguous().view(as_int)))
