"""A service started with ``die_with_parent`` (as ``turnstream run`` starts every service) does not outlive its
parent, even when the parent is killed with SIGKILL: the kernel sends it SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from runtime.process.ports import free_port

PARENT = textwrap.dedent(
    """
    import sys, time
    from runtime.process.launch import ServiceProcess
    port = int(sys.argv[1])
    env = {
        "TURNSTREAM_METRICS_PORT": str(port),
        "TURNSTREAM_KAFKA_BOOTSTRAP": "127.0.0.1:1",  # unreachable: the pairer waits for it, alive
        "TURNSTREAM_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    child = ServiceProcess(["pairer"], port=port, ready_path="/metrics", env=env, die_with_parent=True)
    print(child.proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_sigkilled_parent_leaves_no_service_behind() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(free_port())],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running() and child.ppid() == parent.pid
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the service outlived its SIGKILLed parent"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()


ORPHANING = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like an engine too busy (or too early) to handle it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
    """
)


def test_a_service_killed_after_its_grace_takes_what_it_started_with_it(tmp_path: Path) -> None:
    """SGLang takes its scheduler and detokenizer down only on a SIGTERM it handles: a stop that has to SIGKILL it
    must not leave them running (they held ~1 GB each)."""
    from runtime.process.launch import ServiceProcess

    port = free_port()
    log = open(tmp_path / "out.log", "w")
    proc = ServiceProcess(
        [str(port)], port=port, ready_path="/", log=log, program=[sys.executable, "-c", ORPHANING]
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "out.log").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    child = int((tmp_path / "out.log").read_text().split()[0])
    assert psutil.pid_exists(child)
    assert proc.stop(timeout_s=1) is None  # ignored SIGTERM: killed
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.1)
    log.close()


ABANDONING = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    # A helper whose parent exited at once: re-parented away from this process before any stop (as SGLang's
    # detokenizer and multiprocessing's resource tracker are when the process that made them goes first).
    middle = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
         " print(p.pid, flush=True)"],
        stdout=subprocess.PIPE, text=True,
    )
    print(middle.stdout.readline().strip(), flush=True)
    middle.wait()

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
    """
)


def test_a_stop_takes_even_the_helpers_a_service_abandoned(tmp_path: Path) -> None:
    """Issue 32, item 11: after ``turnstream run`` stopped, SGLang's detokenizers and resource trackers (about 1 GB
    each) were still running: orphaned, they were no longer below the service a stop looks under. Every service
    runs in a process group of its own, and a stop ends the group."""
    from runtime.process.launch import ServiceProcess

    port = free_port()
    log = open(tmp_path / "out.log", "w")
    proc = ServiceProcess(
        [str(port)], port=port, ready_path="/", log=log, program=[sys.executable, "-c", ABANDONING]
    )
    orphan = psutil.Process(int((tmp_path / "out.log").read_text().split()[0]))
    assert orphan.is_running() and orphan.ppid() != proc.proc.pid  # re-parented: no longer below the service
    proc.stop(timeout_s=5)
    deadline = time.monotonic() + 10
    while orphan.is_running() and orphan.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the abandoned helper outlived the stop"
        time.sleep(0.1)
    log.close()
