"""A service started with ``die_with_parent`` (as ``turnstream run`` starts every service) does not outlive its
parent, even when the parent is killed with SIGKILL: the kernel sends it SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil

from services.launch import free_port

PARENT = textwrap.dedent(
    """
    import sys, time
    from services.launch import ServiceProcess
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
