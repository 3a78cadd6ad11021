"""The suite's bill, printed at the end of every run (and written as JSON to ``TURNSTREAM_TEST_REPORT``, default
``$TMPDIR/turnstream-test-report.json``): seconds per file, of which waiting for a server to answer
(``ServiceProcess.wait_ready``: SGLang, proxies, workers, stubs), and every SGLang server started during the run,
by configuration, so that a new test's cost shows the day it lands (docs/development.md, "The budget").

SGLang starts are counted from outside: a thread reads /proc once a second for ``sglang.launch_server`` processes
below this one, whoever started them (a fixture, ``turnstream run``, a test's restart). A start of a configuration
on a port it already ran on is a restart."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from runtime.process.launch import ServiceProcess

FLAGS = ("--enable-lora", "--reasoning-parser", "--api-key", "--tool-call-parser")
"""What tells one SGLang configuration from another in its command line (beside the served model's name)."""


@dataclass
class EngineStart:
    at: float
    port: str
    config: str
    file: str


@dataclass
class Bill:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    waiting: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lanes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds of test per xdist worker (``pytest --lanes``: gw0 the engines lane, gw1 the CPU lane)."""
    starts: list[EngineStart] = field(default_factory=list)
    current: str = "(collection)"
    began: float = field(default_factory=time.monotonic)


BILL = Bill()


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def engine_config(argv: list[str]) -> tuple[str, str] | None:
    """(port, configuration) of an SGLang server's command line; None for any other process."""
    if "sglang.launch_server" not in argv:
        return None

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else ""

    present = [f.lstrip("-") for f in FLAGS if any(a == f or a.startswith(f + "=") for a in argv)]
    return value("--port"), "+".join([value("--served-model-name") or "?", *present])


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _below(pid: int, root: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == root:
            return True
    return False


def _watch_engines(stop: threading.Event) -> None:
    seen: set[tuple[int, str]] = set()
    while not stop.wait(1.0):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                raw = Path(f"/proc/{entry}/cmdline").read_bytes()
                started = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[19]
            except (OSError, IndexError):
                continue
            if b"sglang.launch_server" not in raw or (int(entry), started) in seen:
                continue
            seen.add((int(entry), started))
            if not _below(int(entry), os.getpid()):  # another run's, or one kept from before
                continue
            try:  # a child SGLang forks keeps its parent's command line until it names itself
                if b"sglang.launch_server" in Path(f"/proc/{_parent(int(entry))}/cmdline").read_bytes():
                    continue
            except OSError:
                pass
            found = engine_config(raw.decode(errors="replace").split("\0"))
            if found:
                BILL.starts.append(EngineStart(time.monotonic() - BILL.began, *found, BILL.current))


def _timed_wait_ready(original: Any) -> Any:
    def wait_ready(self: ServiceProcess, *args: Any, **kwargs: Any) -> None:
        began, file = time.monotonic(), BILL.current
        try:
            original(self, *args, **kwargs)
        finally:
            BILL.waiting[file] += time.monotonic() - began

    return wait_ready


_stop = threading.Event()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(ServiceProcess.wait_ready, "__wrapped_by_report__"):
        timed = _timed_wait_ready(ServiceProcess.wait_ready)
        timed.__wrapped_by_report__ = True  # type: ignore[attr-defined]
        ServiceProcess.wait_ready = timed  # type: ignore[method-assign]
    # The process at the top counts the starts: an xdist worker's are below the controller too.
    if os.path.isdir("/proc") and not hasattr(config, "workerinput"):
        threading.Thread(target=_watch_engines, args=(_stop,), daemon=True, name="engine-starts").start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    BILL.current = _file(item.nodeid)
    return (yield)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Seen in the process that reports: the controller, for an xdist run (each worker's reports reach it)."""
    BILL.seconds[_file(report.nodeid)] += report.duration
    if report.when == "teardown":
        BILL.tests[_file(report.nodeid)] += 1
    node = getattr(report, "node", None)
    if node is not None:
        BILL.lanes[node.gateway.id] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In an xdist worker: hand its waits to the controller."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["turnstream_waiting"] = dict(BILL.waiting)


def pytest_testnodedown(node: Any, error: object) -> None:
    """In the controller: a worker's waits, added to the bill."""
    for file, seconds in getattr(node, "workeroutput", {}).get("turnstream_waiting", {}).items():
        BILL.waiting[file] += seconds


def summary() -> dict[str, Any]:
    """The bill as JSON: files slowest first, and the SGLang starts (a restart: a configuration's port again)."""
    files = sorted(BILL.seconds, key=lambda f: -BILL.seconds[f])
    ran: set[tuple[str, str]] = set()
    starts = []
    for s in BILL.starts:
        starts.append({**vars(s), "at": round(s.at, 1), "restart": (s.config, s.port) in ran})
        ran.add((s.config, s.port))
    by_config: dict[str, dict[str, int]] = defaultdict(lambda: {"starts": 0, "restarts": 0})
    for s in starts:
        by_config[s["config"]]["restarts" if s["restart"] else "starts"] += 1
    return {
        "seconds": round(time.monotonic() - BILL.began, 1),
        "files": [
            {
                "file": f,
                "seconds": round(BILL.seconds[f], 1),
                "waiting": round(BILL.waiting.get(f, 0.0), 1),
                "tests": BILL.tests.get(f, 0),
            }
            for f in files
        ],
        "lanes": {worker: round(seconds, 1) for worker, seconds in sorted(BILL.lanes.items())},
        "engine_starts": starts,
        "engines": dict(by_config),
    }


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    _stop.set()
    if config.option.collectonly:
        return
    bill = summary()
    out = Path(
        os.environ.get("TURNSTREAM_TEST_REPORT")
        or Path(tempfile.gettempdir()) / "turnstream-test-report.json"
    )
    out.write_text(json.dumps(bill, indent=1))
    write = terminalreporter.write_line
    terminalreporter.section("the suite's bill (docs/development.md: the budget)")
    write(f"{'seconds':>8} {'waiting':>8} {'tests':>5}  file (slowest 20; all in {out})")
    for f in bill["files"][:20]:
        write(f"{f['seconds']:8.1f} {f['waiting']:8.1f} {f['tests']:5d}  {f['file']}")
    total = sum(f["seconds"] for f in bill["files"])
    waited = sum(f["waiting"] for f in bill["files"])
    write(f"{total:8.1f} {waited:8.1f} {sum(f['tests'] for f in bill['files']):5d}  all files")
    if bill["lanes"]:
        write(
            "lanes: "
            + ", ".join(f"{w} {s:.0f} s" for w, s in bill["lanes"].items())
            + " (gw0: engines, gw1: cpu)"
        )
    restarts = sum(c["restarts"] for c in bill["engines"].values())
    write(
        f"SGLang servers started: {len(bill['engine_starts'])} ({restarts} of them restarts on a port used before)"
    )
    for name, c in sorted(bill["engines"].items()):
        write(f"  {name}: started on {c['starts']} port(s), {c['restarts']} restart(s)")
