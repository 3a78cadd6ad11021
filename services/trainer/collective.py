"""The few collectives the trainer's control flow needs across torchrun ranks. Rank 0 alone talks to Kafka and
decides; the other ranks follow its commands. With one process each call is a no-op."""

from __future__ import annotations

from typing import Any

from services.trainer.parallel import ParallelLayout


def broadcast(obj: Any, layout: ParallelLayout) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not layout.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(layout: ParallelLayout) -> None:
    if layout.distributed:
        import torch.distributed as dist

        dist.barrier()
