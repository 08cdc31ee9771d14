"""affine4: round-to-nearest int4 with an fp16 scale and an integer zero point per group of input columns.

The shipped arithmetic is ``w = scale * (code - zero_point)`` in fp16 (``QuantizedWeight.dequantize``; Core AI
and Core ML both store exactly that, through ``constexpr_blockwise_shift_scale``).

Rounding rule (MLX's grid, in the shift-scale form). For each group, let ``lo = min(w, 0)``, ``hi = max(w, 0)``
and ``edge`` the one of larger magnitude (``hi`` on a tie, as in MLX). The grid has 16 levels 15 steps apart,
one end at the edge, and zero on a level:

    n = round(|edge| / ((hi - lo) / 15))      # steps from zero to the edge, 8..15
    scale = fp16(|edge| / n)
    zero_point = n if edge < 0 else 15 - n    # the edge sits on code 0 or code 15

This is ``mx.quantize``'s affine grid (MLX: ``scale = edge / round(edge / scale0)``, ``bias = edge``), so in
exact arithmetic both pick the same levels, with two differences forced by the package op, which has no bias
and multiplies an fp16 scale by the integer ``code - zero_point``:

- Zero is always inside the range. An integer offset must have the codes' own type (coremltools
  ``constexpr_blockwise_shift_scale``: "if dtype is not fp16 or fp32, it must be the same as SrcT", uint4), so
  ``0 <= zero_point <= 15``. MLX uses ``[min, max]`` even when a group has one sign (its zero then lies off the
  16 codes); with 32-128 weights per group that is rare, and costs a finer step only there.
- Zero is exact: ``code == zero_point`` dequantizes to 0 bit for bit (MLX's zero is ``edge + q * scale``,
  rounded), so zero weights and GPTQ's zeroed dead columns stay exactly zero. The edge is ``fp16(scale * n)``:
  exact where some fp16 scale gives it (92-98% of groups on Gaussian, Student-t and the fixture's weights; the
  nearest fp16 scale is used, trying its neighbours would add under 0.01% of groups), otherwise within about
  one fp16 ulp. MLX stores the edge itself as the bias, which a shift-scale package cannot.

As in MLX, ``n`` is rounded to nearest, so the far end of the range may fall outside the grid by up to one step
(``15 (n - a) / a <= 1`` step for ``a = |edge| / scale0 >= 7.5``); weights there clip to code 0 or 15. Keeping
every weight within half a step (``n <= 31 a / 30``) costs 2-7% weight MSE on the same data; plain min/max with
a rounded zero point is within 1% of this rule either way.

An all-zero group gets scale 1 and zero point 8 (every code 8 is exactly zero). ``round_affine`` picks
``clamp(round(w / scale) + zero_point, 0, 15)``, the nearest level in exact arithmetic; the fp16 rounding of
the product can only change that choice within half an fp16 ulp of a midpoint.
"""

from __future__ import annotations

import torch

from quant.types import QuantizedWeight

GROUP_SIZES = (32, 64, 128)
LEVELS = 15  # codes 0..15


def check_group_size(shape: tuple[int, ...], group_size: int) -> None:
    """Refuse a group size other than 32/64/128, or one that does not divide the input width, naming the shape."""
    if len(shape) != 2:
        raise ValueError(f"affine4 quantizes 2-D weights [out, in]; got shape {list(shape)}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"affine4 group size must be one of {GROUP_SIZES}, got {group_size} (weight {list(shape)})")
    if shape[1] % group_size:
        raise ValueError(
            f"affine4 group size {group_size} does not divide the input width {shape[1]} of weight {list(shape)}"
        )


def fit_affine(weight: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Group parameters for ``weight`` [out, in]: scale fp16 [out, in/g] and zero_point uint8 [out, in/g]."""
    check_group_size(tuple(weight.shape), group_size)
    out, inp = weight.shape
    groups = weight.detach().float().reshape(out, inp // group_size, group_size)
    if not torch.isfinite(groups).all():
        raise ValueError(f"affine4: weight {list(weight.shape)} holds non-finite values")
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    negative = -lo > hi
    edge = torch.where(negative, -lo, hi)
    empty = edge == 0
    steps = torch.round(edge / ((hi - lo) / LEVELS).masked_fill(empty, 1.0))
    steps = steps.masked_fill(empty, 1.0)
    scale = (edge / steps).masked_fill(empty, 1.0).to(torch.float16)
    zero_point = torch.where(negative, steps, LEVELS - steps).masked_fill(empty, 8)
    return scale, zero_point.to(torch.uint8)


def round_affine(
    weight_columns: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int, col_start: int
) -> torch.Tensor:
    """Nearest codes (uint8 [out, k], 0..15) for columns ``col_start .. col_start + k - 1`` of the weight.

    ``scale``/``zero_point`` are the whole weight's group parameters [out, in/g], in any float/int dtype (GPTQ
    passes fp32 copies so the per-column call converts nothing).
    """
    k = weight_columns.shape[1]
    first, last = col_start // group_size, (col_start + k - 1) // group_size
    s = scale[:, first : last + 1].float()
    z = zero_point[:, first : last + 1].float()
    if last > first:
        offset = col_start - first * group_size
        s = s.repeat_interleave(group_size, dim=1)[:, offset : offset + k]
        z = z.repeat_interleave(group_size, dim=1)[:, offset : offset + k]
    codes = torch.round(weight_columns.float() / s).add_(z).clamp_(0, LEVELS)
    return codes.to(torch.uint8)


def quantize_affine(weight: torch.Tensor, group_size: int = 64) -> QuantizedWeight:
    """Round-to-nearest affine4 of ``weight`` [out, in] with groups of ``group_size`` input columns."""
    scale, zero_point = fit_affine(weight, group_size)
    codes = round_affine(weight, scale, zero_point, group_size, 0)
    qw = QuantizedWeight("affine4", codes, group_size, scale=scale, zero_point=zero_point)
    qw.stats["weight_mse"] = float((qw.dequantize().float() - weight.float()).pow(2).mean())
    return qw
