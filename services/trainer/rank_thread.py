"""One thread for every call a trainer rank makes into torch.

The current CUDA device is a per-thread setting: ``torch.cuda.set_device`` in one ``asyncio.to_thread`` call says
nothing about the next, which the default executor may run on another worker thread, where the device is
``cuda:0``. A rank other than 0 would then build or step on GPU 0 beside rank 0. So the trainer runs its model,
steps, exports and checkpoints on one dedicated thread, bound to the rank's device when it starts.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def bind_device(local_rank: int) -> None:
    """Make ``cuda:<local_rank>`` this thread's current device (nothing on a machine without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)


class RankThread:
    """A one-thread executor whose thread is bound to the rank's device before its first call."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self._ident: int | None = None

        def start() -> None:
            self._ident = threading.get_ident()
            bind_device(local_rank)

        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"trainer-rank{local_rank}", initializer=start
        )

    @property
    def ident(self) -> int | None:
        """The thread's identity once it has started (tests check every call ran there)."""
        return self._ident

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
