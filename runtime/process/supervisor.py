"""Starts planned services (``turnstream run``'s pipeline, a replay's stages) stage by stage, notices one that
dies, and stops them all: SIGTERM in reverse order (each service finishes its step and commits its offsets),
SIGKILL for any still running after 30 s; each service runs in a process group of its own, which a stop ends, so
helpers it started (SGLang's scheduler, detokenizer, resource tracker) go too, even orphaned ones. Children also
get SIGTERM from the kernel if the supervisor itself dies."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import IO

import msgspec

from runtime.process.launch import ServiceProcess


class Service(msgspec.Struct, frozen=True):
    name: str
    args: list[str]
    """Arguments of ``python -m services.cli``."""
    env: dict[str, str]
    port: int
    """Where readiness and /metrics are served."""
    ready_path: str
    stage: int
    """Services of one stage start together; a stage starts once the previous one is ready."""
    stop_timeout_s: float = 30.0
    """How long after SIGTERM before SIGKILL."""


class StartupFailed(RuntimeError):
    def __init__(self, name: str, reason: str, log: Path) -> None:
        super().__init__(f"{name} did not start: {reason}\n--- last lines of {log} ---\n{tail(log)}")
        self.name = name


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Supervisor:
    def __init__(self, services: list[Service], run_dir: Path, startup_timeout_s: float) -> None:
        self.services = services
        self.run_dir = run_dir
        self.startup_timeout_s = startup_timeout_s
        self.running: dict[str, ServiceProcess] = {}
        self._logs: list[IO[str]] = []
        self.abort = threading.Event()

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def start(self) -> None:
        """Blocking; raises StartupFailed (the caller stops what did start)."""
        for stage in sorted({s.stage for s in self.services}):
            batch = [s for s in self.services if s.stage == stage]
            for s in batch:
                if self.abort.is_set():
                    return
                log = open(self.log_path(s.name), "a")
                self._logs.append(log)
                self.running[s.name] = ServiceProcess(
                    s.args,
                    port=s.port,
                    ready_path=s.ready_path,
                    env=s.env,
                    log=log,
                    startup_timeout_s=self.startup_timeout_s,
                    die_with_parent=True,
                    wait=False,
                )
            for s in batch:
                try:
                    self.running[s.name].wait_ready(s.ready_path, abort=self.abort)
                except (RuntimeError, TimeoutError) as exc:
                    raise StartupFailed(s.name, str(exc), self.log_path(s.name)) from None

    def dead(self) -> list[tuple[str, int]]:
        return [(name, p.proc.returncode) for name, p in self.running.items() if p.proc.poll() is not None]

    def stop(self) -> list[tuple[str, int | None]]:
        """Stop everything; returns each service's exit code (None: had to be killed)."""
        procs = list(self.running.items())[::-1]
        for _, p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
        grace = {s.name: s.stop_timeout_s for s in self.services}
        codes = [(name, p.stop(grace.get(name, 30.0))) for name, p in procs]
        for log in self._logs:
            log.close()
        return codes
