"""The ane layout's pieces, shared by every family that exports it (``layout: ane``, docs/layouts.md).

The Neural Engine runs a program whole only when every op in it is one it runs: anemll-forge's builder (the
reference for what a fully placed program looks like: ``coreai/qwen38_coreai_build.py`` of
github.com/Anemll/anemll-forge) keeps activations channels first, ``(1, C, 1, T)``, makes every projection a
1x1 convolution, and keeps no states (a state
write lowers to a scatter, which runs on the GPU): the host owns every history buffer, passes it in, and writes the
rows a call returns. These are the ops a family's ane forward is written with; everything here computes in the
activations' dtype (fp16 in a package) and stays finite there.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from convert.export.names import (
    HIDDEN_STATES,
    LOGITS,
)
from convert.export.quantized import QuantizedLinear, RowParts
from convert.export.spec import TensorSpec
from convert.fp16 import within
from manifests.identity import EMBEDDINGS_FILE

ANE_DIM_LIMIT = 65_536  # the ANE's largest dim (forge: an axis past it fails the compile of the whole package)
SMALLEST_PEAK = 2.0**-14  # fp16's smallest normal: an all-zero row is divided by this, not by 0
MASKED = -1e4  # a masked score: exp underflows to 0 in fp16 and fp32, and the sum of a few cannot overflow fp16


def rope_rows(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin [n, rotary_dim / 2] in fp32 at ``positions`` [n] (``inv_freq`` as transformers'
    ``compute_default_rope_parameters``): the stateful cores' tables (``register_positions``) and the rows the host
    passes the ane functions are this one computation."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    angles = positions.to(torch.int64).float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def host_work(rope_theta: float, rotary_dim: int, ladder=(), embedded: str | None = HIDDEN_STATES,
              first_row: int = 0) -> dict:
    """What every family's ane host contract adds for the host to do (``manifests.schema.HostContract``): the position
    inputs (``rope_rows``, ``history_mask_row`` from ``first_row``), the ladder's entries, the embedding lookup in the
    (target) bundle's table as the input ``embedded`` (none: the caller passes the rows) and the argmax of the
    logits."""
    work = {"positions": {"rope_theta": rope_theta, "rotary_dim": rotary_dim, "first_row": first_row},
            "ladder": list(ladder), "argmax": "host"}
    if embedded:
        work["embedding"] = {"input": embedded, "file": EMBEDDINGS_FILE}
    return work


def channels_first(rows: torch.Tensor) -> torch.Tensor:
    """Rows [T, C] -> [1, C, 1, T]."""
    return rows.transpose(0, 1)[None, :, None, :]


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """[1, C, 1, T] -> rows [T, C]."""
    return x[0, :, 0, :].transpose(0, 1)


def pointwise(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear`` as a 1x1 convolution: [1, I, 1, T] -> [1, O, 1, T], the weight [O, I, 1, 1] as the package stores
    it (a quantized weight's codes and tables, as ``QuantizedLinear.forward`` takes them). A linear that only ever
    computes in torch (a lean target's ``CodesLinear``, a compute copy's ``HalfLinear``) is called on the rows
    instead: the same product, with its own blocking."""
    if type(linear) is nn.Linear:
        weight, rotation = linear.weight, None
    elif type(linear) is QuantizedLinear:
        weight, rotation = linear.shipped_weight(), linear.rotation
    else:
        return channels_first(linear(rows_of(x)))
    if rotation is not None:  # a rotation acts on the input's channels: the last dim of its own layout
        x = rotation(x.transpose(1, 3)).transpose(1, 3)
    with within(linear):  # a device pass's range report names the product by its linear
        return nn.functional.conv2d(x, weight.to(x.dtype)[:, :, None, None], linear.bias)


def even_ranges(rows: int, most: int, align: int) -> list[tuple[int, int]]:
    """``rows`` in as few equal ranges of at most ``most`` rows (multiples of ``align`` but the last) as it takes."""
    most = most // align * align
    step = math.ceil(rows / math.ceil(rows / most) / align) * align
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def logits_ranges(vocab: int, align: int) -> list[tuple[int, int]]:
    """The vocabulary rows of each logits output of an ane head computed whole in one package (a drafter's): all of
    them up to ``ANE_DIM_LIMIT``, else as few equal parts within it (forge's heads are 8 parts of 31,040 rows),
    multiples of ``align`` rows (whole lut4 tables)."""
    return even_ranges(vocab, ANE_DIM_LIMIT, align)


def logits_names(ranges: list[tuple[int, int]]) -> list[str]:
    """The logits outputs of a head in ``ranges``: ``logits``, or ``logits_0``, ``logits_1``, ... (the host puts
    them side by side: the contract's ``logits_parts``)."""
    return [LOGITS] if len(ranges) == 1 else [f"logits_{k}" for k in range(len(ranges))]


def logits_parts(ranges: list[tuple[int, int]]) -> dict:
    """The host contract's ``logits_parts`` of a head in ``ranges`` (none for one range)."""
    return {} if len(ranges) == 1 else {"logits_parts": {name: list(rows) for name, rows in
                                                         zip(logits_names(ranges), ranges, strict=True)}}


def logits_specs(ranges: list[tuple[int, int]], width: int, dtype: str) -> list[TensorSpec]:
    """The logits outputs [1, width, rows] of a head in ``ranges`` (``logits_names``)."""
    return [TensorSpec(name, (1, width, hi - lo), dtype)
            for name, (lo, hi) in zip(logits_names(ranges), ranges, strict=True)]


def split_head(core: nn.Module, ranges: list[tuple[int, int]]) -> None:
    """``core.lm_head`` in ``ranges`` (``RowParts``), when there is more than one."""
    if len(ranges) > 1:
        core.lm_head = RowParts.split(core.lm_head, ranges)


def head_outputs(head: nn.Module, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits outputs [1, T, rows] of ``head`` over final-norm rows ``hidden`` [1, H, 1, T]: ``logits``, or one
    output per part of a head in row parts (``logits_names``), each part's 1x1 convolution its own."""
    if isinstance(head, RowParts):
        return {name: rows_of(pointwise(part, hidden))[None]
                for name, part in zip(logits_names(head.ranges), head.parts, strict=True)}
    return {LOGITS: rows_of(pointwise(head, hidden))[None]}


def rms_norm(norm: nn.Module, x: torch.Tensor, dim: int = 1, eps: float | None = None) -> torch.Tensor:
    """RMSNorm over ``dim`` in the activations' dtype, times ``norm.gain()`` (its weight, or 1 + weight for a
    zero-centred norm), finite in fp16: the values are divided by their largest
    magnitude first, so their squares stay within 1 (a hidden row of values near 300 has squares past fp16's 65504),
    and ``eps`` (``norm.eps`` unless given) is divided by that magnitude's square with them (the same quotient; as
    ``(sqrt(eps) / peak)^2``: the square of a small peak underflows fp16, and eps / 0 is inf)."""
    shape = [1] * x.dim()
    shape[dim] = -1
    normed = peak_normalised(x, dim, norm.eps if eps is None else eps, mean=True)
    return normed * norm.gain().to(x.dtype).reshape(shape)


def peak_normalised(x: torch.Tensor, dim: int, eps: float, mean: bool) -> torch.Tensor:
    """``x * rsqrt(mean (or sum) of x^2 over dim + eps)``, finite in fp16: ``x`` divided by its largest magnitude
    first and ``eps`` by that magnitude's square, as ``(sqrt(eps) / peak)^2`` (the same quotient)."""
    peak = torch.clamp(x.abs().amax(dim, keepdim=True), min=SMALLEST_PEAK)
    y = x / peak
    squares = y.pow(2).mean(dim, keepdim=True) if mean else y.pow(2).sum(dim, keepdim=True)
    return y * torch.rsqrt(squares + (eps**0.5 / peak).pow(2))


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU as ``x / (1 + exp(-x))``: the ANE's native silu has ~1e-3 absolute error near 0, and coremltools fuses
    ``x * sigmoid(x)`` back into that op (``mil_backend::fuse_activation_silu``); this form has no sigmoid to fuse.
    For x below about -11, fp16's exp(-x) overflows to inf and the quotient is -0, the right limit."""
    return x / (1.0 + torch.exp(-x))


def history_bias(history_mask: torch.Tensor, width: int) -> torch.Tensor:
    """The mask bias [history + T, T] of a call's keys (the history's rows, then the call's own rows) against its
    queries: the host's ``history_mask`` [1, history] (0 below the call's first position, ``MASKED`` at and past it:
    a rejected draft's rows, or rows not written yet; ``history_mask_row``) for every query, then the call's rows
    causally (a constant: the queries are the call's consecutive positions)."""
    dtype, device = history_mask.dtype, history_mask.device
    history = history_mask.transpose(0, 1) + torch.zeros(width, dtype=dtype, device=device)  # broadcast, no tile
    own = torch.triu(torch.full((width, width), MASKED, dtype=dtype, device=device), diagonal=1).transpose(0, 1)
    return torch.cat([history, own], dim=0)


def history_mask_row(first: int, rows: int, first_row: int = 0) -> np.ndarray:
    """The host's ``history_mask`` [1, rows] for a call whose first position is ``first``: 0 for the rows from
    ``first_row`` (an MTP head's history starts at row 1) below it (fp32; cast to the input's dtype, exact)."""
    row = np.arange(rows)
    return np.where((row >= first_row) & (row < first), 0.0, MASKED).astype(np.float32)[None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_history: torch.Tensor, value_history: torch.Tensor,
           bias: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Grouped-query attention of a call's queries over the host's history and the call's own rows, channels first.

    ``q`` [Hkv, G, d, T] (``shape``, given rather than read: a shape read in the graph is an ``int`` op Core ML's
    converter refuses; query head ``h = kv * G + g``, already scaled by ``d**-0.5``), ``k``, ``v`` [Hkv, d, T],
    ``key_history``, ``value_history`` [Hkv, rows, d], ``bias`` [rows + T, T]. Scores are keys by queries,
    [Hkv, rows + T, G * T], normalised over the keys (max-subtracted: finite in fp16); returns [1, Hkv * G * d, 1, T].
    """
    kv_heads, group, head_dim, width = shape
    queries = q.permute(0, 2, 1, 3).reshape(kv_heads, head_dim, group * width)
    keys = torch.cat([key_history.to(q.dtype), k.transpose(1, 2)], dim=1)  # [Hkv, rows + T, d]
    values = torch.cat([value_history.to(q.dtype), v.transpose(1, 2)], dim=1)
    scores = (keys @ queries).reshape(kv_heads, -1, group, width) + bias[:, None, :]  # broadcast: no tile
    probs = torch.softmax(scores, dim=1).reshape(kv_heads, -1, group * width)
    out = values.transpose(1, 2) @ probs  # [Hkv, d, G * T]
    return out.reshape(kv_heads, head_dim, group, width).permute(0, 2, 1, 3).reshape(1, -1, 1, width)
