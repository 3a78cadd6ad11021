"""The trainer's durable state on disk: published weight versions and resumable checkpoints.

``<root>/versions/v<N>/``: Hugging Face safetensors plus the base model's config and tokenizer files, written to a
temporary folder and renamed into place, so an engine never sees half a version. ``<root>/checkpoints/``: model
and optimizer state (one file per rank of the parallel layout), the ``samples`` offsets the step consumed up to,
and the ids of the samples each version was trained on; ``latest.json`` names the newest and is replaced
atomically after the checkpoint is complete. With several ranks, ``<root>`` must be one shared filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch

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


class CheckpointMeta(msgspec.Struct):
    version: int
    step: int
    offsets: dict[str, int]
    """``"<partition>"`` -> the next offset to consume on ``samples``."""
    trained: list[list[str]]
    """Sample ids per step, oldest first: the lineage of this checkpoint's weights."""
    samples_trained: int
    base_model: str


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
        self.versions.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(parents=True, exist_ok=True)

    def write_version(
        self, version: int, tensors: dict[str, torch.Tensor], base: str | Path
    ) -> tuple[Path, str]:
        """Write ``versions/v<version>`` atomically; returns (path, sha256 of the weights file)."""
        from safetensors.torch import save_file

        final = self.versions / f"v{version}"
        tmp = self.versions / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        weights = tmp / "model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
        for name in _COPY:
            src = Path(base) / name
            if src.exists():
                shutil.copyfile(src, tmp / name)
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.versions)
        return final, digest

    def prune_versions(self, keep: int, protect: int) -> None:
        found = sorted(
            (int(p.name[1:]), p)
            for p in self.versions.iterdir()
            if p.name.startswith("v") and p.name[1:].isdigit()
        )
        for version, path in found[:-keep]:
            if version != protect:
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
        """One rank's model and optimizer state (each rank of a parallel layout writes its own file)."""
        path = tmp / f"state-rank{rank}.pt"
        torch.save({"model": model_state, "optimizer": optimizer_state}, path)
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())

    def commit(self, meta: CheckpointMeta, tmp: Path) -> None:
        """Make the staged checkpoint (every rank's state written) the resume point: ``latest.json`` moves to it
        only once it is complete on disk; older checkpoints are removed."""
        final = self.checkpoints / f"ckpt-v{meta.version}"
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
        for old in self.checkpoints.glob("ckpt-v*"):
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)

    def save(self, meta: CheckpointMeta, model_state: dict[str, Any], optimizer_state: Any) -> None:
        """A single-process checkpoint: stage, write rank 0's state, commit."""
        tmp = self.stage(meta.version)
        self.write_state(tmp, 0, model_state, optimizer_state)
        self.commit(meta, tmp)

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
