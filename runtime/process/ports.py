"""Ports for services that a test, a benchmark or ``turnstream replay`` starts and names before they bind.

``bind(0)`` hands out a port from the kernel's ephemeral range (``ip_local_port_range``, 32768-60999 on Linux),
and so does every outgoing connection: a port picked that way and bound a moment later by a child process can
meanwhile be the source port of somebody's connection (a Kafka client, SGLang starting), and the child fails with
``Address already in use``. The ports here come from a range below the ephemeral one, which the kernel never hands
out by itself: only an explicit bind can take them. A port is handed out once per process and held by a lock file
for the life of the process, so two processes that allocate at once (two pytest workers, a test and the
``turnstream replay`` it starts) never get the same one.

The range is 10000-15999, clear of the suite's fixed ports (Redis 16379, the Sentinel set 16479-16581, Kafka
19092-19093, the Kafka cluster 19192-19197), of SGLang's own pick for its torch.distributed port (22000-29999,
``get_free_port_below_ephemeral``) and of ``turnstream run``'s defaults (8000, 8080, 9101-9108, 30000, 30002).
``TURNSTREAM_PORT_RANGE=LOW-HIGH`` moves it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

DEFAULT_RANGE = (10000, 15999)
_lock = threading.Lock()
_held: dict[int, int] = {}
"""port -> the open lock file's descriptor: held (and so reserved) until this process exits."""


def ephemeral_low() -> int:
    """The lowest port the kernel picks by itself (Linux's ``ip_local_port_range``; 32768 where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int]:
    """The inclusive range ports are allocated from: below the ephemeral range, whatever is configured."""
    low, high = DEFAULT_RANGE
    if spec := os.environ.get("TURNSTREAM_PORT_RANGE"):
        first, _, last = spec.partition("-")
        low, high = int(first), int(last)
    high = min(high, ephemeral_low() - 1)
    if not 1024 <= low <= high:
        raise RuntimeError(
            f"no ports to allocate: range {low}-{high} (TURNSTREAM_PORT_RANGE, below the ephemeral range "
            f"from {ephemeral_low()})"
        )
    return low, high


def _lock_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / "turnstream-ports"
    folder.mkdir(mode=0o777, exist_ok=True)
    return folder


def bindable(port: int, *, reuse: bool = False) -> bool:
    """Whether nothing listens on or holds ``port`` now (loopback and the wildcard address). ``reuse``: as a server
    binds it (``SO_REUSEADDR``), past connections of an earlier listener still in TIME_WAIT."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as s:
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _claim(port: int) -> bool:
    """Take ``port`` for this process: unheld here, not locked by another process, and bindable now."""
    if port in _held:
        return False
    fd = os.open(_lock_dir() / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    if not bindable(port):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return False
    _held[port] = fd
    return True


def _release(ports: list[int]) -> None:
    for port in ports:
        fd = _held.pop(port, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive ports, all free now and reserved for this process from now on."""
    low, high = port_range()
    starts = list(range(low, high - n + 2))
    random.shuffle(starts)
    with _lock:
        for base in starts:
            block = range(base, base + n)
            taken: list[int] = []
            for port in block:
                if not _claim(port):
                    break
                taken.append(port)
            if len(taken) == n:
                return base
            _release(taken)
    raise RuntimeError(f"no {n} consecutive free ports in {low}-{high}")


def free_port() -> int:
    """A port that is free now, outside the ephemeral range, and handed out to nobody else."""
    return free_port_block(1)
