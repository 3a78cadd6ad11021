"""Start a turnstream service as a subprocess and wait until it answers (tests, benchmarks, local runs)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

import httpx

PARENT_ENV = "TURNSTREAM_DIE_WITH_PARENT"


def die_with_parent_from_env() -> None:
    """Called first thing in a service started with ``die_with_parent``: ask the kernel (Linux) for SIGTERM when the
    parent dies, even by SIGKILL, so no service outlives the ``turnstream run`` that started it. Done in the child
    after exec rather than in a ``preexec_fn``, which is unsafe in a process with threads."""
    expected = os.environ.pop(PARENT_ENV, None)
    if not expected or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(expected):  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _started(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below ``pid`` now (from Linux's /proc; empty where there is none): the
    start time tells a process from a later one that reuses its pid."""
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        found = _started(int(entry))
        if found is not None:
            children.setdefault(found[0], []).append((int(entry), found[1]))
    out: list[tuple[int, int]] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += [p for p, _ in kids]
    return out


def end_group(pgid: int, grace_s: float = 3.0) -> None:
    """SIGTERM to what is left of a process group, SIGKILL to what is left ``grace_s`` later."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies, waiting for their new parent to reap them, do not)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class ServiceProcess:
    """``python -m services.cli <args>`` (or ``program`` with ``args``, e.g. a stub engine script) with ``env``
    added to this process's environment; ready once ``GET <url><ready_path>`` answers 200."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        port: int,
        ready_path: str,
        env: Mapping[str, str] | None = None,
        log: IO[str] | None = None,
        startup_timeout_s: float = 180.0,
        die_with_parent: bool = False,
        wait: bool = True,
        program: Sequence[str] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.name = os.path.basename(program[-1]) if program else args[0]
        self._devnull = None if log is not None else open(os.devnull, "w")
        self._argv = [*(program or (sys.executable, "-m", "services.cli")), *args]
        self._env = {
            **os.environ,
            "TURNSTREAM_LOGGING_FORMAT": "text",
            **(env or {}),
            **({PARENT_ENV: str(os.getpid())} if die_with_parent else {}),
        }
        self._log = log
        self.ready_path = ready_path
        self.proc = self._spawn()
        self.startup_timeout_s = startup_timeout_s
        if wait:
            self.wait_ready(ready_path)

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self._devnull is None and self._log is None:
            self._devnull = open(os.devnull, "w")
        # A process group of its own: at a stop, whatever it started goes too, even helpers that were orphaned
        # (re-parented away from it) before the stop; and a terminal's Ctrl-C reaches only the supervisor, which
        # stops services in order.
        return subprocess.Popen(
            self._argv,
            env=self._env,
            stdout=self._log or self._devnull,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def restart(self) -> None:
        """Stop and start it again, same command and port (a crash and its supervisor, in a test)."""
        self.stop()
        self.proc = self._spawn()
        self.wait_ready(self.ready_path)

    def wait_ready(self, ready_path: str, abort: threading.Event | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if abort is not None and abort.is_set():
                raise RuntimeError(f"{self.name}: startup aborted")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} was not ready within {self.startup_timeout_s} s")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (services finish in-flight work and flush), then SIGKILL after ``timeout_s``. Returns the exit
        code, or None if it had to be killed. Whatever it started and left behind goes too: SGLang takes its
        scheduler and detokenizer down only on a SIGTERM it handles, so one killed, or stopped before its handler
        was installed, left them running (~1 GB each)."""
        below = descendants(self.proc.pid)
        self.proc.terminate()
        code: int | None
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        end_group(self.proc.pid)
        for pid, start in below:  # any that left its group
            now = _started(pid)
            if now is not None and now[1] == start:  # the same process, not one that took over its pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if self._devnull is not None:
            self._devnull.close()
            self._devnull = None
        return code

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
