"""Run under torchrun by test_distributed.py: ranks other than 0 wait for rank 0's next command longer than the
collective timeout (``argv[1]`` seconds) and must survive it (``control``), then run a step's collective on the
tensor group; ``default`` waits on the tensor group instead, which must time out (the negative control)."""

from __future__ import annotations

import sys
import time

import torch

from services.trainer.collective import broadcast
from services.trainer.model import init_parallel, shutdown_parallel
from services.trainer.parallel import ParallelLayout


def main() -> None:
    timeout, gap, where = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
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
