"""GPTQ (Frantar et al.; IST-DASLab/gptq ``gptq.py``) for affine4 and lut4, through each format's fit/round split.

The group parameters are fitted once on the whole (dead-column-zeroed) weight before the sweep ("static groups"),
so act-order, which visits columns by descending Hessian diagonal, never changes which columns share a group.
The sweep rounds one column at a time to the nearest code under those parameters and spreads the output error
over the columns not yet rounded: inside a block of 128 columns eagerly, to the later blocks lazily with one
matrix product per block (the reference's lazy batch update, where every block's accumulated error reaches
every later column).

Damping starts at ``percdamp`` x mean(diag H) and grows x10 on a failed Cholesky; the factor used and the number
of retries are recorded in the stats. After ``MAX_DAMPING_TRIES`` failures it raises, naming the layer: there is
no silent fall back to round-to-nearest.

Output errors in the stats are mean squared output errors per calibration token,
``||(W - Q) X||^2 / n = trace((W - Q) H (W - Q)^T) / 2`` with ``H = 2 X X^T / n``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from quant.affine import check_group_size, fit_affine, round_affine
from quant.lut import fit_lut, round_lut
from quant.types import Method, QuantizedWeight

BLOCK_SIZE = 128
PERCDAMP = 0.01
DAMPING_GROWTH = 10.0
MAX_DAMPING_TRIES = 5  # 0.01, 0.1, 1, 10, 100 x mean(diag H)
CUDA_GRAPHS = True  # the sweep replays a captured block on CUDA (bench/gptq_stacked.py compares it with eager)


class ColumnRounder(Protocol):
    """Rounds the sweep's columns one block at a time: ``load`` takes the original indices of a block's columns (in
    sweep order), then a call takes the column at position ``i`` of that block, weight [out, 1] fp32, and returns its
    codes [out, 1] (an integer dtype) and shipped values. ``load`` copies what the calls read into fixed buffers, so
    a block's calls can be captured once as a CUDA graph and replayed for every block."""

    def load(self, columns: Sequence[int]) -> None: ...

    def __call__(self, w: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class GPTQError(RuntimeError):
    """GPTQ cannot quantize this layer (Hessian not positive definite even with the largest damping)."""


class HessianAccumulator:
    """``H = 2 X X^T / n`` over calibration inputs fed batch by batch, summed in fp32.

    fp16/bf16 inputs on CUDA are multiplied as they are with an fp32 result (``torch.mm(..., out_dtype=)``):
    the products of 11-bit significands are exact and the sums are fp32, as with fp32 inputs, at tensor-core
    speed. Other inputs are converted to fp32 first.
    """

    def __init__(self, features: int, device: torch.device | str | None = None):
        self.features = features
        self.sum = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Add inputs ``x`` [..., features] (every leading index is one token)."""
        if x.shape[-1] != self.features:
            raise ValueError(f"Hessian of {self.features} features fed inputs of shape {list(x.shape)}")
        x = x.detach().reshape(-1, self.features).to(self.sum.device)
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            self.sum += torch.mm(x.T, x, out_dtype=torch.float32)
        else:
            x = x.float()
            self.sum.addmm_(x.T, x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if not self.count:
            raise ValueError("no calibration inputs were added to this Hessian")
        return self.sum * (2.0 / self.count)


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """Mean squared output error per calibration token of a weight error ``delta`` [out, in]."""
    delta = delta.float()
    return float(((delta @ hessian.float()) * delta).sum() / 2)


def inverse_factor(hessian: torch.Tensor, percdamp: float, name: str, order: torch.Tensor | None = None,
                   dead: torch.Tensor | None = None) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of ``(H + damp I)^-1``, with the relative damping used and the retries it took. ``H`` is
    ``hessian`` with its rows and columns in ``order`` (default as they are) and a one on the diagonal where ``dead``
    (its zero diagonal entries, in ``hessian``'s order) is set.

    Each try makes ``H`` afresh from ``hessian`` and lets go of each matrix once the next is made, so at most three
    matrices of ``hessian``'s size are held with it: at the 27B drafters' fc (25600 inputs, 2.6 GB a matrix) the
    caller's permuted copy, its damped copy, the lower factor and the inverse were all held at once with it.

    Raises ``GPTQError`` naming ``name`` when even the largest damping leaves it not positive definite.
    """
    def arranged() -> torch.Tensor:
        matrix = hessian.clone() if order is None else hessian[order[:, None], order]
        if dead is not None:
            matrix.diagonal()[dead if order is None else dead[order]] = 1.0
        return matrix

    damped = arranged()
    mean_diag = float(damped.diagonal().mean())
    relative = percdamp
    for retry in range(MAX_DAMPING_TRIES):
        damped = arranged() if damped is None else damped
        damped.diagonal().add_(relative * mean_diag)
        factor = None
        try:
            lower = torch.linalg.cholesky(damped)
            damped = None
            inverse = torch.cholesky_inverse(lower)
            del lower
            factor = torch.linalg.cholesky(inverse, upper=True)
            del inverse
        except torch.linalg.LinAlgError:
            factor = None
        if factor is not None and bool(torch.isfinite(factor).all()):
            return factor, relative, retry
        damped = None  # the next try makes it again, from the caller's Hessian
        relative *= DAMPING_GROWTH
    raise GPTQError(
        f"{name}: the Hessian {list(hessian.shape)} is not positive definite even with damping "
        f"{relative / DAMPING_GROWTH:g} x mean(diag H) (mean diag {mean_diag:.3g}, {MAX_DAMPING_TRIES} tries)"
    )


def sweep(weight: torch.Tensor, factor: torch.Tensor, rounder: ColumnRounder, order: Sequence[int], block_size: int):
    """The GPTQ column sweep over ``weight`` [out, in] (permuted, fp32), updated in place.

    ``factor`` is the upper Cholesky factor of the inverse Hessian with each row divided by its diagonal entry:
    a column's rounding error ``w - q`` times its row is its update of the later columns (and turns the column
    itself into ``q``). Per column the loop issues the rounder's kernels and three more: the part of GPTQ that
    launch overhead dominates on a GPU, so there a full block's column loop is captured once as a CUDA graph over
    fixed buffers and replayed for every full block (the same kernels on the same values: the same bits).

    Returns the codes [out, in] in the same (permuted) column order; ``weight`` ends holding, for every column,
    the error-compensated values that were rounded (what a LUT refit is fitted on).
    """
    out, columns = weight.shape
    codes = torch.empty(out, columns, dtype=torch.uint8, device=weight.device)
    block = torch.empty(out, block_size, dtype=weight.dtype, device=weight.device)
    errors, block_codes = torch.empty_like(block), torch.empty_like(codes[:, :block_size])
    rows = torch.empty(block_size, block_size, dtype=factor.dtype, device=factor.device)
    replay = None
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        width = i2 - i1
        given = (weight[:, i1:i2], factor[i1:i2, i1:i2], order[i1:i2])
        _fill(block, rows, rounder, *given)
        if width < block_size or not (weight.is_cuda and CUDA_GRAPHS):
            _sweep_block(block[:, :width], errors[:, :width], block_codes[:, :width], rows[:width, :width], rounder)
        else:
            if replay is None:  # the capture's warm-up ran on the buffers: fill them again
                replay = _captured(lambda: _sweep_block(block, errors, block_codes, rows, rounder))
                _fill(block, rows, rounder, *given)
            replay()
        codes[:, i1:i2] = block_codes[:, :width]
        weight[:, i1:i2] = block[:, :width] + errors[:, :width]
        weight[:, i2:].addmm_(errors[:, :width], factor[i1:i2, i2:], alpha=-1)
    return codes


def _fill(block: torch.Tensor, rows: torch.Tensor, rounder: ColumnRounder, columns: torch.Tensor,
          factor: torch.Tensor, order: Sequence[int]) -> None:
    """The sweep's fixed buffers for one block: its columns, its rows of the factor, its columns' rounding tables."""
    width = columns.shape[1]
    block[:, :width].copy_(columns)
    rows[:width, :width].copy_(factor)
    rounder.load(order)


def _sweep_block(block: torch.Tensor, errors: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor,
                 rounder: ColumnRounder) -> None:
    """One block's columns in order: round, record the error, spread it over the block's later columns."""
    block_columns, error_columns = block.split(1, dim=1), errors.split(1, dim=1)
    code_columns, factor_rows = codes.split(1, dim=1), rows.split(1, dim=0)
    for i in range(block.shape[1]):
        column_codes, q = rounder(block_columns[i], i)
        code_columns[i].copy_(column_codes)
        torch.sub(block_columns[i], q, out=error_columns[i])
        block.addmm_(error_columns[i], factor_rows[i], alpha=-1)


def _captured(run) -> Callable[[], None]:
    """``run`` captured as a CUDA graph (after a warm-up on a side stream, as capture needs); returns its replay.
    The warm-up computes on the buffers: the caller fills them again before replaying."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


class AffineRounder:
    """Nearest affine4 code of each weight under its column's group scale and zero point (``round_affine``'s
    arithmetic), and the shipped fp16 value ``(code - zero_point) * scale``."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, group_size: int, block_size: int = BLOCK_SIZE):
        self.group_size = group_size
        self.tables = (scale.float(), zero_point.float(), scale.half(), zero_point.half())
        self.buffers = tuple(t.new_empty(t.shape[0], block_size) for t in self.tables)
        self.columns = [tuple(b[:, i : i + 1] for b in self.buffers) for i in range(block_size)]

    def load(self, columns: Sequence[int]) -> None:
        groups = torch.tensor([c // self.group_size for c in columns], device=self.tables[0].device)
        for table, buffer in zip(self.tables, self.buffers, strict=True):
            buffer[:, : len(columns)].copy_(table.index_select(1, groups))

    def __call__(self, w: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale32, zero32, scale16, zero16 = self.columns[i]
        codes = round_affine(w, scale32, zero32, 1, 0)  # the column's own scale and zero point: a group of one
        return codes, (codes - zero16).mul_(scale16)  # the shipped fp16 arithmetic


class LutRounder:
    """Nearest entry of each row's table, as ``round_lut`` picks it, in four kernels per column.

    ``round_lut`` prepares the sorted table on every call, which per column of the sweep would be most of its
    kernel launches (lut4 GPTQ of 5120x17408 took 5.9 s on an H200 that way). So it is prepared here once: the
    entries of every row ascending, the midpoints between them (exact in float64), and for every sorted slot the
    code ``round_lut`` itself gives that entry (the lowest index among equal entries).
    A weight takes the slot of the midpoints below it, so one exactly halfway takes the smaller entry, as in
    ``round_lut`` (``tests/test_gptq.py`` checks the two agree). Every column reads the same tables.
    """

    def __init__(self, lut: torch.Tensor, group_size: int):
        ordered = lut.double().repeat_interleave(group_size, dim=0).sort(dim=1).values  # [out, 16]
        self.midpoints = ((ordered[:, 1:] + ordered[:, :-1]) / 2).contiguous()
        self.slot_codes = round_lut(ordered, lut, group_size)
        self.slot_values = ordered.float()

    def load(self, columns: Sequence[int]) -> None:
        pass

    def __call__(self, w: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.searchsorted(self.midpoints, w.double())
        return self.slot_codes.gather(1, slots), self.slot_values.gather(1, slots)


def fit_params(method: Method, weight: torch.Tensor, group_size: int, importance: torch.Tensor | None) -> dict:
    """The format's group parameters, as ``QuantizedWeight`` keywords (``importance`` [in]: lut4 only)."""
    if method == "affine4":
        scale, zero_point = fit_affine(weight, group_size)
        return {"scale": scale, "zero_point": zero_point}

    return {"lut": fit_lut(weight, group_size, importance=importance)}


def make_rounder(method: Method, params: dict, group_size: int, block_size: int) -> ColumnRounder:
    if method == "affine4":
        return AffineRounder(params["scale"], params["zero_point"], group_size, block_size)
    return LutRounder(params["lut"], group_size)


def round_to_nearest(method: Method, weight: torch.Tensor, params: dict, group_size: int) -> torch.Tensor:
    if method == "affine4":
        return round_affine(weight, params["scale"], params["zero_point"], group_size, 0)

    return round_lut(weight, params["lut"], group_size)


def check_shapes(weight: torch.Tensor, hessian: torch.Tensor, method: str, group_size: int, name: str) -> None:
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"{name}: weight {list(weight.shape)} and Hessian {list(hessian.shape)} do not match")
    if method == "affine4":
        check_group_size(tuple(weight.shape), group_size)
    elif method == "lut4":
        if group_size < 1 or weight.shape[0] % group_size:
            raise ValueError(f"{name}: lut4 group size {group_size} does not divide the {weight.shape[0]} rows")
    else:
        raise ValueError(f"{name}: unknown method {method!r} (affine4 or lut4)")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    method: Method,
    group_size: int,
    *,
    block_size: int = BLOCK_SIZE,
    act_order: bool = True,
    percdamp: float = PERCDAMP,
    weighted_lut: bool = True,
    lut_refits: int = 0,
    name: str = "weight",
) -> QuantizedWeight:
    """GPTQ-quantize ``weight`` [out, in] under ``hessian`` [in, in] (``H = 2 X X^T / n``, fp32).

    Runs on ``weight``'s device. ``group_size`` is in input columns for affine4, in output rows for lut4.
    lut4: the LUT is fitted before the sweep, weighted by the Hessian diagonal unless ``weighted_lut`` is off;
    then up to ``lut_refits`` times it is refitted (weighted by diag H) on the values the sweep rounded and the
    sweep is run again, kept while the output error falls. ``name`` (the layer) is used in errors.
    """
    return gptq_quantize_shared([weight], hessian, method, group_size, block_size=block_size, act_order=act_order,
                                percdamp=percdamp, weighted_lut=weighted_lut, lut_refits=lut_refits,
                                names=[name])[0]


def gptq_quantize_shared(
    weights: Sequence[torch.Tensor],
    hessian: torch.Tensor,
    method: Method,
    group_size: int,
    *,
    block_size: int = BLOCK_SIZE,
    act_order: bool = True,
    percdamp: float = PERCDAMP,
    weighted_lut: bool = True,
    lut_refits: int = 0,
    names: Sequence[str] | None = None,
) -> list[QuantizedWeight]:
    """``gptq_quantize`` of each of ``weights``, linears that read one input and so share ``hessian`` (q/k/v,
    gate/up, a GDN's in_proj_qkv/z), in one sweep over their rows stacked.

    GPTQ treats the rows of a weight independently (the column order, the damping and the inverse factor come from
    the Hessian alone; affine4's groups and lut4's tables are row-local), so the stacked sweep computes each
    weight's codes as its own sweep would, with one set of per-column kernels for all of them: the sweep is bound by
    launches on a GPU. lut4 refits are decided per weight, as in their own runs.
    """
    names = list(names or [f"weight{k}" for k in range(len(weights))])
    for weight, name in zip(weights, names, strict=True):
        check_shapes(weight, hessian, method, group_size, name)
    device = weights[0].device
    rows = [w.shape[0] for w in weights]
    original = torch.cat([w.detach().float() for w in weights])
    hessian = hessian.detach().to(device=device, dtype=torch.float32)
    dead = hessian.diagonal() == 0
    work_w = original.clone()
    work_w[:, dead] = 0.0

    params = fit_params(method, work_w, group_size, hessian.diagonal() if weighted_lut else None)

    if act_order:
        diagonal = hessian.diagonal().clone()
        diagonal[dead] = 1.0
        perm = torch.sort(diagonal, descending=True, stable=True).indices
    else:
        perm = torch.arange(work_w.shape[1], device=device)
    factor, damping, retries = inverse_factor(hessian, percdamp, ", ".join(names), perm if act_order else None, dead)
    factor /= factor.diagonal().clone()[:, None]
    order, inverse_perm = perm.tolist(), torch.argsort(perm)

    def split(tensor: torch.Tensor, per_row: int = 1) -> tuple[torch.Tensor, ...]:
        return tensor.split([r // per_row for r in rows])

    def parts(params: dict) -> list[dict]:
        return [dict(zip(params, values, strict=True)) for values in zip(
            *(split(v, group_size if k == "lut" else 1) for k, v in params.items()), strict=True)]

    def run(params: dict) -> list[tuple[QuantizedWeight, torch.Tensor, float]]:
        targets = work_w[:, perm]
        codes = sweep(targets, factor, make_rounder(method, params, group_size, block_size), order, block_size)
        results = []
        for c, t, w, own in zip(split(codes[:, inverse_perm]), split(targets[:, inverse_perm]), split(original),
                                parts(params), strict=True):
            qw = QuantizedWeight(method, c, group_size, **own)
            results.append((qw, t, output_error(w - qw.dequantize(), hessian)))
        return results

    best = run(params)
    kept, active = [0] * len(weights), [True] * len(weights)
    for _ in range(lut_refits if method == "lut4" else 0):
        targets = torch.cat([t for _, t, _ in best])
        candidates = run(fit_params(method, targets, group_size, hessian.diagonal()))
        for k, candidate in enumerate(candidates):
            if active[k] and candidate[2] < best[k][2]:
                best[k], kept[k] = candidate, kept[k] + 1
            else:
                active[k] = False
        if not any(active):
            break

    results = []
    for (qw, _, error), w, own, refits in zip(best, split(original), parts(params), kept, strict=True):
        rtn = QuantizedWeight(method, round_to_nearest(method, w, own, group_size), group_size, **own)
        rtn_error = output_error(w - rtn.dequantize(), hessian)
        qw.stats.update(
            {
                "gptq_output_error": error,
                "rtn_output_error": rtn_error,
                "error_ratio": error / rtn_error if rtn_error else None,
                "weight_mse": float((qw.dequantize().float() - w).pow(2).mean()),
                "damping": damping,
                "cholesky_retries": retries,
                "dead_columns": int(dead.sum()),
                "act_order": act_order,
                "block_size": block_size,
                "lut_refits_kept": refits,
            }
        )
        results.append(qw)
    return results
