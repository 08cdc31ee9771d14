"""affine4 round-to-nearest: codes, shipped fp16 arithmetic, error bounds, exact zero, MLX's grid, refusals."""

import numpy as np
import pytest
import torch

from quant.affine import fit_affine, quantize_affine, round_affine
from quant.types import QuantizedWeight


def student_t_weight(out=64, inp=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) / torch.rand(out, inp, generator=g).add(0.05).sqrt()
    return (0.02 * w).half()


def expand(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return t.repeat_interleave(group_size, dim=1)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_codes_and_dequantize_are_the_shipped_fp16_arithmetic(group_size):
    w = student_t_weight()
    qw = quantize_affine(w, group_size)
    assert qw.codes.dtype == torch.uint8 and qw.codes.shape == w.shape
    assert int(qw.codes.max()) <= 15
    assert qw.scale.dtype == torch.float16 and qw.zero_point.dtype == torch.uint8
    assert qw.scale.shape == qw.zero_point.shape == (64, 256 // group_size)
    assert int(qw.zero_point.max()) <= 15
    # independent fp16 arithmetic (numpy): scale * (code - zero_point), one rounding
    codes = qw.codes.numpy().astype(np.float16)
    zero = expand(qw.zero_point, group_size).numpy().astype(np.float16)
    scale = expand(qw.scale, group_size).numpy()
    expected = scale * (codes - zero)
    assert expected.dtype == np.float16
    assert np.array_equal(qw.dequantize().numpy().view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_error_within_half_a_step_inside_the_grid_and_one_step_at_its_far_end(group_size):
    w = student_t_weight(seed=1)
    qw = quantize_affine(w, group_size)
    w64, q64 = w.double().numpy(), qw.dequantize().double().numpy()
    scale = expand(qw.scale, group_size).double().numpy()
    zero = expand(qw.zero_point, group_size).double().numpy()
    err = np.abs(w64 - q64)
    half_ulp = np.spacing(np.abs(q64).astype(np.float16)).astype(np.float64) / 2
    inside = (w64 >= scale * (0 - zero)) & (w64 <= scale * (15 - zero))
    assert inside.mean() > 0.95  # outside: the far end's extreme weight of some groups
    assert np.all(err[inside] <= scale[inside] / 2 * (1 + 1e-6) + half_ulp[inside])
    assert np.all(err <= scale * 1.01 + half_ulp)


def test_zero_is_exact_and_the_larger_edge_is_kept():
    w = student_t_weight(seed=2)
    w[:, ::7] = 0
    qw = quantize_affine(w, 64)
    deq = qw.dequantize()
    assert torch.equal(deq[w == 0], torch.zeros_like(deq[w == 0]))
    codes_at_zero = expand(qw.zero_point, 64)  # every group's zero point dequantizes to exactly 0
    zeros = QuantizedWeight("affine4", codes_at_zero, 64, scale=qw.scale, zero_point=qw.zero_point).dequantize()
    assert torch.equal(zeros, torch.zeros_like(deq))
    groups, deq_groups = w.float().reshape(64, 4, 64), deq.float().reshape(64, 4, 64)
    edge_index = groups.abs().argmax(-1, keepdim=True)
    edge, edge_q = groups.gather(-1, edge_index), deq_groups.gather(-1, edge_index)
    assert (edge == edge_q).float().mean() > 0.85  # exact in most groups
    ulp = torch.from_numpy(np.spacing(edge.abs().half().numpy()).astype(np.float32))
    assert torch.all((edge - edge_q).abs() <= ulp)  # within one fp16 ulp everywhere


def mlx_affine_levels(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mx.quantize's affine rule, written from its definition, in float64 (no fp16 rounding).

    Returns the levels [out, in] and, per weight, whether its group's step count is a near tie (a = x.5)."""
    g = w.double().reshape(w.shape[0], -1, group_size)
    w_min, w_max = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    mask = w_min.abs() > w_max.abs()
    scales = ((w_max - w_min) / 15).clamp(min=1e-7)
    scales = torch.where(mask, scales, -scales)
    edge = torch.where(mask, w_min, w_max)
    ratio = edge / scales
    q0 = torch.round(ratio)
    scales = torch.where(q0 != 0, edge / q0, scales)
    codes = torch.round((g - edge) / scales).clamp(0, 15)
    tie = ((ratio.abs() % 1) - 0.5).abs() < 1e-3
    return (edge + scales * codes).reshape(w.shape), tie.expand_as(g).reshape(w.shape)


def test_levels_match_mlx_affine_grid():
    w = torch.randn(128, 512, generator=torch.Generator().manual_seed(3)).half()  # every group has both signs
    for group_size in (32, 64, 128):
        ours = quantize_affine(w, group_size).dequantize().double()
        mlx, tie = mlx_affine_levels(w, group_size)
        step = expand(fit_affine(w, group_size)[0], group_size).double()
        assert ((ours - mlx).abs() <= 0.02 * step).float().mean() > 0.995
        # elsewhere: a code midpoint (w / scale = x.5) that the two round-half-even rules break the other way
        # (MLX's codes run downwards from a positive edge), or a tie in the step count itself
        ours_err, mlx_err = (w.double() - ours).abs(), (w.double() - mlx).abs()
        assert torch.all((ours_err <= mlx_err + 0.02 * step)[~tie])


def test_round_affine_columns_match_whole_matrix_rounding():
    w = student_t_weight(seed=4)
    scale, zero = fit_affine(w, 32)
    whole = round_affine(w, scale, zero, 32, 0)
    for start, k in ((0, 1), (31, 2), (40, 70), (255, 1)):
        assert torch.equal(round_affine(w[:, start : start + k], scale, zero, 32, start), whole[:, start : start + k])
    assert torch.equal(round_affine(w[:, 5:9], scale.float(), zero.float(), 32, 5), whole[:, 5:9])


def test_all_zero_group_and_fp32_input():
    w = student_t_weight(seed=5).float()
    w[3, 64:128] = 0
    qw = quantize_affine(w, 64)
    assert torch.equal(qw.dequantize()[3, 64:128], torch.zeros(64, dtype=torch.float16))
    assert torch.isfinite(qw.scale.float()).all()


@pytest.mark.parametrize(
    "shape, group_size, message",
    [
        ((64, 256), 16, "must be one of"),
        ((64, 256), 48, "must be one of"),
        ((64, 96), 64, "does not divide the input width 96 of weight [64, 96]"),
        ((256,), 64, "2-D weights"),
    ],
)
def test_refuses_bad_group_sizes_naming_the_shape(shape, group_size, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        quantize_affine(torch.zeros(shape), group_size)
