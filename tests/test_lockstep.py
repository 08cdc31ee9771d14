"""Sessions in step (convert/export/lockstep.py): every session's outputs are those it computes alone, bit for bit,
whatever the other sessions do (other widths, other call counts, an error), and each block of a weight is made once
for every session waiting at its linear."""

from __future__ import annotations

import threading

import pytest
import torch

from convert.export import lockstep
from convert.export.lockstep import StepRecord, in_step
from convert.export.quantized import CodesLinear, HalfLinear
from quant.types import QuantizedWeight

COLUMNS = 640  # ROW_BLOCK_WEIGHTS // 640 = 1638 rows a block: the 4000-row linears take three blocks


def _linears() -> list[torch.nn.Module]:
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4000, COLUMNS), dtype=torch.uint8, generator=generator)
    quantized = QuantizedWeight("affine4", codes, 64, scale=(torch.rand(4000, COLUMNS // 64, generator=generator)
                                                             * 0.01).half(),
                                zero_point=torch.randint(0, 16, (4000, COLUMNS // 64), dtype=torch.uint8,
                                                         generator=generator))
    half = HalfLinear(torch.randn(4000, COLUMNS, generator=generator).half(),
                      torch.nn.Parameter(torch.randn(4000, generator=generator)))
    return [CodesLinear("codes", quantized).to(torch.float32), half.to(torch.float32)]


def _equal(runs, others) -> bool:
    return all(torch.equal(t, a) for ts, as_ in zip(runs, others, strict=True) for t, a in zip(ts, as_, strict=True))


def _session(linears, width: int, calls: int, seed: int) -> list[torch.Tensor]:
    """``calls`` rounds through both linears on seeded [1, width, COLUMNS] inputs."""
    generator = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(calls):
        for linear in linears:
            outputs.append(linear(torch.randn(1, width, COLUMNS, generator=generator)))
    return outputs


def test_sessions_in_step_compute_what_each_computes_alone_and_share_each_block():
    linears = _linears()
    # widths and call counts differ: sessions leave at different times and meet in groups of several widths
    sessions = [(8, 3), (1, 2), (8, 3), (3, 1), (1, 3), (8, 2)]
    with torch.no_grad():
        alone = [_session(linears, width, calls, seed) for seed, (width, calls) in enumerate(sessions)]
    record = StepRecord()
    together = in_step([lambda w=w, c=c, s=s: _session(linears, w, c, s) for s, (w, c) in enumerate(sessions)],
                       record)
    assert [len(t) for t in together] == [len(a) for a in alone]
    assert _equal(together, alone)
    assert record.products == sum(2 * calls for _, calls in sessions) == 28
    assert record.groups == 6  # 3 rounds of both linears; a group for every meeting at a linear, every session in it


def test_rows_are_stacked_only_where_this_machines_gemm_gives_them_as_alone(monkeypatch):
    linears = _linears()
    if lockstep._stacks_exactly(1, 3, (1638, COLUMNS), torch.float32, False, torch.get_num_threads()):
        pytest.skip("this machine's GEMM gives single rows stacked as alone: nothing to tell apart")
    with torch.no_grad():
        alone = [_session(linears, 1, 2, seed) for seed in range(3)]

    def together():
        return in_step([lambda s=s: _session(linears, 1, 2, s) for s in range(3)])

    assert _equal(together(), alone)
    monkeypatch.setattr(lockstep, "_stacks_exactly", lambda *_: True)  # stacked whatever the GEMM does
    assert not _equal(together(), alone)


def test_a_sessions_error_is_raised_after_the_others_finish():
    linears = _linears()
    finished = []

    def failing():
        _session(linears, 8, 1, 0)
        raise ValueError("session 1 failed")

    def fine(seed: int):
        out = _session(linears, 8, 3, seed)
        finished.append(seed)
        return out

    threads = threading.active_count()
    with pytest.raises(ValueError, match="session 1 failed"):
        in_step([lambda: fine(0), failing, lambda: fine(2)])
    assert sorted(finished) == [0, 2]
    assert threading.active_count() == threads  # no session left waiting


def test_one_call_runs_alone_in_this_thread():
    here = []
    assert in_step([lambda: here.append(threading.current_thread()) or 7]) == [7]
    assert here == [threading.main_thread()]


def test_rows_made_outside_a_meeting_in_several_sessions_at_once_are_each_sessions_own():
    """An anchor row (``embedding_rows`` of a table held as codes) is made in a session's own thread, outside any
    meeting, while other sessions make theirs: each thread writes workspaces of its own (one shared set mixed rows)."""
    from convert.export.quantized import embedding_rows

    generator = torch.Generator().manual_seed(1)
    quantized = QuantizedWeight("affine4", torch.randint(0, 16, (6000, COLUMNS), dtype=torch.uint8,
                                                          generator=generator), 64,
                                scale=(torch.rand(6000, COLUMNS // 64, generator=generator) * 0.01).half(),
                                zero_point=torch.randint(0, 16, (6000, COLUMNS // 64), dtype=torch.uint8,
                                                         generator=generator))
    table = CodesLinear("embed_tokens", quantized, embedding=True)
    linears = _linears()

    def session(seed: int) -> list[torch.Tensor]:
        tokens = torch.randint(0, 6000 - 2048, (6,), generator=torch.Generator().manual_seed(seed))
        out = []
        for token in tokens.tolist():
            out.append(embedding_rows(table, token, token + 2048))  # two blocks of rows: the workspaces in use a while
            out.extend(_session(linears, 8, 1, seed))
        return out

    alone = [session(seed) for seed in range(4)]
    assert _equal(in_step([lambda s=s: session(s) for s in range(4)]), alone)
