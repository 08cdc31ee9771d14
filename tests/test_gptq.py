"""GPTQ: the sweep against a naive OBS reference, GPTQ vs round-to-nearest on held-out inputs, damping growth."""

import pytest
import torch

from quant.affine import fit_affine, quantize_affine, round_affine
from quant.gptq import (
    GPTQError,
    HessianAccumulator,
    LutRounder,
    gptq_quantize,
    gptq_quantize_shared,
    inverse_factor,
    output_error,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def correlated_inputs(features: int, tokens: int, seed: int) -> torch.Tensor:
    """Activations [tokens, features] with correlated features and uneven scales (as in a real layer)."""
    g = torch.Generator().manual_seed(1234)  # the same mixing for every draw: one "layer"
    mix = torch.randn(features, features, generator=g) / features**0.5
    gains = torch.rand(features, generator=g).pow(3) * 4 + 0.1
    z = torch.randn(tokens, features, generator=torch.Generator().manual_seed(seed))
    return (z @ mix + 0.2 * z) * gains


def weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return (0.02 * torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))).half()


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    return acc.hessian()


def held_out_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    return float(((w.float() - q.float()) @ x.T).pow(2).sum())


def test_hessian_accumulates_batch_by_batch():
    x = correlated_inputs(64, 300, seed=0)
    acc = HessianAccumulator(64)
    for chunk in (x[:100], x[100:250].reshape(5, 30, 64), x[250:]):
        acc.add(chunk)
    assert acc.count == 300
    torch.testing.assert_close(acc.hessian(), 2 * x.T @ x / 300, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="64 features fed inputs of shape"):
        acc.add(torch.zeros(3, 65))


def test_output_error_is_the_mean_squared_output_error_per_token():
    x = correlated_inputs(64, 500, seed=1)
    delta = torch.randn(16, 64)
    assert output_error(delta, hessian_of(x)) == pytest.approx(float((delta @ x.T).pow(2).sum()) / 500, rel=1e-4)


def naive_gptq_codes(w: torch.Tensor, h: torch.Tensor, group_size: int, act_order: bool) -> torch.Tensor:
    """Textbook OBS sweep in float64: explicit inverse Hessian, eliminated one column at a time, static groups.
    No Cholesky, no blocks, no lazy updates."""
    scale, zero = fit_affine(w, group_size)
    h = h.double() + 0.01 * h.diagonal().mean().double() * torch.eye(h.shape[0], dtype=torch.float64)
    order = list(range(h.shape[0]))
    if act_order:
        order = torch.sort(h.diagonal(), descending=True, stable=True).indices.tolist()
    inv = torch.linalg.inv(h)[order][:, order]
    work = w.double()[:, order].clone()
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for i, col in enumerate(order):
        c = round_affine(work[:, i : i + 1].float(), scale, zero, group_size, col)
        g = col // group_size
        q = ((c.half() - zero[:, g : g + 1].half()) * scale[:, g : g + 1]).double()
        err = (work[:, i : i + 1] - q) / inv[i, i]
        work[:, i + 1 :] -= err * inv[i : i + 1, i + 1 :]
        inv = inv - inv[:, i : i + 1] * inv[i : i + 1, :] / inv[i, i]
        codes[:, col] = c[:, 0]
    return codes


@pytest.mark.parametrize("block_size, act_order", [(16, True), (128, True), (256, True), (128, False)])
def test_sweep_matches_naive_obs_across_blocks(block_size, act_order):
    """Errors must reach every later column, within and across blocks (mlx-lm's GPTQ drops later groups')."""
    w = weight(32, 256, seed=2)
    h = hessian_of(correlated_inputs(256, 2048, seed=3))
    qw = gptq_quantize(w, h, "affine4", 32, block_size=block_size, act_order=act_order)
    naive = naive_gptq_codes(w, h, 32, act_order)
    assert (qw.codes == naive).float().mean() > 0.999  # fp32 vs fp64 may flip a code at a near-midpoint
    scale, zero = fit_affine(w, 32)
    assert torch.equal(qw.scale, scale) and torch.equal(qw.zero_point, zero)  # static groups: fitted on W


def test_affine4_gptq_beats_round_to_nearest_on_held_out_inputs():
    w = weight(128, 512, seed=4)
    h = hessian_of(correlated_inputs(512, 4096, seed=5))
    held_out = correlated_inputs(512, 4096, seed=6)
    qw = gptq_quantize(w, h, "affine4", 64, name="toy.down_proj")
    rtn = quantize_affine(w, 64)
    ratio = held_out_error(w, qw.dequantize(), held_out) / held_out_error(w, rtn.dequantize(), held_out)
    assert ratio < 0.6
    stats = qw.stats
    assert stats["gptq_output_error"] < 0.6 * stats["rtn_output_error"]
    assert stats["damping"] == 0.01 and stats["cholesky_retries"] == 0
    assert stats["rtn_output_error"] == pytest.approx(output_error(w.float() - rtn.dequantize().float(), h))


def test_lut4_gptq_beats_round_to_nearest_on_held_out_inputs():
    from quant.lut import quantize_lut

    w = weight(64, 256, seed=7)
    h = hessian_of(correlated_inputs(256, 2048, seed=8))
    held_out = correlated_inputs(256, 2048, seed=9)
    qw = gptq_quantize(w, h, "lut4", 16, weighted_lut=False, lut_refits=1, name="toy.down_proj")
    assert qw.method == "lut4" and qw.lut.shape == (4, 16) and qw.codes.dtype == torch.uint8
    rtn = quantize_lut(w, 16)
    ratio = held_out_error(w, qw.dequantize(), held_out) / held_out_error(w, rtn.dequantize(), held_out)
    assert ratio < 0.6
    assert qw.stats["gptq_output_error"] < qw.stats["rtn_output_error"]
    assert qw.stats["lut_refits_kept"] in (0, 1)


def test_lut_column_rounding_is_round_luts():
    """The sweep's prepared nearest-entry search gives round_lut's codes: midpoints, entries, duplicate entries."""
    from quant.lut import round_lut

    g = torch.Generator().manual_seed(16)
    lut = torch.randn(4, 16, generator=g).sort(dim=1).values.half()
    lut[1, 5:8] = lut[1, 5]  # duplicated entries
    lut[2] = lut[2].flip(0)  # not sorted
    rows = lut.repeat_interleave(8, dim=0).double()
    ordered = rows.sort(dim=1).values
    midpoints = (ordered[:, 1:] + ordered[:, :-1]) / 2
    columns = [torch.randn(32, 1, generator=g), ordered[:, 3:4], midpoints[:, 6:7], midpoints[:, 0:1] - 1e-9]
    columns = [c.contiguous() for c in columns]
    round_column = LutRounder(lut, 8)
    for w in columns:
        codes, values = round_column(w, 0)  # float64 here: ties exactly at the midpoints
        expected = round_lut(w, lut, 8)
        assert torch.equal(codes.to(torch.uint8), expected)
        assert torch.equal(values, rows.gather(1, expected.long()).float())


def test_dead_columns_are_zeroed_not_fatal():
    x = correlated_inputs(128, 1024, seed=10)
    x[:, 64:128] = 0  # one whole group never active
    w = weight(16, 128, seed=11)
    qw = gptq_quantize(w, hessian_of(x), "affine4", 64)
    assert qw.stats["dead_columns"] == 64
    assert torch.equal(qw.dequantize()[:, 64:], torch.zeros(16, 64, dtype=torch.float16))


def test_failed_cholesky_raises_the_damping_and_records_it(monkeypatch):
    w, h = weight(16, 128, seed=12), hessian_of(correlated_inputs(128, 1024, seed=13))
    real, calls = torch.linalg.cholesky, []

    def fail_first(a, upper=False):
        calls.append(upper)
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("linalg.cholesky: The factorization could not be completed")
        return real(a, upper=upper)

    monkeypatch.setattr(torch.linalg, "cholesky", fail_first)
    qw = gptq_quantize(w, h, "affine4", 64)
    assert qw.stats["cholesky_retries"] == 1 and qw.stats["damping"] == pytest.approx(0.1)


def test_indefinite_hessian_grows_the_damping_until_it_factors():
    x = correlated_inputs(128, 64, seed=14)  # 64 tokens for 128 features: singular
    h = hessian_of(x)
    h -= 0.3 * h.diagonal().mean() * torch.eye(128)  # indefinite: needs damping above 0.3 / 0.7 x mean diag
    qw = gptq_quantize(weight(16, 128, seed=15), h, "affine4", 64)
    assert qw.stats["damping"] == pytest.approx(1.0) and qw.stats["cholesky_retries"] == 2


def test_hopeless_hessian_raises_naming_the_layer():
    h = -torch.eye(128)
    with pytest.raises(GPTQError, match="model.layers.3.mlp.up_proj: the Hessian"):
        gptq_quantize(weight(16, 128), h, "affine4", 64, name="model.layers.3.mlp.up_proj")


def test_refuses_mismatched_shapes_and_methods():
    with pytest.raises(ValueError, match=r"layer: weight \[16, 128\] and Hessian \[64, 64\] do not match"):
        gptq_quantize(weight(16, 128), torch.eye(64), "affine4", 64, name="layer")
    with pytest.raises(ValueError, match="unknown method"):
        gptq_quantize(weight(16, 128), torch.eye(128), "int3", 64)


def _plain_inverse_factor(matrix: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, float, int]:
    """The inverse factor of an already arranged Hessian the plain way (a damped copy per try, every intermediate
    kept): what ``inverse_factor`` computed before it made its matrices afresh and let each go."""
    mean_diag, relative = float(matrix.diagonal().mean()), percdamp
    for retry in range(10):
        damped = matrix.clone()
        damped.diagonal().add_(relative * mean_diag)
        try:
            factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
            return factor, relative, retry
        except torch.linalg.LinAlgError:
            relative *= 10
    raise AssertionError("no damping factored it")


@pytest.mark.parametrize("act_order", [True, False])
def test_the_inverse_factor_arranged_in_place_is_the_plain_ones_bit_for_bit(act_order):
    x = correlated_inputs(128, 64, seed=16)  # singular, with dead columns, shifted indefinite: it takes retries
    x[:, 100:116] = 0  # dead, and placed elsewhere by the order (a one on the diagonal sorts mid-way)
    h = hessian_of(x)
    live = h.diagonal() != 0
    h.diagonal()[live] -= 0.3 * float(h.diagonal()[live].mean())
    arranged = h.clone()
    dead = arranged.diagonal() == 0
    arranged.diagonal()[dead] = 1.0
    order = torch.sort(arranged.diagonal(), descending=True, stable=True).indices if act_order else None
    if order is not None:
        assert not torch.equal(dead[order], dead)
        arranged = arranged[order][:, order]
    factor, damping, retries = inverse_factor(h, 0.01, "layer", order, dead)
    plain, plain_damping, plain_retries = _plain_inverse_factor(arranged, 0.01)
    assert retries == plain_retries >= 1 and damping == plain_damping
    assert torch.equal(factor, plain)


@pytest.mark.parametrize("method, group_size, act_order, lut_refits", [
    ("affine4", 32, True, 0), ("affine4", 32, False, 0), ("lut4", 16, True, 0), ("lut4", 16, True, 2)])
def test_the_stacked_sweep_gives_each_weight_its_own_sweeps_codes(method, group_size, act_order, lut_refits):
    """``gptq_quantize_shared`` (the linears that read one input, stacked into one sweep) gives each weight exactly
    what ``gptq_quantize`` gives it alone: codes, scales and zero points or tables, bit for bit; across several
    blocks (their lazy updates), with a dead column, lut4 refits decided per weight. (bench/gptq_stacked.py checks
    the same at the 27B widths on a GPU.)"""
    x = correlated_inputs(96, 512, seed=20)
    x[:, 5] = 0  # a dead column
    hessian = hessian_of(x)
    weights = [weight(rows, 96, seed=21 + k) for k, rows in enumerate((48, 16, 32))]
    options = {"block_size": 32, "act_order": act_order, "lut_refits": lut_refits}
    stacked = gptq_quantize_shared(weights, hessian, method, group_size, **options)
    assert len(stacked) == len(weights)
    for w, shared in zip(weights, stacked, strict=True):
        alone = gptq_quantize(w, hessian, method, group_size, **options)
        for field in ("codes", "scale", "zero_point", "lut"):
            a, b = getattr(alone, field), getattr(shared, field)
            assert (a is None) == (b is None), field
            assert a is None or torch.equal(a, b), field
        assert shared.codes.shape == w.shape
        assert shared.stats["lut_refits_kept"] == alone.stats["lut_refits_kept"]
