"""The optimizer's part of a rank's checkpoint, for Megatron's optimizer with or without the distributed
optimizer (megatron-core 0.16.1).

``DistributedOptimizer.state_dict()`` holds the param groups and the step only: the fp32 main weights and Adam's
moments live in each data-parallel rank's shard, and a resume from that dict alone starts from uninitialised
moments (NaN weights one step later). Each rank therefore also keeps its own shard
(``get_parameter_state_dp_reshardable``), loads it back into the same layout, and refuses another one."""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.checkpoints import snapshot


def _subs(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed(sub: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(sub, DistributedOptimizer)


FRESH = {"fresh": True}
"""The state of an optimizer that has taken no step (Megatron's distributed optimizer cannot write one): loading it
starts Adam's moments again and takes the main weights from the model's (under a gate the trainer checkpoints its
starting state, for a restore to the starting weights)."""


def _stepped(optimizer: Any) -> bool:
    return any(getattr(sub, "optimizer", sub).state for sub in _subs(optimizer))


def optimizer_state(optimizer: Any) -> Any:
    """This rank's optimizer state as host copies, detached from the live buffers (``torch.save``-able)."""
    if not _stepped(optimizer):
        return dict(FRESH)
    out = []
    for sub in _subs(optimizer):
        state = snapshot(sub.state_dict())  # the distributed optimizer's: param groups and step only
        if _distributed(sub):
            shard = sub.get_parameter_state_dp_reshardable()
            for index in range(len(sub.gbuf_ranges)):
                for buckets in shard[index].values():
                    for bucket in buckets:
                        for entry in bucket:
                            for key, value in entry.items():
                                if isinstance(value, torch.Tensor):
                                    entry[key] = value.detach().to("cpu", copy=True)
                            entry["padding"] = False  # the loader filters on it (as its sharded form sets it)
            state["param_state"] = shard
            state["param_state_sharding_type"] = "dp_reshardable"
            state["dp_size"] = sub.data_parallel_group.size()
        out.append(state)
    return out[0] if len(out) == 1 else out  # ChainedOptimizer's convention


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """Into a freshly built optimizer of the same layout, after the model's weights were loaded."""
    subs = _subs(optimizer)
    if state == FRESH:
        for sub in subs:
            getattr(
                sub, "optimizer", sub
            ).state.clear()  # Adam builds each parameter's state at its first step
            sub.reload_model_params()  # fp32 main weights (mixed precision, distributed) from the model's
        return
    states = [state] if len(subs) == 1 else state
    for sub, saved in zip(subs, states, strict=True):
        if _distributed(sub) != ("param_state" in saved):
            raise ValueError(
                "the checkpoint's optimizer state was written with trainer.distributed_optimizer "
                f"{'on' if 'param_state' in saved else 'off'}; set it so to resume from it"
            )
        if _distributed(sub) and (
            saved["dp_size"] != sub.data_parallel_group.size()
            or saved["param_state"]["per_bucket_numel"] != sub.per_bucket_numel
        ):
            raise ValueError("the checkpoint's optimizer state was written with another parallel layout")
    with torch.no_grad():  # the fp32 main weights are views of the leaf parameters
        optimizer.load_state_dict(state)
    for sub in subs:
        # torch.optim.Adam (no Transformer Engine or Apex) is handed one shared ``step`` tensor for every
        # parameter, which its CPU step then increments once per parameter: give each its own.
        inner = getattr(sub, "optimizer", None)
        for param_state in inner.state.values() if inner is not None else ():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()
