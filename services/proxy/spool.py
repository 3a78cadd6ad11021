"""A durable, ordered, file-backed spool: turns are written (and fsync'd) here first, then published to Kafka
in order; the read cursor advances only after Kafka acknowledged them.

Layout: ``seg-<n>.log`` files of records ``[u32 length][u32 crc32][payload]`` and a ``cursor`` file holding
``<segment> <offset>`` of the next record to publish (replaced atomically). A torn tail record (a crash while
writing) fails its CRC and is cut off at open. Drained segments are deleted.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import zlib
from pathlib import Path

_HEADER = struct.Struct("<II")
SEGMENT_BYTES = 64 * 1024 * 1024


class Spool:
    def __init__(self, directory: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        # One process per spool: two publishers draining one spool would send every turn twice.
        self._lockfile = open(self.dir / "lock", "w")
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockfile.close()
            raise RuntimeError(
                f"spool {self.dir} is in use by another process (give each proxy its own)"
            ) from None
        segments = self._segments()
        self._write_seg = segments[-1] if segments else 0
        self._read_seg, self._read_off = self._load_cursor(segments)
        self._truncate_torn_tail(self._write_seg)
        self._fh = open(self._path(self._write_seg), "ab")
        self._pending = self._count_pending()

    # paths and cursor ----------------------------------------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.dir / f"seg-{seg:012d}.log"

    def _segments(self) -> list[int]:
        return sorted(int(p.stem[4:]) for p in self.dir.glob("seg-*.log"))

    def _load_cursor(self, segments: list[int]) -> tuple[int, int]:
        try:
            seg_s, off_s = (self.dir / "cursor").read_text().split()
            return int(seg_s), int(off_s)
        except (FileNotFoundError, ValueError):
            return (segments[0] if segments else 0), 0

    def _save_cursor(self) -> None:
        tmp = self.dir / "cursor.tmp"
        with open(tmp, "w") as fh:
            fh.write(f"{self._read_seg} {self._read_off}")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / "cursor")

    def _truncate_torn_tail(self, seg: int) -> None:
        path = self._path(seg)
        if not path.exists():
            return
        good = 0
        with open(path, "rb") as fh:
            while True:
                header = fh.read(_HEADER.size)
                if len(header) < _HEADER.size:
                    break
                length, crc = _HEADER.unpack(header)
                payload = fh.read(length)
                if len(payload) < length or zlib.crc32(payload) != crc:
                    break
                good = fh.tell()
        if good < path.stat().st_size:
            with open(path, "r+b") as fh:
                fh.truncate(good)

    def _count_pending(self) -> int:
        n = 0
        seg, off = self._read_seg, self._read_off
        while True:
            records, seg, off = self._read_from(seg, off, 1 << 30)
            n += len(records)
            if not records:
                return n

    # writing -------------------------------------------------------------------------------------------------

    def append(self, payloads: list[bytes]) -> None:
        """Append and fsync (one fsync for the whole group). Blocking: call it from a worker thread."""
        if not payloads:
            return
        with self._lock:
            buf = bytearray()
            for p in payloads:
                buf += _HEADER.pack(len(p), zlib.crc32(p))
                buf += p
            self._fh.write(buf)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._pending += len(payloads)
            if self._fh.tell() >= self.segment_bytes:
                self._fh.close()
                self._write_seg += 1
                self._fh = open(self._path(self._write_seg), "ab")

    # reading -------------------------------------------------------------------------------------------------

    def _read_from(self, seg: int, off: int, limit: int) -> tuple[list[bytes], int, int]:
        """Up to ``limit`` records from (seg, off); returns them and the position after them."""
        out: list[bytes] = []
        while len(out) < limit:
            path = self._path(seg)
            if not path.exists():
                if seg < self._write_seg:
                    seg, off = seg + 1, 0
                    continue
                break
            with open(path, "rb") as fh:
                fh.seek(off)
                while len(out) < limit:
                    header = fh.read(_HEADER.size)
                    if len(header) < _HEADER.size:
                        break
                    length, crc = _HEADER.unpack(header)
                    payload = fh.read(length)
                    if len(payload) < length or zlib.crc32(payload) != crc:
                        break
                    out.append(payload)
                    off = fh.tell()
            if len(out) < limit and seg < self._write_seg:
                seg, off = seg + 1, 0
                continue
            break
        return out, seg, off

    def peek(self, limit: int = 256) -> list[bytes]:
        """The next records to publish, oldest first (without consuming them)."""
        with self._lock:
            records, _, _ = self._read_from(self._read_seg, self._read_off, limit)
            return records

    def commit(self, count: int) -> None:
        """Mark the first ``count`` peeked records as published; deletes drained segments."""
        if count <= 0:
            return
        with self._lock:
            records, seg, off = self._read_from(self._read_seg, self._read_off, count)
            assert len(records) == count, "commit of records that were not peeked"
            old = self._read_seg
            self._read_seg, self._read_off = seg, off
            self._save_cursor()
            self._pending -= count
            for s in range(old, seg):
                self._path(s).unlink(missing_ok=True)

    @property
    def pending(self) -> int:
        return self._pending

    def close(self) -> None:
        with self._lock:
            self._fh.close()
            self._lockfile.close()
