"""Every torch call of a trainer rank runs on one thread bound to the rank's device: the current CUDA device is
per thread, and a call that lands on another executor thread computes on cuda:0."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.trainer import rank_thread
from services.trainer.rank_thread import RankThread


async def test_every_call_runs_on_the_one_thread_bound_to_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    bound: list[tuple[int, int]] = []
    monkeypatch.setattr(rank_thread, "bind_device", lambda rank: bound.append((threading.get_ident(), rank)))
    thread = RankThread(3)
    try:
        # the default executor busy beside it: its threads must not take the rank's calls
        noise = [asyncio.to_thread(threading.get_ident) for _ in range(8)]
        ran = await asyncio.gather(*(thread.run(threading.get_ident) for _ in range(20)), *noise)
    finally:
        thread.close()
    ours = set(ran[:20])
    assert bound == [(thread.ident, 3)], "bound once, before the first call, on its own thread"
    assert ours == {thread.ident} and thread.ident != threading.get_ident()


async def test_arguments_results_and_errors_pass_through() -> None:
    thread = RankThread(0)
    try:
        assert await thread.run(divmod, 7, 2) == (3, 1)
        with pytest.raises(ZeroDivisionError):
            await thread.run(divmod, 1, 0)
        assert await thread.run(divmod, 9, 4) == (2, 1), "an error does not take the thread down"
    finally:
        thread.close()
