"""lut4 (quant/lut.py): exact codebooks, nearest-entry rounding, the shipped format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quant import lut
from quant.lut import ENTRIES, fit_lut, quantize_lut, round_lut


def exact_kmeans(values: np.ndarray, weights: np.ndarray, k: int = ENTRIES) -> tuple[float, np.ndarray]:
    """Independent reference: optimal weighted 1-D k-means by the plain O(k n^2) DP over the unique values.

    Returns the optimal weighted squared error and the centroids of the optimal intervals (float64).
    """
    x, inverse = np.unique(values, return_inverse=True)
    w = np.bincount(inverse, weights=weights)
    n = len(x)
    cw = np.concatenate([[0.0], np.cumsum(w)])
    c1 = np.concatenate([[0.0], np.cumsum(w * x)])
    c2 = np.concatenate([[0.0], np.cumsum(w * x * x)])

    def cost(m: np.ndarray, r: int) -> np.ndarray:  # intervals (m, r]
        mass = cw[r] - cw[m]
        moment = c1[r] - c1[m]
        return c2[r] - c2[m] - np.divide(moment**2, mass, out=np.zeros_like(mass), where=mass > 0)

    best = np.full((k + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    split = np.zeros((k + 1, n + 1), dtype=int)
    for j in range(1, k + 1):
        for r in range(n + 1):
            candidates = best[j - 1, : r + 1] + cost(np.arange(r + 1), r)
            split[j, r] = int(np.argmin(candidates))
            best[j, r] = candidates[split[j, r]]
    centroids, r = [], n
    for j in range(k, 0, -1):
        m = split[j, r]
        if cw[r] > cw[m]:
            centroids.append((c1[r] - c1[m]) / (cw[r] - cw[m]))
        r = m
    return float(best[k, n]), np.sort(np.array(centroids))


def nearest_error(values: np.ndarray, weights: np.ndarray, table: np.ndarray) -> float:
    return float((weights * np.min((values[:, None] - table[None, :]) ** 2, axis=1)).sum())


def groups_of(weight: torch.Tensor, importance: torch.Tensor | None, group_size: int):
    """(values, weights) of each group of rows: fp16 values as float64, importance per weight (or 1)."""
    values = weight.half().double().numpy()
    mass = np.ones_like(values) if importance is None else np.broadcast_to(importance.double().numpy(), values.shape)
    for g in range(weight.shape[0] // group_size):
        rows = slice(g * group_size, (g + 1) * group_size)
        yield values[rows].ravel(), np.asarray(mass[rows]).ravel()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
def test_tables_are_the_exact_optimum(seed, weighted):
    generator = torch.Generator().manual_seed(seed)
    group_size, columns = 3, 20 + 6 * seed
    weight = torch.randn(2 * group_size, columns, generator=generator) * 0.05
    importance = None
    if weighted:
        importance = torch.rand(columns, generator=generator).square()
        importance[::5] = 0  # dead columns: their weights do not count
    tables = fit_lut(weight, group_size, importance)
    assert tables.dtype == torch.float16 and tables.shape == (2, ENTRIES)
    for table, (values, mass) in zip(tables, groups_of(weight, importance, group_size), strict=True):
        optimum, centroids = exact_kmeans(values, mass)
        assert len(centroids) == ENTRIES
        # the same optimal intervals: the centroids agree, so their fp16 roundings do too
        assert torch.equal(table, torch.from_numpy(centroids).half())
        fitted = nearest_error(values, mass, table.double().numpy())
        assert optimum <= fitted * (1 + 1e-12) and fitted <= optimum * (1 + 1e-3)


def test_exact_when_a_layer_must_solve_all_rows(monkeypatch):
    monkeypatch.setattr(lut, "_AHEAD", 0)  # every layer first solves too few rows, then all of them
    monkeypatch.setattr(lut, "_AHEAD_SLACK", 0)
    generator = torch.Generator().manual_seed(13)
    weight = torch.randn(4, 80, generator=generator).pow(3) * 0.01  # heavy tails
    importance = torch.rand(80, generator=generator)
    (values, mass), *_ = groups_of(weight, importance, 4)
    _, centroids = exact_kmeans(values, mass)
    assert torch.equal(fit_lut(weight, 4, importance)[0], torch.from_numpy(centroids).half())


def test_chunks_on_threads_match_one_chunk(monkeypatch):
    generator = torch.Generator().manual_seed(17)
    weight = torch.randn(64, 40, generator=generator) * 0.05
    whole = fit_lut(weight, 4)
    monkeypatch.setattr(lut, "_CPU_CHUNK", 4 * 40 * 3)  # 3 groups a chunk, on torch's threads
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(fit_lut(weight, 4), whole)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)


def test_few_unique_values_are_kept_exactly():
    generator = torch.Generator().manual_seed(7)
    palette = torch.tensor([-0.5, -0.25, 0.0, 0.125, 1.0, 3.0, -2.0])
    weight = palette[torch.randint(0, len(palette), (8, 30), generator=generator)]
    weight[4:] = torch.arange(16, dtype=torch.float32).repeat(4, 2)[:, :30] / 8  # exactly 16 unique values
    weight[0, 0] = -0.0  # the same value as +0
    tables = fit_lut(weight, 4)
    assert torch.equal(tables[0], torch.cat([palette.sort().values, palette.max().repeat(9)]).half())
    assert torch.equal(tables[1], (torch.arange(16) / 8).half())
    assert quantize_lut(weight, 4).stats["weight_mse"] == 0.0


def test_per_tensor_and_fp32_input_round_the_original_weight():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(4, 50, generator=generator) * 0.1
    qw = quantize_lut(weight, group_size=4)
    assert qw.lut.shape == (1, ENTRIES)
    _, centroids = exact_kmeans(weight.half().double().numpy().ravel(), np.ones(200))
    assert torch.equal(qw.lut[0], torch.from_numpy(centroids).half())
    # the codes are nearest to the fp32 weight itself, not to its fp16 rounding
    distances = (weight.double()[..., None] - qw.lut[0].double()).abs()
    assert torch.equal(qw.codes.long(), distances.argmin(-1))


def test_round_lut_takes_the_nearest_entry():
    generator = torch.Generator().manual_seed(11)
    lut = (torch.randn(3, ENTRIES, generator=generator) * 0.1).half()  # unsorted
    lut[1, 9] = lut[1, 2]  # a duplicate: the lower index wins
    weight = torch.randn(6, 200, generator=generator) * 0.15
    codes = round_lut(weight, lut, 2)
    assert codes.dtype == torch.uint8 and codes.shape == weight.shape
    rows = lut.double().repeat_interleave(2, dim=0)
    expected = (weight.double()[..., None] - rows[:, None, :]).abs().argmin(-1)  # first of equal distances
    assert torch.equal(codes.long(), expected)
    assert torch.equal(round_lut(weight[:, 17:19], lut, 2), codes[:, 17:19])  # column-agnostic


def test_round_lut_ties():
    lut = torch.tensor([[2.0, 0.0, 1.0, 1.0] + [8.0] * 12]).half()
    weight = torch.tensor([[0.5, 1.0, 1.5, 100.0, -3.0]])
    assert round_lut(weight, lut, 1).tolist() == [[1, 2, 2, 4, 1]]  # halfway takes the smaller entry


def test_quantize_lut_ships_what_it_reports():
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(32, 96, generator=generator) * 0.02).half()
    qw = quantize_lut(weight, group_size=8)
    assert qw.method == "lut4" and qw.codes.dtype == torch.uint8 and int(qw.codes.max()) < ENTRIES
    dense = qw.dequantize()
    assert dense.dtype == torch.float16
    assert torch.equal(dense, qw.lut[torch.arange(32)[:, None] // 8, qw.codes.long()])
    assert qw.stats["weight_mse"] == pytest.approx(float((dense.float() - weight.float()).pow(2).mean()), rel=1e-12)
    assert qw.bits_per_weight == pytest.approx(4 + 256 / (8 * 96))


def test_no_worse_than_coremltools_kmeans():
    quantization_utils = pytest.importorskip("coremltools.models.neural_network.quantization_utils")
    generator = torch.Generator().manual_seed(9)
    weight = (torch.randn(32, 80, generator=generator) * 0.02).half()
    ours = quantize_lut(weight, group_size=8)
    theirs = []
    for group in weight.view(4, -1).numpy():  # what palettize_weights(mode="kmeans") does per group
        table, codes = quantization_utils._get_kmeans_lookup_table_and_weight(4, group, force_kmeans1d=True)
        theirs.append(torch.from_numpy(table.astype(np.float16))[torch.from_numpy(codes.astype(np.int64))])
        assert torch.equal(ours.lut[len(theirs) - 1], torch.from_numpy(np.sort(table)).half())
    theirs_mse = float((torch.cat(theirs).float() - weight.float().flatten()).pow(2).mean())
    assert ours.stats["weight_mse"] <= theirs_mse


@pytest.mark.parametrize(
    "weight, group_size, importance, message",
    [
        (torch.zeros(4), 2, None, "2-D"),
        (torch.zeros(6, 3), 4, None, "does not divide"),
        (torch.full((4, 3), float("nan")), 2, None, "non-finite"),
        (torch.full((4, 3), 1e6), 2, None, "non-finite"),
        (torch.zeros(4, 3), 2, torch.ones(5), "does not broadcast"),
        (torch.zeros(4, 3), 2, -torch.ones(3), "non-negative"),
    ],
)
def test_bad_input(weight, group_size, importance, message):
    with pytest.raises(ValueError, match=message):
        fit_lut(weight, group_size, importance)
