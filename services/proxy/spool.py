"""A durable, ordered, file-backed spool: turns are written (and fsync'd) here first, then published to Kafka
in order; the read cursor advances only after Kafka acknowledged them.

Layout: ``seg-<n>.log`` files of records ``[u32 length][u32 crc32][payload]`` and a ``cursor`` file holding
``[u64 segment][u64 offset][u32 crc32]`` of the next record to publish, overwritten in place with one ``pwrite``
(20 bytes: no rename and no open per save, which had cost the proxy 7% of its CPU; a torn cursor fails its CRC
and the spool restarts from its oldest segment, resending, never skipping). The text cursor of older versions
is still read. A torn tail record (a crash while
writing) fails its CRC and is cut off at open. Drained segments are deleted.

Records are handed to the OS as they come (``write``: one ``write`` call, no fsync), so a killed proxy loses
none of them, and fsync'd in groups (``sync``, from a worker thread); only fsync'd records are published.
The cursor is persisted without fsync and at most every ``cursor_interval_s``: after a crash the spool may
resend a few records Kafka already has, never skip one (turn ids are stable, so a resend is recognisable).
Unpublished records are also kept in memory (up to ``memory_bytes``) so publishing does not re-read the file
in the common case.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import BinaryIO

from runtime.security.files import private_dir, private_opener

_HEADER = struct.Struct("<II")
_CURSOR = struct.Struct("<QQ")
SEGMENT_BYTES = 64 * 1024 * 1024


def _read_records(fh: BinaryIO, offset: int, limit: int) -> tuple[list[bytes], int]:
    """Up to ``limit`` intact records from ``offset``; stops at the end or at a torn/corrupt record. Returns the
    records and the offset just after the last one."""
    fh.seek(offset)
    out: list[bytes] = []
    while len(out) < limit:
        header = fh.read(_HEADER.size)
        if len(header) < _HEADER.size:
            break
        length, crc = _HEADER.unpack(header)
        payload = fh.read(length)
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        out.append(payload)
        offset = fh.tell()
    return out, offset


def _append(path: Path) -> BinaryIO:
    """A segment opened for appending, created 0600."""
    return open(path, "ab", opener=private_opener)


class Spool:
    def __init__(
        self,
        directory: str | Path,
        segment_bytes: int = SEGMENT_BYTES,
        memory_bytes: int = 64 * 1024 * 1024,
        cursor_interval_s: float = 0.2,
    ) -> None:
        self.dir = Path(directory)
        private_dir(self.dir)  # people's conversations: the owner's only
        self.segment_bytes = segment_bytes
        self.memory_bytes = memory_bytes
        self.cursor_interval_s = cursor_interval_s
        self._cursor_saved_at = 0.0
        self._cursor_dirty = False
        # In-memory mirror of the unpublished records with their end positions; valid while _mem_complete.
        self._mem: deque[tuple[bytes, int, int]] = deque()
        self._mem_bytes = 0
        self._mem_complete = False
        self._lock = threading.Lock()
        # One process per spool: two publishers draining one spool would send every turn twice.
        self._lockfile = open(self.dir / "lock", "w", opener=private_opener)
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
        self._cursor_fd = os.open(self.dir / "cursor", os.O_RDWR | os.O_CREAT, 0o600)
        self._truncate_torn_tail(self._write_seg)
        self._fh = _append(self._path(self._write_seg))
        # Written, not yet fsync'd: (payload, segment, end) in order, and the files they are in.
        self._unsynced: list[tuple[bytes, int, int]] = []
        self._unsynced_files: list[BinaryIO] = []
        self._syncing = 0
        """Records ``sync`` took from ``_unsynced`` and has not yet counted as pending (its fsync is under way
        outside the lock): they are in the write segment, which must not be rolled away meanwhile."""
        self._unpublished_bytes = 0
        self._pending = self._count_pending()
        self._mem_complete = self._pending == 0

    # paths and cursor ----------------------------------------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.dir / f"seg-{seg:012d}.log"

    def _segments(self) -> list[int]:
        return sorted(int(p.stem[4:]) for p in self.dir.glob("seg-*.log"))

    def _load_cursor(self, segments: list[int]) -> tuple[int, int]:
        fallback = (segments[0] if segments else 0), 0
        try:
            raw = (self.dir / "cursor").read_bytes()
        except FileNotFoundError:
            return fallback
        if len(raw) == _CURSOR.size + 4:
            body, (crc,) = raw[: _CURSOR.size], struct.unpack("<I", raw[_CURSOR.size :])
            if zlib.crc32(body) == crc:
                seg, off = _CURSOR.unpack(body)
                return seg, off
        try:  # the text cursor written by earlier versions
            seg_s, off_s = raw.decode().split()
            return int(seg_s), int(off_s)
        except (UnicodeDecodeError, ValueError):
            return fallback

    def _save_cursor(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._cursor_saved_at < self.cursor_interval_s:
            self._cursor_dirty = True
            return
        body = _CURSOR.pack(self._read_seg, self._read_off)
        os.pwrite(self._cursor_fd, body + struct.pack("<I", zlib.crc32(body)), 0)
        self._cursor_saved_at = now
        self._cursor_dirty = False

    def _truncate_torn_tail(self, seg: int) -> None:
        path = self._path(seg)
        if not path.exists():
            return
        with open(path, "rb") as fh:
            _, good = _read_records(fh, 0, 1 << 62)
        if good < path.stat().st_size:
            with open(path, "r+b") as fh:
                fh.truncate(good)

    def _count_pending(self) -> int:
        n = 0
        seg, off = self._read_seg, self._read_off
        while True:
            records, seg, off = self._read_from(seg, off, 1 << 30)
            n += len(records)
            self._unpublished_bytes += sum(_HEADER.size + len(r) for r in records)
            if not records:
                return n

    # writing -------------------------------------------------------------------------------------------------

    def write(self, payloads: list[bytes]) -> None:
        """Hand records to the OS (no fsync): from here on they survive the process being killed, and reopening
        the spool finds them. A page-cache write, cheap enough for the event loop; ``sync`` makes them durable and
        publishable. Raises OSError (disk full), in which case none of ``payloads`` was kept."""
        if not payloads:
            return
        buf = bytearray()
        for p in payloads:
            buf += _HEADER.pack(len(p), zlib.crc32(p))
            buf += p
        with self._lock:
            start = self._fh.tell()
            try:
                self._fh.write(buf)
                self._fh.flush()
            except OSError:
                self._fh.truncate(start)  # no torn record in front of the next write
                self._fh.seek(start)
                raise
            self._unpublished_bytes += len(buf)
            seg, end = self._write_seg, start
            for p in payloads:
                end += _HEADER.size + len(p)
                self._unsynced.append((p, seg, end))
            if not self._unsynced_files or self._unsynced_files[-1] is not self._fh:
                self._unsynced_files.append(self._fh)
            if end >= self.segment_bytes:
                self._write_seg += 1
                self._fh = _append(self._path(self._write_seg))

    def sync(self) -> int:
        """fsync what ``write`` handed over (one fsync per file) and make it visible to ``peek``. Blocking: call it
        from a worker thread. Returns how many records became durable."""
        with self._lock:
            records, self._unsynced = self._unsynced, []
            files, self._unsynced_files = self._unsynced_files, []
            self._syncing += len(records)
        try:
            for fh in files:
                os.fdatasync(fh.fileno())  # outside the lock: writers and publishers keep going meanwhile
        except BaseException:
            with self._lock:  # not durable: written again by the next sync
                self._unsynced[:0] = records
                self._unsynced_files[:0] = [f for f in files if f not in self._unsynced_files]
                self._syncing -= len(records)
            raise
        with self._lock:
            self._syncing -= len(records)
            for fh in files:
                if fh is not self._fh and fh not in self._unsynced_files:
                    fh.close()  # a finished segment, all of it durable
            if not records:
                return 0
            self._pending += len(records)
            if self._mem_complete:
                for p, seg, end in records:
                    self._mem.append((p, seg, end))
                    self._mem_bytes += len(p)
                if self._mem_bytes > self.memory_bytes:  # a long outage: fall back to reading the files
                    self._mem.clear()
                    self._mem_bytes = 0
                    self._mem_complete = False
        return len(records)

    @property
    def unsynced(self) -> int:
        return len(self._unsynced)

    def append(self, payloads: list[bytes]) -> None:
        """``write`` and ``sync`` (blocking)."""
        self.write(payloads)
        self.sync()

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
                records, off = _read_records(fh, off, limit - len(out))
                out.extend(records)
            if len(out) < limit and seg < self._write_seg:
                seg, off = seg + 1, 0
                continue
            break
        return out, seg, off

    @property
    def in_memory(self) -> bool:
        """Whether peek/commit work from memory (no file reads): callers may then skip a worker thread."""
        return self._mem_complete

    def peek(self, limit: int = 256) -> list[bytes]:
        """The next records to publish, oldest first (without consuming them)."""
        with self._lock:
            if self._mem_complete:
                return [self._mem[i][0] for i in range(min(limit, len(self._mem)))]
            records, _, _ = self._read_from(self._read_seg, self._read_off, min(limit, self._pending))
            return records

    def commit(self, count: int) -> None:
        """Mark the first ``count`` peeked records as published; deletes drained segments."""
        if count <= 0:
            return
        with self._lock:
            if self._mem_complete:
                for _ in range(count):
                    payload, seg, off = self._mem.popleft()
                    self._mem_bytes -= len(payload)
                    self._unpublished_bytes -= _HEADER.size + len(payload)
            else:
                records, seg, off = self._read_from(self._read_seg, self._read_off, count)
                assert len(records) == count, "commit of records that were not peeked"
                self._unpublished_bytes -= sum(_HEADER.size + len(r) for r in records)
            old = self._read_seg
            self._read_seg, self._read_off = seg, off
            self._pending -= count
            if self._pending == 0 and not self._mem_complete:
                self._mem_complete = True  # caught up: new records can be mirrored again
            self._save_cursor(force=seg != old)
            for s in range(old, seg):
                self._path(s).unlink(missing_ok=True)
            if (
                self._pending == 0
                and not self._unsynced
                and not self._syncing
                and self._read_off > 0
                and seg == self._write_seg
            ):
                self._roll_drained()

    def _roll_drained(self) -> None:
        """Everything written is published: continue in a fresh segment and delete the old one, so published turns
        (people's conversations, in the clear) do not linger on disk until a segment fills (64 MiB)."""
        drained, old_fh = self._write_seg, self._fh
        self._write_seg += 1
        self._fh = _append(self._path(self._write_seg))
        self._read_seg, self._read_off = self._write_seg, 0
        self._save_cursor(force=True)
        old_fh.close()
        self._path(drained).unlink(missing_ok=True)

    def flush_cursor(self) -> None:
        with self._lock:
            if self._cursor_dirty:
                self._save_cursor(force=True)

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def unpublished_bytes(self) -> int:
        """Bytes of records written and not yet published (synced or not): what an outage makes grow."""
        return self._unpublished_bytes

    def close(self) -> None:
        self.sync()
        with self._lock:
            if self._cursor_dirty:
                self._save_cursor(force=True)
            self._fh.close()
            os.close(self._cursor_fd)
            self._lockfile.close()
