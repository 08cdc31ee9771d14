"""lut4: 4-bit palettization with a 16-entry fp16 table per group of ``group_size`` consecutive output rows.

``fit_lut`` finds each group's table by exact weighted 1-D k-means over the group's unique fp16 values, weighted
by their counts (or by the summed importance of the weights holding them): the optimum for the (weighted) weight
MSE, as coremltools' kmeans1d path computes it, but for all groups at once as tensor operations (CPU or CUDA).

The optimum splits the n sorted unique values of a group into 16 intervals. With prefix sums of weight, weight x
value and weight x value^2 (float64; values centred and scaled per group), an interval's cost is O(1), and
``D_j(r)``, the least cost of the first r values in j intervals, is the dynamic programme
``D_j(r) = min_{m <= r} D_{j-1}(m) + cost(m, r)``. The interval cost obeys the quadrangle inequality, so the
best split m is monotone in r, and a layer is solved by divide and conquer: the middle row of every run of
unsolved rows is solved over the split range its solved neighbours allow. Those ranges tile the splits, so each
level of the recursion is one dense pass over the splits of all groups at once, and log2(n) levels make a layer:
O(k n log n) per group, no Python loop over rows, values or groups. Two things cut the work two- to threefold:
intervals 1..8 come from layers run from the left and 9..16 from the same layers run on the mirrored values
(both halves in one batch), joined where ``D_8(r) + D'_8(n - r)`` is least; and since ``D_j(r)`` grows with r
while the optimum's ``D_j(b_j)`` cannot exceed the cost of any 16-interval partition (a cheap one is found
first), each layer only solves, and only splits at, the rows within that budget.
"""

from __future__ import annotations

import bisect
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from quant.types import QuantizedWeight

ENTRIES = 16
_CODES = 1 << 16  # fp16 bit patterns
_TINY = 1e-20  # interval weight floor: keeps empty or underflowing intervals at cost 0 instead of 0/0
_OFFSET = 4.0  # > the range of a split's (normalised) cost, so a running minimum restarts at each range
# a chunk of groups holds about _CPU_CHUNK (cache-sized) or _CUDA_CHUNK distinct values, a group counting as its
# number of weights up to _DISTINCT (it seldom has more distinct fp16 values)
_CPU_CHUNK, _CUDA_CHUNK, _DISTINCT = 1 << 16, 1 << 24, 1 << 14
_AHEAD, _AHEAD_SLACK = 2, 64  # a layer first solves rows up to 2 x (previous layer's reach) + 64


def fit_lut(weight: torch.Tensor, group_size: int = 16, importance: torch.Tensor | None = None) -> torch.Tensor:
    """The weight-MSE-optimal 16-entry table of each group of ``group_size`` rows of ``weight`` [out, in].

    ``weight`` is rounded to fp16 first (the values the tables are fitted on). ``importance`` (``[in]``, e.g. the
    Hessian diagonal, or anything broadcastable to ``[out, in]``, non-negative) weights each weight's squared
    error. Returns fp16 [out // group_size, 16], each row ascending; a group with at most 16 unique values gets
    exactly those, the table padded by repeating its largest value.
    """
    _check(weight, group_size, importance)
    out, columns = weight.shape
    if importance is not None:
        importance = importance.to(weight.device).expand(out, columns)
    budget = _CUDA_CHUNK if weight.is_cuda else _CPU_CHUNK
    rows = max(1, budget // min(group_size * columns, _DISTINCT)) * group_size
    chunks = [
        (weight[i : i + rows], None if importance is None else importance[i : i + rows]) for i in range(0, out, rows)
    ]
    return torch.cat(_fit_chunks(chunks, group_size, weight.device)).half()


def _fit_chunks(chunks: list, group_size: int, device: torch.device) -> list[torch.Tensor]:
    """``_fit_groups`` of every chunk of rows. On CPU with n > 1 torch threads the chunks run side by side on n
    Python threads, each op single-threaded (torch's thread count is 1 meanwhile): the DP is many small ops,
    which parallelise better across chunks than within them, and intra-op threads stall when other processes
    share the cores."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or len(chunks) == 1:
        return [_fit_groups(*chunk, group_size) for chunk in chunks]
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(lambda chunk: _fit_groups(*chunk, group_size), chunks))
    finally:
        torch.set_num_threads(threads)


def round_lut(weight_columns: torch.Tensor, lut: torch.Tensor, group_size: int) -> torch.Tensor:
    """Index of the nearest entry of its row's table for each weight of ``weight_columns`` [out, k] (any columns).

    Exact: each weight is compared in float64 with the midpoints of its sorted table. A weight exactly halfway
    between two entries takes the smaller one; equal entries resolve to the lowest index. Returns uint8 [out, k].
    """
    out = weight_columns.shape[0]
    if lut.dim() != 2 or lut.shape[1] != ENTRIES or lut.shape[0] * group_size != out:
        raise ValueError(f"lut {list(lut.shape)} does not fit {out} rows in groups of {group_size}")
    table = lut.to(device=weight_columns.device, dtype=torch.float64)
    ascending, index = torch.sort(table, dim=1, stable=True)
    codes = index.gather(1, torch.searchsorted(ascending, ascending))  # equal entries: the lowest index
    midpoints = (ascending[:, 1:] + ascending[:, :-1]) / 2  # exact: fp16 sums fit float64
    values = weight_columns.to(torch.float64).reshape(lut.shape[0], -1)
    slots = torch.searchsorted(midpoints, values)  # how many midpoints lie below the weight
    return codes.gather(1, slots).view(weight_columns.shape).to(torch.uint8)


def quantize_lut(weight: torch.Tensor, group_size: int = 16, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """lut4 of ``weight`` [out, in]: ``fit_lut`` tables, then every weight to its nearest fp16 entry.

    ``stats["weight_mse"]`` is the mean squared error of the shipped (dequantized) weight against ``weight``.
    """
    lut = fit_lut(weight, group_size, importance)
    codes = round_lut(weight, lut, group_size)
    qw = QuantizedWeight("lut4", codes, group_size, lut=lut)
    qw.stats["weight_mse"] = float((qw.dequantize().float() - weight.float()).pow(2).mean())
    return qw


def _check(weight: torch.Tensor, group_size: int, importance: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"lut4 needs a 2-D weight, got shape {list(weight.shape)}")
    if group_size < 1 or weight.shape[0] % group_size:
        raise ValueError(f"lut4 group size {group_size} does not divide the {weight.shape[0]} output rows")
    if not bool(torch.isfinite(weight.half()).all()):
        raise ValueError("lut4: the weight has values that are non-finite in fp16")
    if importance is not None:
        try:
            torch.broadcast_shapes(importance.shape, weight.shape)
        except RuntimeError:
            raise ValueError(
                f"lut4 importance {list(importance.shape)} does not broadcast to the weight {list(weight.shape)}"
            ) from None
        if not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
            raise ValueError("lut4 importance must be finite and non-negative")


def _fp16_keys(weight: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns mapped to 0..65535 in the order of their values (-0 counted as +0), int64."""
    bits = (weight.half() + 0.0).view(torch.int16).to(torch.int64) & 0xFFFF  # + 0.0 turns -0 into +0
    return torch.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)


def _key_values(device: torch.device) -> torch.Tensor:
    """The float64 value of every key of ``_fp16_keys``."""
    keys = torch.arange(_CODES, device=device)
    bits = torch.where(keys >= 0x8000, keys - 0x8000, 0xFFFF - keys)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.float16).to(torch.float64)


def _unique(keys: torch.Tensor, masses: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's unique values, ascending, and their weights: [G, n] twice, padded with the group's largest
    value at zero weight; the number of unique values [G].

    A histogram over the fp16 codes the chunk uses (one ``bincount``), so no sort. Groups whose importance is
    all zero fall back to plain counts.
    """
    groups = keys.shape[0]
    low, high = torch.aminmax(keys)
    low, codes = int(low), int(high - low) + 1
    flat = (keys - low + torch.arange(groups, device=keys.device)[:, None] * codes).flatten()
    counts = torch.bincount(flat, minlength=groups * codes).view(groups, codes)
    present = counts > 0
    group, key = present.nonzero(as_tuple=True)
    mass = counts[group, key].to(torch.float64)
    if masses is not None:
        weighted = torch.bincount(flat, weights=masses.flatten(), minlength=groups * codes).view(groups, codes)
        mass = torch.where((masses.sum(1) > 0)[group], weighted[group, key], mass)
    sizes = present.sum(1)
    n = int(sizes.max())
    slot = present.cumsum(1)[group, key] - 1
    values = torch.zeros(groups, n, dtype=torch.float64, device=keys.device)
    weights = torch.zeros_like(values)
    values[group, slot] = _key_values(keys.device)[key + low]
    weights[group, slot] = mass
    slots = torch.arange(n, device=keys.device)
    values = torch.where(slots < sizes[:, None], values, values.gather(1, (sizes - 1)[:, None]))
    return values, weights, sizes


def _fit_groups(weight: torch.Tensor, importance: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """Tables (float64 [G, 16], ascending) of the groups of ``group_size`` rows of ``weight`` (a chunk of rows)."""
    groups = weight.shape[0] // group_size
    keys = _fp16_keys(weight).reshape(groups, -1)
    masses = None if importance is None else importance.to(torch.float64).reshape(groups, -1)
    values, weights, sizes = _unique(keys, masses)
    total = weights.sum(1, keepdim=True)
    mean = (weights * values).sum(1, keepdim=True) / total
    spread = ((weights * (values - mean).square()).sum(1, keepdim=True) / total).sqrt()
    spread = torch.where(spread > 0, spread, 1.0)
    scaled, weights = (values - mean) / spread, weights / total
    forward = _prefix_sums(scaled, weights)
    backward = _prefix_sums(-scaled.flip(1), weights.flip(1))  # the same values, mirrored
    both = tuple(torch.cat(pair) for pair in zip(forward, backward, strict=True))
    budget = _feasible_cost(scaled, forward, ENTRIES).repeat(2) * (1 + 1e-9) + 1e-12  # rounding slack
    mass, moment, _ = _interval_sums(forward, _kmeans(both, ENTRIES, budget))
    centroids = moment / mass.clamp_min(_TINY) * spread + mean
    # at most 16 unique values: the table is those values, padded with the largest
    exact = torch.nn.functional.pad(values, (0, max(0, ENTRIES - values.shape[1])))[:, :ENTRIES]
    largest = values.gather(1, (sizes - 1)[:, None])
    exact = torch.where(torch.arange(ENTRIES, device=values.device) < sizes[:, None], exact, largest)
    return torch.where((sizes <= ENTRIES)[:, None], exact, centroids).sort(dim=1).values


def _prefix_sums(values: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefix sums [G, n + 1] of weight, weight x value and weight x value^2 (float64), with a leading 0."""
    moment = weights * values
    sums = torch.stack((weights, moment, moment * values)).cumsum(2)
    sums = torch.nn.functional.pad(sums, (1, 0))
    return sums[0], sums[1], sums[2]


def _interval_sums(prefix, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weight, moment and second moment [G, k] of the intervals (bounds[:, i], bounds[:, i + 1]]."""
    starts, ends = bounds[:, :-1], bounds[:, 1:]
    return tuple(total.gather(1, ends) - total.gather(1, starts) for total in prefix)


def _feasible_cost(values: torch.Tensor, prefix, k: int, iterations: int = 8) -> torch.Tensor:
    """The cost [G] of a good k-partition, an upper bound on the optimum that prunes the DP (a looser bound only
    prunes less). Intervals of equal measure under density^(1/3) (the asymptotically optimal quantizer), then a
    few Lloyd iterations, each O(k log n) per group on the prefix sums."""
    w, s1, s2 = prefix
    groups, n = values.shape
    gaps = torch.diff(values, dim=1, append=values[:, -1:])
    gaps = (gaps + torch.nn.functional.pad(gaps[:, :-1], (1, 0))) / 2  # the value range each value stands for
    measure = torch.nn.functional.pad((torch.diff(w, dim=1) * gaps.square()).pow(1 / 3).cumsum(1), (1, 0))
    quantiles = torch.arange(1, k, dtype=w.dtype, device=w.device) / k * measure[:, -1:]
    cuts = torch.searchsorted(measure, quantiles.contiguous())
    ends = torch.full((groups, 1), n, device=w.device)
    for _ in range(iterations + 1):
        bounds = torch.cat((torch.zeros_like(ends), cuts, ends), 1)
        mass, moment, square = _interval_sums(prefix, bounds)
        centroids = moment / mass.clamp_min(_TINY)
        cuts = torch.searchsorted(values, ((centroids[:, 1:] + centroids[:, :-1]) / 2).contiguous()).cummax(1).values
    return (square - moment.square() / mass.clamp_min(_TINY)).sum(1)


def _kmeans(prefix, k: int, budget: torch.Tensor) -> torch.Tensor:
    """Boundaries [G, k + 1] (0 = b_0 <= ... <= b_k = n) of the optimal k intervals of each group.

    ``prefix`` holds 2G groups, G groups then the same G mirrored (reversed and negated), and ``budget`` [2G] an
    upper bound on each optimum. Intervals 1..k/2 come from the first half (DP layers from the left), the
    others from the mirrored half (layers from the right): the middle boundary r minimises
    ``D_{k/2}(r) + D'_{k/2}(n - r)``. As ``D_j(r)`` grows with r and the optimum's ``D_j(b_j)`` is within budget,
    each layer only needs the rows up to the last one within budget: it solves the rows up to ``_AHEAD`` x the
    previous layer's reach (all of them if that was not enough) over the splits within the previous layer's.
    """
    w, s1, s2 = prefix
    pairs, width = w.shape
    groups, n = pairs // 2, width - 1
    levels = _bisection_levels(prefix)
    rows = torch.arange(width, device=w.device)
    best = s2 - s1.square() / w.clamp_min(_TINY)  # D_1: everything so far in one interval
    splits = []
    for _ in range(k // 2 - 1):
        reach = int(torch.where(best <= budget[:, None], rows, 0).max()) + 1
        last = min(n, _AHEAD * reach + _AHEAD_SLACK)
        layer = _layer(best, prefix, levels, reach, last)
        if last < n and bool((layer[0][:, last] <= budget).any()):  # the rows beyond may be within budget too
            layer = _layer(best, prefix, levels, reach, n)
        best, split = layer
        splits.append(split)
    middle = (best[:groups] + best[groups:].flip(1)).argmin(1, keepdim=True)
    ends = [torch.cat((middle, n - middle))]
    for split in reversed(splits):
        ends.append(split.gather(1, ends[-1]))
    halves = torch.cat([torch.zeros_like(ends[0])] + ends[::-1], 1)  # [2G, k/2 + 1]
    return torch.cat((halves[:groups], (n - halves[groups:]).flip(1)[:, 1:]), 1)


def _cost(prefix, base: torch.Tensor, rows: tuple[torch.Tensor, ...], splits: torch.Tensor) -> torch.Tensor:
    """``D_{j-1}(m) + cost(m, r)`` [G, R] for splits m [G, R], given ``base = D_{j-1} - S2`` and the rows'
    prefix sums ``rows`` (three [G, R])."""
    w, s1, _ = prefix
    row_mass, row_moment, row_square = rows
    mass = (row_mass - w.gather(1, splits)).clamp_min_(_TINY)
    moment = row_moment - s1.gather(1, splits)
    return base.gather(1, splits).add_(row_square).sub_(moment.square_().div_(mass))


class _Level(NamedTuple):
    """The rows one level of the divide and conquer solves (ascending), and what ``_layer`` needs for them."""

    ascending: list[int]  # the rows, on the host
    rows: torch.Tensor  # [R]
    left: torch.Tensor  # [R], the solved row before each (0 or a row of an earlier level)
    right: torch.Tensor  # [R], the solved row after each (a row of an earlier level or the sentinel n + 1)
    ones: torch.Tensor  # [G, 2R], to count range ends
    offsets: torch.Tensor  # [G, 2R + 1]: -4 x segment number
    segment_mass: torch.Tensor  # [G, 2R + 1]: prefix weight of the row each segment is costed against
    segment_moment: torch.Tensor  # [G, 2R + 1]: its prefix moment
    row_sums: tuple[torch.Tensor, ...]  # three [G, R]: the rows' prefix sums


def _bisection_levels(prefix) -> list[_Level]:
    """Rows 1..n of the groups whose prefix sums are ``prefix``, in divide-and-conquer order, level by level.

    Row 0 (split 0) and a sentinel row n + 1 count as solved from the start. Segment 2t + 1 of a level holds
    row t's split range; the even segments are filler between ranges, costed against row n.
    """
    w, s1, s2 = prefix
    groups, width = w.shape
    n = width - 1
    levels = []
    left = torch.zeros(1, dtype=torch.long)
    right = torch.full((1,), n + 1, dtype=torch.long)
    while True:
        open_ = right - left >= 2
        left, right = left[open_], right[open_]
        if not len(left):
            return levels
        rows = (left + right) // 2
        segment_rows = torch.full((2 * len(rows) + 1,), n, dtype=torch.long)
        segment_rows[1::2] = rows
        on_device, segment_rows = rows.to(w.device), segment_rows.to(w.device)
        offsets = -_OFFSET * torch.arange(len(segment_rows), dtype=w.dtype, device=w.device)
        levels.append(
            _Level(
                ascending=rows.tolist(),
                rows=on_device,
                left=left.to(w.device),
                right=right.to(w.device),
                ones=torch.ones(groups, 2 * len(rows), dtype=torch.long, device=w.device),
                offsets=offsets.expand(groups, -1),
                segment_mass=w.index_select(1, segment_rows),
                segment_moment=s1.index_select(1, segment_rows),
                row_sums=tuple(total.index_select(1, on_device) for total in prefix),
            )
        )
        left, right = torch.stack((left, rows), 1).flatten(), torch.stack((rows, right), 1).flatten()


def _layer(
    previous: torch.Tensor, prefix, levels: list[_Level], within: int, last: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DP layer by divide and conquer: ``D_j`` [G, n + 1] and the best split of rows 0..last, among splits
    0..within - 1, from ``D_{j-1}``. Rows whose best split lies further get a costlier one (their ``D_j`` is then
    over budget and never used); rows past ``last`` are left at +inf.

    Per level, each row r being solved may split in [lo, hi] (its solved neighbours' splits, hi <= r). The
    ranges are ordered, so with filler between them they tile the splits: every split m is costed once,
    against the row of its range, and offset by -4 x (segment number) so that one running minimum (``cummin``)
    along m restarts in every segment; at the range's last split it gives the range's best (splits whose costs
    differ by less than the offset's rounding, ~1e-11 of the group's sum of squares, count as ties). The range
    end hi is costed apart (it may also open the next range) and the winner's cost is recomputed exactly.
    """
    w, s1, s2 = prefix
    groups, width = w.shape
    base = previous - s2
    best = torch.full_like(previous, float("inf"))
    best[:, 0] = 0
    split = torch.full((groups, width + 1), width, dtype=torch.long, device=w.device)  # unsolved: no bound
    split[:, 0] = 0
    for level in levels:
        count = bisect.bisect_right(level.ascending, last)
        if not count:
            continue
        rows, row_sums = level.rows[:count], tuple(total[:, :count] for total in level.row_sums)
        span = min(level.ascending[count - 1] + 1, within)
        lo = split.index_select(1, level.left[:count])
        hi = torch.minimum(split.index_select(1, level.right[:count]), rows.clamp_max(within - 1))
        # the segment of every split: how many range ends (lo_t, hi_t) are at or before it
        segment = torch.zeros_like(w[:, :span], dtype=torch.long)
        segment = segment.scatter_add_(1, torch.cat((lo, hi), 1), level.ones[:, : 2 * count]).cumsum(1)
        mass = level.segment_mass.gather(1, segment).sub_(w[:, :span]).clamp_min_(_TINY)
        moment = level.segment_moment.gather(1, segment).sub_(s1[:, :span])
        key = level.offsets.gather(1, segment).add_(base[:, :span]).addcmul_(moment, moment / mass, value=-1)
        candidate = key.cummin(1).indices.gather(1, (hi - 1).clamp_min(0))
        cost_candidate, cost_hi = _cost(prefix, base, row_sums, candidate), _cost(prefix, base, row_sums, hi)
        take = (hi > lo) & (cost_candidate <= cost_hi)
        best.index_copy_(1, rows, torch.where(take, cost_candidate, cost_hi))
        split.index_copy_(1, rows, torch.where(take, candidate, hi))
    return best, split[:, :width]
