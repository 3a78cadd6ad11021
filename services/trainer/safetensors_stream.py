"""A safetensors file written one tensor at a time, hashed as it is written.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}`` (padded with spaces to 8 bytes), then the tensors' bytes back to back.
Every name, dtype and shape is known before any weight is gathered (the model's layout), so the header goes
first and each tensor can be written and dropped as it arrives: rank 0 never holds the whole model, and the
sha256 costs no second read of a multi-gigabyte file."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch

DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class Entry(tuple[str, torch.dtype, tuple[int, ...]]):
    """(name, dtype, shape) of one tensor of the file."""

    __slots__ = ()

    def __new__(cls, name: str, dtype: torch.dtype, shape: Sequence[int]) -> Entry:
        return super().__new__(cls, (name, dtype, tuple(int(d) for d in shape)))

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self[1]).element_size()
        for d in self[2]:
            n *= d
        return n


class StreamWriter:
    """``with StreamWriter(path, entries) as w: w.write(name, tensor)`` in the entries' order; ``w.sha256`` after
    the block. Refuses a tensor out of order or of another dtype or shape than announced."""

    def __init__(
        self, path: str | Path, entries: Sequence[Entry], metadata: dict[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self.entries = list(entries)
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, dtype, shape in self.entries:
            size = Entry(name, dtype, shape).nbytes
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._hash = hashlib.sha256()
        self._file = open(self.path, "wb")  # closed by close() or __exit__
        self._put(struct.pack("<Q", len(raw)) + raw)
        self._next = 0
        self.sha256 = ""

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.entries):
            raise ValueError(f"{name}: more tensors than the header announced")
        want = self.entries[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != tuple(want):
            raise ValueError(f"expected {want}, got {(name, tensor.dtype, tuple(tensor.shape))}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._put(flat.numpy().data)  # the bytes in place, no copy
        self._next += 1

    def close(self) -> str:
        if self._next != len(self.entries):
            missing = [e[0] for e in self.entries[self._next :]]
            self._file.close()
            raise ValueError(f"{self.path}: {len(missing)} tensors never written, first {missing[:3]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.sha256 = self._hash.hexdigest()
        return self.sha256

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        elif not self._file.closed:
            self._file.close()
