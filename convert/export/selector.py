"""The DFlash2 candidate selector's greedy walk, which a host contract names (``contract["selector"]``): the stateful
draft computes it in its graph (``convert/models/dflash2/core.py``), the ane layout's host from the draft's outputs
(``convert.runtime.host.HostOwned.walk``), so it sits below both."""

from __future__ import annotations

import torch


def selector_scores(projected, unary, candidates, predecessors, predecessor_rows, successor_rows):
    """``unary + successor[cand] @ (predecessor[pred] * projected)`` with the codebooks' rows from the lookups."""
    context = predecessor_rows(predecessors) * projected
    return unary + (successor_rows(candidates) @ context.unsqueeze(-1)).squeeze(-1)


def selector_walk(projected, logits, anchor, top_k: int, predecessor_rows, successor_rows, rows: int | None = None):
    """The candidate selector's greedy walk from ``anchor`` [1] over the rows of ``projected`` [n, rank] (the hidden
    rows' projection) and ``logits`` [n, V]: ids [n], scores [n, k], candidates [n, k]. The stateful draft computes it
    in its graph; the ane layout's host computes it from the draft's outputs (``convert.runtime.host.HostOwned.walk``),
    with the codebooks' rows from the bundle's selector.safetensors. Unrolled (``rows``, default ``n``, a Python int
    never read from a shape in the graph), each step on [1, ...] slices."""
    unary, candidates = torch.topk(logits, top_k, dim=-1)
    predecessor, ids, scores = anchor, [], []
    for i in range(len(logits) if rows is None else rows):
        s = selector_scores(projected[i:i + 1], unary[i:i + 1], candidates[i:i + 1], predecessor, predecessor_rows,
                            successor_rows)
        predecessor = torch.gather(candidates[i:i + 1], 1, s.argmax(-1, keepdim=True))[:, 0]
        ids.append(predecessor)
        scores.append(s)
    return torch.cat(ids), torch.cat(scores), candidates
