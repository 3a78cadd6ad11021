"""Run under torchrun by test_distributed.py: ranks other than 0 wait for rank 0's next command longer than the
collective timeout (``argv[1]`` seconds) and must survive it (``control``), then run a step's collective on the
tensor group; ``default`` waits on the tensor group instead, which must time out (the negative control).

Both ranks meet through files in ``argv[4]`` before the process group forms: with a collective timeout of a few
seconds, a rank that finished importing torch and Megatron a few seconds after the other (a busy 2-core machine)
would otherwise fail the rendezvous itself, which is not what this checks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from services.trainer.collective import broadcast
from services.trainer.model import init_parallel, shutdown_parallel
from services.trainer.parallel import ParallelLayout


def meet(folder: Path, rank: int, world: int, patience_s: float = 120.0) -> None:
    """Return once every rank has reached this point (or raise after ``patience_s``)."""
    (folder / f"here-{rank}").touch()
    deadline = time.monotonic() + patience_s
    while sum((folder / f"here-{r}").exists() for r in range(world)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks never arrived in {folder}")
        time.sleep(0.01)


def main() -> None:
    timeout, gap, where, folder = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    from megatron.core import parallel_state  # noqa: F401  (imported before the meeting, not after)

    meet(folder, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    layout = init_parallel(ParallelLayout.from_env(), timeout_s=timeout)
    import torch.distributed as dist

    if layout.rank == 0:
        time.sleep(gap)  # no traffic
    if where == "control":
        command = broadcast(("step", layout.rank), layout)
    else:
        box = [("step", layout.rank)]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
    assert command == ("step", 0), command
    total = torch.ones(1)
    dist.all_reduce(total)  # the tensor group still works after the gap
    assert total.item() == layout.world_size
    print(f"rank {layout.rank} survived {gap:.0f} s idle", flush=True)
    shutdown_parallel(layout)


if __name__ == "__main__":
    main()
