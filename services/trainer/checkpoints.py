"""The trainer's durable state on disk: published weight versions, a record per step, and full checkpoints.

``<root>/versions/v<N>/``: Hugging Face safetensors plus the base model's config and tokenizer files, written to a
temporary folder and renamed into place, so an engine never sees half a version; written every step (what
SGLang loads). ``<root>/checkpoints/steps/v<N>.json``: what step N trained on (sample ids, the ``samples`` offsets
before and after it), a few hundred bytes, every step. ``<root>/checkpoints/ckpt-v<N>/``: model and optimizer
state (one file per rank of the parallel layout), the offsets and the lineage of trained sample ids, every
``trainer.checkpoint_every_steps`` steps or ``checkpoint_every_s`` seconds (and at a clean stop);
``latest.json`` names the newest and is replaced atomically after it is complete. A restart loads the newest
full checkpoint and replays the recorded steps after it from the same samples, so that no sample is trained
twice or lost. With several ranks, ``<root>`` must be one shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from services.trainer.safetensors_stream import Entry, StreamWriter

_COPY = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


class VersionFiles(msgspec.Struct, frozen=True):
    """What a version folder holds: its format (``WeightsPublished.format``), the file its tensors go to, files
    written beside it, and whether the base model's config and tokenizer files are copied in (full weights: the
    engine loads the folder as a model; an adapter folder is PEFT's, read with the base model beside it)."""

    format: str = "hf-safetensors"
    weights_file: str = "model.safetensors"
    extra: dict[str, bytes] = msgspec.field(default_factory=dict)
    copy_base: bool = True


FULL_WEIGHTS = VersionFiles()


class CheckpointMeta(msgspec.Struct):
    version: int
    step: int
    offsets: dict[str, int]
    """``"<partition>"`` -> the next offset to consume on ``samples``."""
    trained: list[list[str]]
    """Sample ids per step, oldest first: the lineage of this checkpoint's weights."""
    samples_trained: int
    base_model: str
    ancestors: list[int] = msgspec.field(default_factory=list)
    """The versions behind these weights, nearest first (up to ``staleness.ANCESTORS_KEPT``): a sample's staleness
    is counted along them after a restart (a restore makes version numbers jump)."""
    taken: list[tuple[int, int]] = msgspec.field(default_factory=list)
    """(partition, offset) of the samples at or past ``offsets`` already trained: a step may take a later sample
    before an earlier one (``shares.py`` defers a user's surplus), so reading again from ``offsets`` skips these."""


class StepRecord(msgspec.Struct):
    """One optimizer step, recorded when its version is on disk: enough to replay it from the samples topic."""

    version: int
    sample_ids: list[str]
    offsets_before: dict[str, int]
    """``"<partition>"`` -> where consumption resumed for this step's batch (the previous step's ``offsets``)."""
    offsets: dict[str, int]
    """``"<partition>"`` -> the next offset to consume after this step (pending samples read again)."""
    samples_trained: int
    parent: int | None = None
    """The version whose weights the step trained (None: ``version - 1``); another after a restore."""
    taken: list[tuple[int, int]] = msgspec.field(default_factory=list)
    """(partition, offset) of the samples at or past ``offsets`` already trained: a step may take a later sample
    before an earlier one (``shares.py`` defers a user's surplus), so reading again from ``offsets`` skips these."""


class RestoreMark(msgspec.Struct):
    """A restore to an earlier version (under a gate, after ``gate.restore_after`` failed candidates): written
    before the trainer reloads, so that a restart before its next step rebuilds the same state. Superseded by the
    next step, whose record's ``parent`` says the same."""

    to: int
    """The version whose weights and optimizer state training goes on from."""
    after: int
    """The newest version published before the restore: the next step is numbered after it."""
    offsets: dict[str, int]
    """``"<partition>"`` -> where consumption goes on (the samples of the discarded steps are not trained again)."""
    reason: str
    decided_at: float
    taken: list[tuple[int, int]] = msgspec.field(default_factory=list)
    """(partition, offset) of the samples at or past ``offsets`` already trained: a step may take a later sample
    before an earlier one (``shares.py`` defers a user's surplus), so reading again from ``offsets`` skips these."""


class ResumePlan(msgspec.Struct):
    """How to rebuild the trainer's state: a full checkpoint (None: the base weights), then the recorded steps
    on the path from it to the target version, replayed from the same samples."""

    checkpoint: tuple[CheckpointMeta, Path] | None
    records: list[StepRecord]
    target: int
    """The version whose weights the rebuilt state holds."""
    numbered: int
    """The newest version number used so far (the next step publishes ``numbered + 1``)."""
    mark: RestoreMark | None
    """The restore this plan carries out (its offsets are where consumption goes on after the replay)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TrainerStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.versions = self.root / "versions"
        self.checkpoints = self.root / "checkpoints"
        self.steps = self.checkpoints / "steps"
        self.versions.mkdir(parents=True, exist_ok=True)
        self.steps.mkdir(parents=True, exist_ok=True)

    def write_version(
        self,
        version: int,
        entries: Sequence[Entry],
        tensors: Iterable[tuple[str, torch.Tensor]],
        base: str | Path,
        files: VersionFiles = FULL_WEIGHTS,
    ) -> tuple[Path, str]:
        """Write ``versions/v<version>`` atomically, one tensor at a time as ``tensors`` yields them (in
        ``entries``' order); returns (path, sha256 of the weights file, computed while writing)."""
        final = self.versions / f"v{version}"
        tmp = self.versions / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with StreamWriter(tmp / files.weights_file, entries) as writer:
            for name, tensor in tensors:
                writer.write(name, tensor)
        for name, data in files.extra.items():
            (tmp / name).write_bytes(data)
        for name in _COPY if files.copy_base else ():
            src = Path(base) / name
            if src.exists():
                shutil.copyfile(src, tmp / name)
        for written in tmp.iterdir():
            if written.name != files.weights_file:  # the stream writer syncs its own file
                with open(written, "rb") as fh:
                    os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.versions)
        return final, writer.sha256

    def write_step(self, record: StepRecord) -> None:
        """Record a step (atomically), after its version is on disk and before it is announced."""
        path = self.steps / f"v{record.version}.json"
        tmp = self.steps / f".v{record.version}.json.tmp"
        tmp.write_bytes(msgspec.json.encode(record))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.steps)

    def records(self) -> dict[int, StepRecord]:
        return {
            int(p.stem[1:]): msgspec.json.decode(p.read_bytes(), type=StepRecord)
            for p in self.steps.glob("v*.json")
            if p.stem[1:].isdigit()
        }

    def checkpoint_versions(self) -> dict[int, Path]:
        """Every complete full checkpoint (its folder is renamed into place only once written)."""
        return {
            int(p.name[6:]): p
            for p in self.checkpoints.glob("ckpt-v*")
            if p.name[6:].isdigit() and (p / "meta.json").exists()
        }

    def write_restore(self, mark: RestoreMark) -> None:
        tmp = self.checkpoints / ".restore.json.tmp"
        tmp.write_bytes(msgspec.json.encode(mark))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.checkpoints / "restore.json")
        _fsync_dir(self.checkpoints)

    def restore_mark(self) -> RestoreMark | None:
        path = self.checkpoints / "restore.json"
        return msgspec.json.decode(path.read_bytes(), type=RestoreMark) if path.exists() else None

    def path_to(self, target: int) -> tuple[int, list[StepRecord]]:
        """The nearest full checkpoint behind ``target`` (0 with none: the base weights) and the recorded steps
        from it to ``target``, in order. A missing record is refused, as replaying around it would train the
        policy on a different history than the one it published."""
        records, checkpoints = self.records(), self.checkpoint_versions()
        path: list[StepRecord] = []
        v = target
        while v not in checkpoints and v > 0:
            record = records.get(v)
            if record is None:
                raise RuntimeError(
                    f"the step records behind v{target} have a gap at v{v} ({self.steps}): the state behind "
                    "it cannot be rebuilt"
                )
            path.append(record)
            v = record.parent if record.parent is not None else v - 1
        path.reverse()
        return v, path

    def plan(self) -> ResumePlan:
        """What a start rebuilds: the newest recorded version's state, or a restore's target when the restore is
        newer than every step."""
        found = self.latest()
        records = self.records()
        head = max([*records, found[0].version if found else 0])
        mark = self.restore_mark()
        if mark is not None and mark.after < head:
            mark = None  # a step after the restore: its record's parent carries it
        target = mark.to if mark is not None else head
        anchor, path = self.path_to(target)
        checkpoints = self.checkpoint_versions()
        checkpoint = None
        if anchor in checkpoints:
            folder = checkpoints[anchor]
            checkpoint = (
                msgspec.json.decode((folder / "meta.json").read_bytes(), type=CheckpointMeta),
                folder,
            )
        return ResumePlan(checkpoint, path, target, max(head, mark.after if mark else 0), mark)

    def anchor(self, version: int) -> int | None:
        """The full checkpoint a restore to ``version`` starts from (None: it has none; 0 may be the base's)."""
        try:
            anchor, _ = self.path_to(version)
        except RuntimeError:
            return None
        return anchor

    def newest_version(self) -> int:
        """The newest recorded step's version (0: none; the checkpoint's when no step came after it)."""
        return self.plan().numbered

    def lineage(self) -> list[list[str]]:
        """The sample ids of every step behind the current weights, oldest first."""
        plan = self.plan()
        trained = list(plan.checkpoint[0].trained) if plan.checkpoint else []
        return trained + [r.sample_ids for r in plan.records]

    def prune_versions(self, keep: int, protect: Collection[int]) -> None:
        """Delete all but the newest ``keep`` version folders, never one in ``protect`` (the trainer's own, and
        under a gate the promoted and pinned ones a rollback may load again)."""
        found = sorted(
            (int(p.name[1:]), p)
            for p in self.versions.iterdir()
            if p.name.startswith("v") and p.name[1:].isdigit()
        )
        for version, path in found[:-keep]:
            if version not in protect:
                shutil.rmtree(path, ignore_errors=True)

    def staged(self, version: int) -> Path:
        return self.checkpoints / f".ckpt-v{version}.tmp"

    def stage(self, version: int) -> Path:
        """The temporary folder that the checkpoint of ``version`` is written into (created empty)."""
        tmp = self.staged(version)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    @staticmethod
    def write_state(tmp: Path, rank: int, model_state: dict[str, Any], optimizer_state: Any) -> None:
        """One rank's model and optimizer state (each rank of a parallel layout writes its own file), then its
        ``rank<r>.done`` marker: what ``wait_for_ranks`` counts before the checkpoint is committed."""
        path = tmp / f"state-rank{rank}.pt"
        torch.save({"model": model_state, "optimizer": optimizer_state}, path)
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        (tmp / f"rank{rank}.done").touch()

    @staticmethod
    def wait_for_ranks(tmp: Path, world_size: int, poll_s: float = 0.05) -> None:
        """Until every rank's state is written into ``tmp`` (a shared filesystem; no collective, so a background
        writer never competes with a step's collectives)."""
        while sum(1 for _ in tmp.glob("rank*.done")) < world_size:
            if not tmp.exists():
                raise RuntimeError(f"{tmp} vanished while its ranks were writing")
            time.sleep(poll_s)

    def commit(self, meta: CheckpointMeta, tmp: Path, keep: Collection[int] = ()) -> None:
        """Make the staged checkpoint (every rank's state written) the resume point: ``latest.json`` moves to it
        only once it is complete on disk; older checkpoints are removed, but those in ``keep`` (under a gate, the
        ones a restore to a promoted version starts from) and the step records after them."""
        final = self.checkpoints / f"ckpt-v{meta.version}"
        for marker in tmp.glob("rank*.done"):
            marker.unlink()
        (tmp / "meta.json").write_bytes(msgspec.json.encode(meta))
        with open(tmp / "meta.json", "rb") as fh:
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = self.checkpoints / ".latest.json.tmp"
        pointer.write_text(json.dumps({"checkpoint": final.name, "version": meta.version}))
        with open(pointer, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(pointer, self.checkpoints / "latest.json")
        _fsync_dir(self.checkpoints)
        for version, old in self.checkpoint_versions().items():
            if old.name != final.name and version not in keep:
                shutil.rmtree(old, ignore_errors=True)
        for staged in self.checkpoints.glob(".ckpt-v*.tmp"):  # a write a kill interrupted
            if staged != tmp:
                shutil.rmtree(staged, ignore_errors=True)
        below = min([meta.version, *keep])
        for record in self.steps.glob("v*.json"):  # the checkpoints' lineages hold them now
            if record.stem[1:].isdigit() and int(record.stem[1:]) <= below:
                record.unlink(missing_ok=True)
        mark = self.restore_mark()
        if mark is not None and mark.after < meta.version:
            (self.checkpoints / "restore.json").unlink(missing_ok=True)

    def save(
        self,
        meta: CheckpointMeta,
        model_state: dict[str, Any],
        optimizer_state: Any,
        keep: Collection[int] = (),
    ) -> None:
        """A single-process checkpoint: stage, write rank 0's state, commit."""
        tmp = self.stage(meta.version)
        self.write_state(tmp, 0, model_state, optimizer_state)
        self.commit(meta, tmp, keep)

    def latest(self) -> tuple[CheckpointMeta, Path] | None:
        pointer = self.checkpoints / "latest.json"
        if not pointer.exists():
            return None
        folder = self.checkpoints / json.loads(pointer.read_text())["checkpoint"]
        return msgspec.json.decode((folder / "meta.json").read_bytes(), type=CheckpointMeta), folder

    @staticmethod
    def load_state(folder: Path, rank: int = 0) -> dict[str, Any]:
        path = folder / f"state-rank{rank}.pt"
        if not path.exists() and rank == 0 and (folder / "state.pt").exists():
            path = folder / "state.pt"  # a single-process checkpoint of an earlier version
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: was this checkpoint written with another parallel layout?"
            )
        state: dict[str, Any] = torch.load(
            path, weights_only=False, map_location="cpu"
        )  # written by write_state()
        return state


def snapshot(obj: Any) -> Any:
    """A CPU copy of a (nested) state, taken at a step boundary so that it can be written while the next step
    changes the live tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class BackgroundWriter:
    """One checkpoint write at a time, in a thread: ``start`` waits for the previous one (and raises its error),
    ``wait`` before exit."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # re-raised in the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("writing the checkpoint failed") from error
