"""Ports that nothing else can take between the pick and the bind: below the kernel's ephemeral range (where
outgoing connections get theirs), once per process, and never the same one for two processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runtime.process import ports
from runtime.process.ports import ephemeral_low, free_port, free_port_block, port_range

HOLD = """
import sys, time
from runtime.process.ports import free_port
print(free_port(), flush=True)
sys.stdin.readline()
"""


def test_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    low, high = port_range()
    assert high < ephemeral_low()
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == 200
    assert all(low <= p <= high for p in picked)
    base = free_port_block(8)
    assert not set(range(base, base + 8)) & set(picked)
    for p in [*picked, *range(base, base + 8)]:  # each one is bindable by whoever it was handed to
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_or_held_by_another_process_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    base = free_port_block(4)  # four ports nobody else in this run holds or binds, for a world of their own:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # lock files of their own (this process holds the real ones)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ports, "_held", {})
    monkeypatch.setenv("TURNSTREAM_PORT_RANGE", f"{base}-{base + 3}")
    listening = socket.socket()
    listening.bind(("127.0.0.1", base))
    listening.listen()
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TURNSTREAM_PORT_RANGE": f"{base + 1}-{base + 1}", "PYTHONPATH": "."},
    )
    try:
        assert other.stdout is not None and int(other.stdout.readline()) == base + 1
        mine = {free_port(), free_port()}
        assert mine == {base + 2, base + 3}  # not the listened-on one, not the other process's
        with pytest.raises(RuntimeError, match="no 1 consecutive free ports"):
            free_port()
    finally:
        listening.close()
        other.communicate("\n", timeout=30)
        for fd in ports._held.values():
            os.close(fd)


def test_a_range_reaching_into_the_ephemeral_one_is_cut_and_an_empty_one_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TURNSTREAM_PORT_RANGE", f"15000-{ephemeral_low() + 500}")
    assert port_range() == (15000, ephemeral_low() - 1)
    monkeypatch.setenv("TURNSTREAM_PORT_RANGE", f"{ephemeral_low()}-{ephemeral_low() + 10}")
    with pytest.raises(RuntimeError, match="no ports to allocate"):
        port_range()
