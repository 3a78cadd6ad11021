"""Checkpoint files: one state file per rank, and the single-process file of earlier versions still resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.checkpoints import CheckpointMeta, TrainerStore


def meta(version: int) -> CheckpointMeta:
    return CheckpointMeta(version, version, {"0": 7}, [["a"]], 1, "base")


def test_each_rank_has_its_state_and_an_old_single_file_checkpoint_still_loads(tmp_path: Path) -> None:
    store = TrainerStore(tmp_path)
    tmp = store.stage(1)
    for rank in range(2):
        store.write_state(tmp, rank, {"w": torch.full((2,), float(rank))}, {"step": rank})
    store.commit(meta(1), tmp)
    found = store.latest()
    assert found is not None and found[0] == meta(1)
    assert [store.load_state(found[1], r)["optimizer"]["step"] for r in range(2)] == [0, 1]
    with pytest.raises(FileNotFoundError, match="another parallel layout"):
        store.load_state(found[1], 2)

    store.save(meta(2), {"w": torch.ones(2)}, {"step": 9})
    found = store.latest()
    assert found is not None and found[0].version == 2 and not (tmp_path / "checkpoints" / "ckpt-v1").exists()
    (found[1] / "state-rank0.pt").rename(found[1] / "state.pt")  # the layout before per-rank files
    assert store.load_state(found[1], 0)["optimizer"]["step"] == 9
