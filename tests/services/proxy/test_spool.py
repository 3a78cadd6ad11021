"""The durable spool: order, persistence of the cursor across restarts, torn tails, segment rotation."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.proxy.spool import Spool


def test_append_peek_commit_in_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([b"a", b"b"])
    spool.append([b"c"])
    assert spool.pending == 3
    assert spool.peek(2) == [b"a", b"b"]
    spool.commit(2)
    assert spool.peek(10) == [b"c"] and spool.pending == 1
    spool.close()


def test_cursor_and_records_survive_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([f"r{i}".encode() for i in range(5)])
    spool.commit(2)
    spool.close()
    again = Spool(tmp_path)
    assert again.pending == 3
    assert again.peek(10) == [b"r2", b"r3", b"r4"]
    again.close()


def test_a_corrupt_cursor_resends_from_the_oldest_segment_and_a_text_cursor_is_read(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([b"r0", b"r1", b"r2"])
    spool.commit(2)
    spool.close()
    cursor = tmp_path / "cursor"
    assert len(cursor.read_bytes()) == 20  # [u64 segment][u64 offset][u32 crc]
    raw = bytearray(cursor.read_bytes())
    raw[9] ^= 0xFF  # a torn or damaged cursor: the CRC fails
    cursor.write_bytes(bytes(raw))
    again = Spool(tmp_path)
    assert again.peek(10) == [b"r0", b"r1", b"r2"]  # resent, never skipped
    again.commit(1)
    again.close()
    (seg,) = tmp_path.glob("seg-*.log")
    cursor.write_text(f"{int(seg.stem[4:])} {2 * (8 + 2)}")  # the text format of earlier versions: after r1
    legacy = Spool(tmp_path)
    assert legacy.peek(10) == [b"r2"]
    legacy.close()


def test_a_torn_tail_is_cut_off(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append([b"whole"])
    spool.close()
    (seg,) = tmp_path.glob("seg-*.log")
    with open(seg, "ab") as fh:
        fh.write(b"\x10\x00\x00\x00\x00\x00\x00\x00par")  # a header and half a payload: a crash mid-write
    again = Spool(tmp_path)
    assert again.peek(10) == [b"whole"]
    again.append([b"next"])
    assert again.peek(10) == [b"whole", b"next"]
    again.close()


def test_segments_rotate_and_drained_ones_are_deleted(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=64)
    records = [bytes([65 + i]) * 40 for i in range(6)]
    for r in records:
        spool.append([r])
    assert len(list(tmp_path.glob("seg-*.log"))) >= 3
    assert spool.peek(10) == records
    spool.commit(5)
    assert spool.peek(10) == records[5:]
    assert len(list(tmp_path.glob("seg-*.log"))) <= 2
    spool.close()
    again = Spool(tmp_path, segment_bytes=64)
    assert again.peek(10) == records[5:] and again.pending == 1
    again.close()


def test_published_records_leave_the_disk_once_everything_is_published(tmp_path: Path) -> None:
    """Issue 32: the spool holds turns in the clear, and a drained segment was deleted only once it filled (64 MiB),
    so a quiet proxy kept its last turns on disk indefinitely. Once all is published the segment goes."""
    spool = Spool(tmp_path)
    spool.append([b"my secret turn", b"another"])
    spool.commit(1)
    assert any(
        b"my secret turn" in p.read_bytes() for p in tmp_path.glob("seg-*.log")
    )  # one still unpublished
    spool.commit(1)
    assert not any(
        b"my secret" in p.read_bytes() or b"another" in p.read_bytes() for p in tmp_path.glob("seg-*")
    )
    spool.append([b"later"])
    spool.close()
    again = Spool(tmp_path)  # the cursor follows: nothing published comes back, nothing new is lost
    assert again.peek(10) == [b"later"] and again.pending == 1
    again.commit(1)
    again.close()


def test_one_process_per_spool(tmp_path: Path) -> None:
    first = Spool(tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        Spool(tmp_path)
    first.close()
    Spool(tmp_path).close()


def test_memory_mirror_falls_back_to_the_files_and_recovers(tmp_path: Path) -> None:
    spool = Spool(tmp_path, memory_bytes=100)
    assert spool.in_memory
    records = [bytes([97 + i]) * 30 for i in range(8)]  # 240 bytes: more than the mirror holds
    for r in records:
        spool.append([r])
    assert not spool.in_memory
    assert spool.peek(3) == records[:3]
    spool.commit(3)
    assert spool.peek(100) == records[3:]
    spool.commit(5)
    assert spool.pending == 0 and spool.in_memory  # caught up: mirrored again
    spool.append([b"new"])
    assert spool.peek(10) == [b"new"]
    spool.close()


def test_written_records_are_published_only_once_synced(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.write([b"a", b"b"])
    assert spool.pending == 0 and spool.unsynced == 2 and spool.peek(10) == []
    assert spool.sync() == 2
    assert spool.pending == 2 and spool.unsynced == 0 and spool.peek(10) == [b"a", b"b"]
    assert spool.sync() == 0
    spool.close()


def test_records_written_but_never_synced_survive_a_killed_process(tmp_path: Path) -> None:
    """kill -9 right after ``write``: the page cache keeps the records, and the next spool publishes them."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from services.proxy.spool import Spool\n"
            f"s = Spool({str(tmp_path)!r})\n"
            "s.append([b'synced'])\n"
            "s.write([b'written-1', b'written-2'])\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    again = Spool(tmp_path)
    assert again.pending == 3
    assert again.peek(10) == [b"synced", b"written-1", b"written-2"]
    again.close()


def test_unsynced_records_across_a_segment_boundary_are_all_synced(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=64)
    records = [f"record-{i:03d}".encode() * 2 for i in range(12)]
    for r in records[:5]:
        spool.write([r])
    assert spool.sync() == 5
    for r in records[5:]:
        spool.write([r])
    assert len(list(tmp_path.glob("seg-*.log"))) > 2
    assert spool.sync() == 7
    assert spool.peek(100) == records
    spool.commit(12)
    spool.close()
    assert Spool(tmp_path).pending == 0


def test_closing_syncs_what_was_written(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.write([b"late"])
    spool.close()
    again = Spool(tmp_path)
    assert again.peek(10) == [b"late"]
    again.close()


def test_a_segment_is_not_rolled_away_while_a_sync_of_its_records_is_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy's kill -9 fault test lost a turn: ``sync`` takes the written records out of the unsynced list and
    fsyncs outside the lock; a ``commit`` of everything published before, landing in that window, saw nothing
    pending or unsynced and deleted the segment holding the records being synced (and moved the cursor past
    them). A killed proxy then lost them. Here the window is held open: the segment survives, and a spool
    reopened without any further step finds the record."""
    import os
    import threading

    spool = Spool(tmp_path)
    spool.append([b"published"])
    spool.write([b"being synced"])
    entered, release = threading.Event(), threading.Event()
    real = os.fdatasync

    def slow_fdatasync(fd: int) -> None:
        entered.set()
        release.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    syncing = threading.Thread(target=spool.sync)
    syncing.start()
    assert entered.wait(10)
    spool.commit(1)  # everything counted as pending is published, while "being synced" is in flight
    assert any(b"being synced" in p.read_bytes() for p in tmp_path.glob("seg-*.log"))
    release.set()
    syncing.join(10)
    monkeypatch.setattr(os, "fdatasync", real)
    spool.close()
    again = Spool(tmp_path)  # the files and cursor as they are: the record was neither deleted nor skipped
    assert again.peek(10) == [b"being synced"] and again.pending == 1
    again.close()
