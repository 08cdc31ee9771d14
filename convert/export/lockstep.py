"""Sessions run in step over shared weights: each block of a weight made once for every session that needs it.

The drafter stage runs one target (and one drafter) over many prompts. Held as its codes (``CodesLinear``), or as fp16
weights computing in fp32 (``HalfLinear``), a linear makes its dense weight a block of rows at a time at every call,
and at the 27B width making it is most of a target call (``bench/lean_target.py``). ``in_step`` runs one callable per
session, each in a thread of its own. A blocked linear called in one of them waits until every running session waits
at a linear; then the largest group waiting at one linear is computed: each block of rows made once, and each
session's product taken with it as the session's own call alone takes it (the same GEMM of the same rows), so every
session's outputs are bit for bit those it computes alone.

One group computes at a time and nothing else runs meanwhile; between meetings the sessions run at once, each on its
own states (the linears' workspaces are a thread's own: ``export.quantized._workspace``). The schedule does not
depend on thread timing: which group computes next depends only on where the sessions wait.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")
Rows = Callable[[int, int], torch.Tensor]

_CURRENT = threading.local()


def blocked_products(inputs: Sequence[torch.Tensor], blocks: list[tuple[int, int]], rows: Rows,
                     bias: torch.Tensor | None) -> list[torch.Tensor]:
    """Each of ``inputs`` times a weight whose rows ``lo .. hi-1`` ``rows(lo, hi)`` makes, one block of ``blocks`` at a
    time: each block made once for every input. Inputs of as many rows are stacked into one product where this
    machine's GEMM gives each its rows exactly as alone (``_stacks_exactly``), else each is taken alone."""
    flat = [x.reshape(-1, x.shape[-1]) for x in inputs]
    classes: dict[int, list[int]] = {}
    for index, x in enumerate(flat):
        classes.setdefault(x.shape[0], []).append(index)
    stacked = {n: torch.cat([flat[i] for i in members]) for n, members in classes.items() if len(members) > 1}
    parts: list[list[torch.Tensor]] = [[] for _ in inputs]
    for lo, hi in blocks:
        weight, block_bias = rows(lo, hi), None if bias is None else bias[lo:hi]
        for n, members in classes.items():
            if n in stacked and _stacks_exactly(n, len(members), tuple(weight.shape), weight.dtype, bias is not None,
                                                torch.get_num_threads(), weight.device):
                for i, out in zip(members, nn.functional.linear(stacked[n], weight, block_bias).split(n), strict=True):
                    parts[i].append(out)
            else:
                for i in members:
                    parts[i].append(nn.functional.linear(flat[i], weight, block_bias))
    return [(out[0] if len(out) == 1 else torch.cat(out, -1)).reshape(*x.shape[:-1], -1)
            for out, x in zip(parts, inputs, strict=True)]


@functools.cache
def _stacks_exactly(rows: int, count: int, shape: tuple[int, int], dtype: torch.dtype, bias: bool,
                    threads: int, device: torch.device | None = None) -> bool:
    """Whether this machine's GEMM on ``device`` gives each of ``count`` inputs of ``rows`` rows, stacked, its
    product's rows bit for bit as it gives them alone, for a weight block of ``shape``: tried once on seeded values.
    Which kernel and which order of the inner sum a GEMM takes depends on the shapes (a single row takes another path
    on this project's CPUs), never on the values, and two sum orders over thousands of random terms agree essentially
    never; so one agreement on random values is the same sum, for every value."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    bias_values = torch.randn(shape[0], generator=generator).to(device=device, dtype=dtype) if bias else None
    inputs = [torch.randn(rows, shape[1], generator=generator).to(device=device, dtype=dtype) for _ in range(count)]
    joined = nn.functional.linear(torch.cat(inputs), weight, bias_values).split(rows)
    return all(torch.equal(nn.functional.linear(x, weight, bias_values), out)
               for x, out in zip(inputs, joined, strict=True))


def blocked_linear(key: Hashable, x: torch.Tensor, blocks: list[tuple[int, int]], rows: Rows,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` times the blocked weight (``blocked_products``); in a session of ``in_step``, computed with every other
    session's call of the same ``key`` (the linear and the dtype it computes in)."""
    step = getattr(_CURRENT, "step", None)
    if step is None:
        return blocked_products([x], blocks, rows, bias)[0]
    return step.meet(_Waiting((key, x.dtype), x, blocks, rows, bias))


@dataclass(eq=False)
class _Waiting:
    key: Hashable
    x: torch.Tensor
    blocks: list[tuple[int, int]]
    rows: Rows
    bias: torch.Tensor | None
    out: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = field(default=False)


class _Step:
    def __init__(self, sessions: int):
        self.condition = threading.Condition()
        self.running = sessions
        self.waiting: list[_Waiting] = []
        self.groups = self.products = 0  # groups computed, products taken in them

    def meet(self, entry: _Waiting) -> torch.Tensor:
        with self.condition:
            self.waiting.append(entry)
            self._compute_if_all_wait()
            while not entry.done:
                self.condition.wait()
        if entry.error is not None:
            raise entry.error
        return entry.out

    def leave(self) -> None:
        with self.condition:
            self.running -= 1
            self._compute_if_all_wait()

    def _compute_if_all_wait(self) -> None:
        """With every running session waiting: the largest group at one linear (the first to arrive of a tie)."""
        if not self.waiting or len(self.waiting) < self.running:
            return
        key = Counter(w.key for w in self.waiting).most_common(1)[0][0]
        group = [w for w in self.waiting if w.key == key]
        self.waiting = [w for w in self.waiting if w.key != key]
        first = group[0]
        try:
            outputs = blocked_products([w.x for w in group], first.blocks, first.rows, first.bias)
        except BaseException as error:  # every session of the group raises it
            for w in group:
                w.error = error
        else:
            for w, out in zip(group, outputs, strict=True):
                w.out = out
        for w in group:
            w.done = True
        self.groups += 1
        self.products += len(group)
        self.condition.notify_all()


@dataclass
class StepRecord:
    """How the sessions met: groups computed, and the products taken in them (products / groups: the blocks each made
    block served)."""

    groups: int = 0
    products: int = 0


def over_sessions(count: int, sessions: Sequence, work: Callable[[object, int], None]) -> None:
    """``work(session, index)`` for every index in ``range(count)``, over ``sessions`` (each its own states over shared
    weights) run in step (``in_step``), each taking the next index when it is done with one. Each index's work starts
    from the states it sets itself, so which session does it changes nothing."""
    taken, lock = iter(range(count)), threading.Lock()

    def session(own) -> None:
        while True:
            with lock:
                index = next(taken, None)
            if index is None:
                return
            work(own, index)

    in_step([functools.partial(session, own) for own in sessions[: max(1, count)]])


def in_step(calls: Sequence[Callable[[], T]], record: StepRecord | None = None) -> list[T]:
    """Each of ``calls`` run as a session (module docstring), in a thread of its own; their results in order. The
    first session's error (in order) is raised once every session has ended. One call runs alone, here."""
    if len(calls) <= 1:
        return [call() for call in calls]
    step = _Step(len(calls))
    results: list = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def session(index: int) -> None:
        _CURRENT.step = step
        try:
            with torch.no_grad():
                results[index] = calls[index]()
        except BaseException as error:
            errors[index] = error
        finally:
            _CURRENT.step = None
            step.leave()

    threads = [threading.Thread(target=session, args=(i,), name=f"session-{i}", daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if record is not None:
        record.groups += step.groups
        record.products += step.products
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return results
