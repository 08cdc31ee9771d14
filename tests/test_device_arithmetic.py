"""The devices' arithmetic (``convert/fp16.py``, docs/fp16.md "Device modes"): the ANE's datapath reproduces the
published M1 measurements, the GPU's is fp16 storage with an fp32 accumulator, and ``Peaks`` names what computed a
value."""

import math

import pytest
import torch
from torch import nn

from convert.fp16 import (
    FP16_MAX,
    PORT_LIMIT,
    Peaks,
    ane_accumulate,
    ane_tiles,
    ane_tiles_spelled_out,
    device_arithmetic,
    noted_output,
    within,
)

HALF = torch.float16


def reduce(values: list[float], device: str = "ane") -> float:
    """``values`` summed the way the published probes sum them: a matmul against a ones vector, in fp16."""
    a = torch.tensor([values], dtype=HALF)
    with device_arithmetic(device):
        return (a @ torch.ones(len(values), 1, dtype=HALF)).item()


def test_ane_sums_sixteen_thousand_ones_exactly():
    # an fp16 running sum stalls at 2048; the ANE's wide accumulator does not
    assert reduce([1.0] * 16_000) == 16_000.0


def test_ane_rounds_the_tile_that_holds_4096():
    # published: 5116, between an fp16 running sum's 4096 and the exact 5120: the tile [4096, 1, 1, 1] loses its ones
    assert reduce([4096.0] + [1.0] * 1024) == 5116.0
    assert reduce([4096.0] + [1.0] * 1024, "gpu") == 5120.0  # the GPU's fp32 accumulator, one rounding


TIES = pytest.mark.xfail(strict=True, reason=(
    "at fp16 spacing 2 every in-tile add of a one is an exact tie: M1 keeps all 16 ones there, while round-half-even "
    "partials keep 4 (3000) or 28 (4090); no order of the four lanes reproduces it (docs/fp16.md)"))


@pytest.mark.parametrize("magnitude, survivors", [
    (1024, 16), pytest.param(3000, 16, marks=TIES), pytest.param(4090, 16, marks=TIES),
    (4096, 4), (8000, 4), (16000, 4), (30000, 4)])
def test_ane_cancellation_sweep_keeps_four_survivors_from_4096(magnitude, survivors):
    # published (M1): [B, -B, 1] x 16 keeps 16 ones below 4096 and exactly 4 from 4096 on, whichever the order
    b = float(magnitude)
    assert reduce([b, -b, 1.0] * 16) == survivors
    assert reduce([b, 1.0, -b] * 16) == survivors


def test_ane_port_saturates_past_32768():
    assert reduce([16384.0, 16384.0]) == PORT_LIMIT  # at the port's limit: kept
    assert reduce([20000.0, 20000.0]) == math.inf  # past it
    assert reduce([-20000.0, -20000.0]) == -math.inf
    assert reduce([20000.0, 20000.0], "gpu") == 40000.0  # the GPU stores it: inside fp16
    assert reduce([40000.0, 40000.0], "gpu") == math.inf  # past fp16's 65504


def test_ane_accumulate_is_its_spelled_out_form_bit_for_bit():
    # large values beside small ones and cancellations, a batch, and an inner size that is no multiple of four
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(3, 5, 37, generator=g) * torch.tensor([1.0, 300.0, 1e-3]).repeat(13)[:37]).half()
    b = (torch.randn(3, 37, 9, generator=g) * 4).half()
    b[:, 1] = -b[:, 0]
    tiles, spelled = ane_tiles(a, b), ane_tiles_spelled_out(a, b)
    assert tiles.dtype == HALF and torch.equal(tiles.float(), spelled)
    # the tiles summed in fp32 (the device's order of that sum is not known: any fp32 order, one rounding apart)
    assert torch.allclose(ane_accumulate(a, b), spelled.double().sum(-3).float(), rtol=1e-6, atol=1e-3)
    assert not torch.equal(ane_accumulate(a, b), a.float() @ b.float())  # the tiles' roundings are there


def test_linear_and_pointwise_convolution_are_the_same_product():
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(24, 6).half()
    x = (torch.randn(5, 24, generator=g) * 30).half()
    with device_arithmetic("ane"):
        rows = linear(x)
        conv = nn.functional.conv2d(x.T[None, :, None, :], linear.weight[:, :, None, None], linear.bias)
    assert torch.equal(rows, conv[0, :, 0, :].T)
    want = (ane_accumulate(x, linear.weight.T).half() + linear.bias)
    assert torch.equal(rows, want)


def test_depthwise_conv1d_sums_its_taps_in_one_tile():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, 6, 10, generator=g) * 50).half()
    w = torch.randn(6, 1, 4, generator=g).half()
    with device_arithmetic("ane"):
        got = nn.functional.conv1d(x, w, padding=3, groups=6)
    windows = nn.functional.pad(x, (3, 3)).unfold(-1, 4, 1)  # [1, 6, 13, 4]
    want = torch.stack([ane_tiles_spelled_out(windows[0, c], w[c, 0, :, None])[0, :, 0] for c in range(6)])[None]
    want = want.half()
    assert torch.equal(got, want)


def test_an_unmodelled_convolution_is_refused():
    with device_arithmetic("ane"), pytest.raises(NotImplementedError, match="not modelled"):
        nn.functional.conv2d(torch.ones(1, 4, 5, 5, dtype=HALF), torch.ones(2, 4, 3, 3, dtype=HALF))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return x + self.down(self.up(x))


@pytest.mark.parametrize("hold", [False, True], ids=["read-at-once", "held-until-read"])
def test_peaks_name_the_module_that_computed_each_value(hold):
    """Read at once (the CPU's) or held as tensors until read (an accelerator's: ``Peaks.hold``), the same peaks."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).half()
    with torch.no_grad():
        model[1].up.weight.mul_(1000.0)
    peaks = Peaks(only=HALF, hold=hold, m=model)
    x = torch.ones(2, 8, dtype=HALF)
    with torch.no_grad(), device_arithmetic("ane", peaks):
        model(x)
        with within(model[0].down):  # code that computes with a module's weights without its forward
            product = x @ model[0].down.weight.T[:8]
        noted_output(model[0], torch.full((2, 8), 77.0, dtype=HALF))
    assert peaks.peaks[("m.1.up", "port")] > 100 * peaks.peaks[("m.0.up", "port")]
    assert ("m.1", "output") in peaks.peaks and peaks.peaks[("m.0", "output")] == 77.0
    # the port holds the accumulator, before the output's rounding to fp16 (half a unit in its last place apart)
    assert peaks.peaks[("m.0.down", "port")] >= float(product.abs().max()) * (1 - 2**-11)
    assert all(kind in Peaks.KINDS for _, kind in peaks.peaks)


@pytest.mark.parametrize("hold", [False, True], ids=["read-at-once", "held-until-read"])
def test_peaks_count_values_past_fp16(hold):
    peaks = Peaks(only=HALF, hold=hold, m=nn.Identity())
    peaks.note("output", torch.tensor([1.0, FP16_MAX, math.inf, -math.inf], dtype=HALF), "x")
    peaks.note("output", torch.tensor([2.0, math.nan], dtype=HALF), "x")
    peaks.note("output", torch.tensor([3.0], dtype=HALF), "y")
    assert peaks.peaks == {("x", "output"): FP16_MAX, ("y", "output"): 3.0}
    assert peaks.nonfinite == {("x", "output"): 3}
