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


def test_a_version_is_streamed_tensor_by_tensor_and_hashed_while_written(tmp_path: Path) -> None:
    import hashlib

    from safetensors.torch import load_file

    from services.trainer.safetensors_stream import Entry

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.arange(6).view(2, 3)}
    entries = [Entry(k, v.dtype, v.shape) for k, v in tensors.items()]
    store = TrainerStore(tmp_path)
    path, digest = store.write_version(1, entries, iter(tensors.items()), tmp_path)
    weights = path / "model.safetensors"
    assert digest == hashlib.sha256(weights.read_bytes()).hexdigest()
    back = load_file(weights)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    # What the header announced is what must come, in order, and all of it; a failed version stays invisible.
    for wrong in (
        [("b", tensors["b"]), ("a", tensors["a"])],
        [("a", tensors["a"].double())],
        [("a", tensors["a"]), ("b", tensors["b"])],
    ):
        with pytest.raises(ValueError):
            store.write_version(2, entries, iter(wrong), tmp_path)
        assert not (tmp_path / "versions" / "v2").exists()


def test_step_records_replay_in_order_and_a_gap_is_refused(tmp_path: Path) -> None:
    from services.trainer.checkpoints import StepRecord

    store = TrainerStore(tmp_path)

    def record(v: int) -> StepRecord:
        return StepRecord(v, [f"s{v}"], {"0": v - 1}, {"0": v}, v)

    for v in (1, 2, 3):
        store.write_step(record(v))
    assert [r.version for r in store.plan().records] == [1, 2, 3] and store.newest_version() == 3
    tmp = store.stage(2)
    store.write_state(tmp, 0, {}, {})
    store.commit(CheckpointMeta(2, 2, {"0": 2}, [["s1"], ["s2"]], 2, "base"), tmp)
    plan = store.plan()
    assert plan.checkpoint is not None and plan.checkpoint[0].version == 2
    assert [r.version for r in plan.records] == [3], "the checkpoint's lineage holds the older steps"
    assert store.lineage() == [["s1"], ["s2"], ["s3"]] and store.newest_version() == 3
    store.write_step(record(5))
    with pytest.raises(RuntimeError, match="gap at v4"):
        store.plan()


def test_a_background_checkpoint_commits_when_every_rank_is_written_and_reports_failure(
    tmp_path: Path,
) -> None:
    import threading

    from services.trainer.checkpoints import BackgroundWriter, snapshot

    store = TrainerStore(tmp_path)
    tmp = store.stage(4)
    live = {"w": torch.zeros(3)}
    state = snapshot(live)
    live["w"] += 1  # the next step changes the live tensors; the snapshot keeps the step boundary's
    writer = BackgroundWriter()

    def rank0() -> None:
        store.write_state(tmp, 0, state, {"step": 4})
        store.wait_for_ranks(tmp, 2)
        store.commit(meta(4), tmp)

    writer.start(rank0)
    threading.Timer(0.3, lambda: store.write_state(tmp, 1, state, {"step": 4})).start()
    assert store.latest() is None  # rank 1 has not written yet: nothing committed
    writer.wait()
    found = store.latest()
    assert found is not None and found[0].version == 4
    assert torch.equal(store.load_state(found[1], 0)["model"]["w"], torch.zeros(3))
    assert not list(found[1].glob("rank*.done"))

    writer.start(lambda: store.write_state(tmp_path / "missing", 0, {}, {}))
    with pytest.raises(RuntimeError, match="writing the checkpoint failed"):
        writer.wait()


def test_pruning_keeps_the_newest_and_every_protected_version(tmp_path: Path) -> None:
    """Under a gate a rollback loads a promoted (or pinned) version again: its folder survives pruning."""
    store = TrainerStore(tmp_path)
    for v in range(1, 10):
        (store.versions / f"v{v}").mkdir()
    store.prune_versions(3, protect={9, 2, 5})
    assert sorted(p.name for p in store.versions.iterdir()) == ["v2", "v5", "v7", "v8", "v9"]


def test_a_restore_replays_the_path_to_its_target_and_the_next_step_records_its_parent(
    tmp_path: Path,
) -> None:
    """Under a gate the trainer may go back to a promoted version: the state behind any version is rebuilt from
    the nearest full checkpoint on its path (parents, not version numbers), a restore not yet followed by a step
    is its mark, and the checkpoints a restore needs outlive newer ones."""
    from services.trainer.checkpoints import RestoreMark, StepRecord

    store = TrainerStore(tmp_path)

    def record(v: int, parent: int | None = None) -> StepRecord:
        return StepRecord(v, [f"s{v}"], {"0": v - 1}, {"0": v}, v, parent)

    store.save(CheckpointMeta(0, 0, {"0": 0}, [], 0, "base"), {}, {})  # the gate's checkpoint of the start
    for v in (1, 2, 3):
        store.write_step(record(v))
    store.save(CheckpointMeta(3, 3, {"0": 3}, [["s1"], ["s2"], ["s3"]], 3, "base"), {}, {}, keep=[0])
    assert sorted(store.checkpoint_versions()) == [0, 3], "the promoted version's checkpoint is kept"
    assert store.anchor(1) == 0 and store.anchor(3) == 3
    assert [r.version for r in store.path_to(2)[1]] == [1, 2], "records after a kept checkpoint stay"

    store.write_restore(RestoreMark(to=1, after=3, offsets={"0": 3}, reason="two failed", decided_at=0.0))
    plan = store.plan()
    assert plan.target == 1 and plan.numbered == 3 and plan.mark is not None
    assert plan.checkpoint is not None and plan.checkpoint[0].version == 0
    assert [r.version for r in plan.records] == [1]

    store.write_step(record(4, parent=1))  # the first step after the restore: on v1's weights
    plan = store.plan()
    assert plan.mark is None and plan.target == 4 and plan.numbered == 4
    assert [r.version for r in plan.records] == [1, 4] and store.lineage() == [["s1"], ["s4"]]
    store.save(CheckpointMeta(4, 2, {"0": 4}, [["s1"], ["s4"]], 2, "base"), {}, {}, keep=[0])
    assert store.restore_mark() is None, "a checkpoint after the restore supersedes its mark"
    assert sorted(store.checkpoint_versions()) == [0, 4] and store.plan().records == []
