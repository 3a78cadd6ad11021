"""The few collectives the trainer's control flow needs across torchrun ranks. Rank 0 alone talks to Kafka and
decides; the other ranks follow its commands. With one process each call is a no-op.

Commands travel on a gloo group of their own with no practical timeout (``CONTROL_TIMEOUT``): a rank waiting
for rank 0's next command may wait as long as traffic pauses (a quiet night), whereas the tensor collectives of a
step (NCCL on GPUs) keep ``trainer.collective_timeout_s``, short enough to notice a hung peer. Barriers around
checkpoint writes are control too: writing an 8B version can outlast NCCL's timeout on a slow disk."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from services.trainer.parallel import ParallelLayout

CONTROL_TIMEOUT = timedelta(days=365)
_control: Any = None
_transfer: Any = None


def init_control() -> None:
    """Create the control group and the transfer group (collectives: every rank calls this once, after the
    process group exists)."""
    global _control, _transfer
    import torch.distributed as dist

    if _control is None and dist.is_initialized() and dist.get_world_size() > 1:
        _control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        _transfer = dist.new_group(timeout=CONTROL_TIMEOUT)


def transfer_group() -> Any:
    """The tensor backend's group (NCCL on GPUs) without a practical timeout, for the weight export: a rank
    sends its shards as rank 0 asks for them, and rank 0 writes to disk in between, which on a slow disk can
    take longer than a step's collective timeout."""
    return _transfer


def drop_control() -> None:
    global _control, _transfer
    _control = _transfer = None


def broadcast(obj: Any, layout: ParallelLayout) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not layout.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def barrier(layout: ParallelLayout) -> None:
    if layout.distributed:
        import torch.distributed as dist

        dist.barrier(group=_control)
