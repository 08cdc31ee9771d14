"""Qwen3.5: the gated delta rule in fp32 chunks (the WY form) and the device-safe forms of its activations."""

from __future__ import annotations

from dataclasses import dataclass, fields
from math import ceil, log2

import torch

from convert.export.ane import peak_normalised
from convert.models.qwen3_5.config import CHUNK


def softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus as ``relu(x) + log1p(exp(-|x|))``: never exponentiates a large argument (fp16's exp(x) overflows
    above 11, and the ANE's native softplus returns 0 there)."""
    return torch.relu(x) + torch.log1p(torch.exp(-x.abs()))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` (the FLA form): ``x * rsqrt(sum x^2 + eps)``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def scaled_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``l2norm`` finite in fp16: the values divided by their largest magnitude first (the squares of a row of 128
    values near 30 sum past 65504), ``eps`` by its square with them (the same quotient, as ``(sqrt(eps) / peak)^2``:
    a zero row's peak squared underflows fp16)."""
    return peak_normalised(x, -1, eps, mean=False)


def causal_conv(window: torch.Tensor, weight: torch.Tensor, channels: int) -> torch.Tensor:
    """Depthwise causal conv: ``window`` [K-1+S, C] (history, then the S new rows), ``weight`` [C, 1, K] -> [S, C];
    row t is ``sum_j weight[:, 0, j] * window[t + j]``, transformers' ``F.conv1d`` over [history | rows], one op."""
    return torch.nn.functional.conv1d(window.T[None], weight, groups=channels)[0].T


def unit_lower_inverse(a: torch.Tensor, masks: ChunkMasks) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``a`` [..., C, C] (C = ``masks.size``): with N = -A nilpotent
    (N^C = 0) the inverse is sum_m N^m = prod_j (I + N^(2^j)), j < ceil(log2 C): 2 ceil(log2 C) - 2 matmuls of C x C
    where a row-by-row solve takes C - 1 dependent steps."""
    n = -a
    inverse = masks.eye.to(a.dtype) + n
    for _ in range(1, ceil(log2(masks.size))):
        n = n @ n
        inverse = inverse + inverse @ n
    return inverse


@dataclass(frozen=True)
class ChunkMasks:
    """Constants of a chunk of C > 1 rows, bool [C, C] (so a module's ``.to(dtype)`` leaves them alone): strictly
    lower and lower-with-diagonal masks, and the identity."""

    size: int
    strict: torch.Tensor
    lower: torch.Tensor
    eye: torch.Tensor

    @classmethod
    def of(cls, size: int) -> ChunkMasks:
        lower = torch.ones(size, size, dtype=torch.bool).tril()
        return cls(size, lower.tril(-1), lower, torch.eye(size, dtype=torch.bool))

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(ChunkMasks) if f.name != "size")


def delta_rule_chunk(state, q, k, v, g, beta, masks: ChunkMasks | None):
    """One chunk of the gated delta rule in WY form, fp32, head-major: ``state`` [H, dk, dv]; ``q`` (None when only
    the state is wanted) and ``k`` [H, C, dk]; ``v`` [H, C, dv]; ``g`` (log decay) and ``beta`` [H, C]; ``masks``
    None for a single row (the recurrence itself), else the chunk's ``ChunkMasks``.

    Returns (outputs [H, C, dv] or None, the state after the chunk): the C steps of ``S <- e^g S;
    delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q`` (tests/test_qwen3_5.py compares them). With
    G_i = g_1 + ... + g_i and T = (I + A)^-1, A_ij = beta_i e^(G_i - G_j) k_i . k_j (j < i):
    Delta = T (beta (V - e^G K S)), O = e^G Q S + (Q K^T . e^(G_i - G_j), j <= i) Delta,
    S' = e^(G_C) S + (K e^(G_C - G))^T Delta.
    """
    if masks is None:
        decayed = state * torch.exp(g)[:, :, None]
        delta = beta[:, :, None] * (v - k @ decayed)
        state = decayed + k.transpose(1, 2) @ delta
        return (None if q is None else q @ state), state
    # masks as 0 / 1 factors, the running sum as a masked sum: no cumsum or select, and no product with a constant
    # (Core ML makes it a linear layer), which the ane layout's programs hold none of (convert/verify/placement.py)
    lower, strict = masks.lower.to(g.dtype), masks.strict.to(g.dtype)
    cumulative = (g[:, None, :] * lower).sum(-1)  # [H, C]: G_i
    # G_i - G_j as the sum of the rows between (j, i], not as the difference of the two running sums: that difference
    # carries their rounding, which in fp16 is 1/32 where they pass 32 (a decay over a chunk of 64 rows does), so the
    # near-diagonal decays, the largest, were off by up to 3% (docs/fp16.md, the hazards table)
    between = torch.relu(lower[:, None, :] - lower[None, :, :])  # [C, C, C]: 1 where row m lies in (j, i]
    gaps = (g[:, None, None, :] * between).sum(-1)  # [H, C, C]
    decay = torch.exp(gaps + (lower - 1.0) * 1e4)  # e^(G_i - G_j) for j <= i, else 0
    system = beta[:, :, None] * (k @ k.transpose(1, 2)) * decay * strict
    from_start = torch.exp(cumulative)[:, :, None]  # e^(G_i)
    delta = unit_lower_inverse(system, masks) @ (beta[:, :, None] * (v - from_start * (k @ state)))
    outputs = None if q is None else from_start * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ delta
    last = cumulative[:, -1:]  # [H, 1]
    state = torch.exp(last)[:, :, None] * state + (k * decay[:, -1, :, None]).transpose(1, 2) @ delta  # e^(G_C - G_j)
    return outputs, state


def chunk_sizes(widths) -> set[int]:
    """The sizes (> 1) of the chunks ``delta_rule`` cuts calls of these widths into."""
    return {min(CHUNK, w - start) for w in widths for start in range(0, w, CHUNK)} - {1}


def delta_rule(state, q, k, v, g, beta, rows: int, masks):
    """The gated delta rule over ``rows`` rows in chunks of at most ``CHUNK`` (``delta_rule_chunk``); row-major
    inputs ``q``/``k`` [rows, H, dk], ``v`` [rows, H, dv], ``g``/``beta`` [rows, H]; ``masks(size)`` gives a chunk's
    ``ChunkMasks``."""
    outputs = []
    for start in range(0, rows, CHUNK):
        end = min(rows, start + CHUNK)
        part = [None if t is None else t[start:end].transpose(0, 1) for t in (q, k, v, g, beta)]
        out, state = delta_rule_chunk(state, *part, masks(end - start))
        if out is not None:
            outputs.append(out.transpose(0, 1))
    return (torch.cat(outputs) if outputs else None), state
