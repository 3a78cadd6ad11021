"""Issue 42's two attacks replayed against the proxy, this checkout against another git revision, one after the
other in one run (each on a proxy of its own, never at once: an attack on one would load the other's cores).
Prints JSON.

    .venv/bin/python bench/hostile.py [--base bf2bec2] [--attack bodies,connections] [--seconds 20]

``bodies``: one key sends ``--attackers`` (12) concurrent side requests of ``--body-mib`` (8) MiB, each a
``metadata`` array of empty lists, again and again, while another user's key sends plain requests one at a time.
Reported: that user's latency before and under the attack (median, p90, and their ratio: goal at most 2x), and
the proxy's memory (peak RSS under attack less RSS before: goal under 300 MB).

``connections``: one address (127.0.0.2, no key at all) opens ``--connections`` (1,030) TCP connections that never
send a byte and reopens any closed every 10 s, while other clients (127.0.0.1) send requests, each on a new
connection. Reported: the share of their requests served (goal at least 99%).

The attackers run in a process of their own (``--role``), so the client measured shares no event loop with them.
The stub engine answers after ``--latency-ms`` (20), as a model would take its time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import Started, start_kafka, start_redis, stop_started
from proxy import cpu_seconds, wait_http

from runtime.configuration.config import KafkaConfig
from runtime.messaging.topics import create_topics
from runtime.process.ports import free_port

REPO = Path(__file__).resolve().parent.parent
ATTACKER_KEY = "attacker-key-0123456789abcdef"
VICTIM_KEY = "victim-key-0123456789abcdef"
PLAIN = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8}


# ---- the attackers (a process of their own) ----------------------------------------------------------------


def attack_body(mib: int) -> bytes:
    """A side request of ``mib`` MiB (just under: the proxy's limit is 8 MiB) whose ``metadata`` is an array of
    empty lists."""
    size = mib * 1024 * 1024 - 64
    head = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "metadata": ['
    lists = b"[]," * ((size - len(head) - 3) // 3)
    return head + lists + b"[]]}"


async def post_raw(host: str, port: int, request: bytes) -> int:
    """One request on its own connection; the status (0: the connection failed)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return 0
    writer.write(request)  # sent by the transport while the answer is awaited: a refusal may come first
    sending = asyncio.ensure_future(writer.drain())
    try:
        answer = await reader.read(64)
        return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        sending.cancel()
        writer.close()


async def bodies(port: int, attackers: int, mib: int, seconds: float) -> dict[str, int]:
    body = attack_body(mib)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\nX-Turn-Type: side\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
        % (ATTACKER_KEY.encode(), len(body))
    ) + body
    statuses: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    async def attacker() -> None:
        while time.monotonic() < deadline:
            status = await post_raw("127.0.0.1", port, request)
            statuses[str(status)] = statuses.get(str(status), 0) + 1

    await asyncio.gather(*(attacker() for _ in range(attackers)))
    return statuses


async def connections(port: int, count: int, seconds: float) -> dict[str, int]:
    """``count`` connections from 127.0.0.2 that never send a byte, any closed reopened every 10 s."""
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened = failed = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        held = [(r, w) for r, w in held if not r.at_eof() and not w.is_closing()]
        for _ in range(count - len(held)):
            try:
                held.append(await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)))
                opened += 1
            except OSError:
                failed += 1
        await asyncio.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
    for _, w in held:
        w.close()
    return {"opened": opened, "failed_to_open": failed}


def role(args: argparse.Namespace) -> None:
    if args.role == "bodies":
        out = asyncio.run(bodies(args.port, args.attackers, args.body_mib, args.seconds))
    else:
        out = asyncio.run(connections(args.port, args.connections, args.seconds))
    print(json.dumps(out))


# ---- the measured side ----------------------------------------------------------------------------------


class PeakRss:
    """The largest RSS a process reaches while this runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


async def victim(url: str, seconds: float, fresh_connections: bool) -> list[float | None]:
    """Plain requests one at a time for ``seconds``, 100 ms apart: each one's latency in ms, None when it failed."""
    out: list[float | None] = []
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
    deadline = time.monotonic() + seconds
    shared = httpx.AsyncClient(timeout=30)
    try:
        i = 0
        while time.monotonic() < deadline:
            began = time.perf_counter()
            try:
                if fresh_connections:
                    async with httpx.AsyncClient(timeout=30) as http:
                        r = await http.post(url, json=PLAIN, headers={**headers, "X-Session-Id": f"v-{i}"})
                else:
                    r = await shared.post(url, json=PLAIN, headers={**headers, "X-Session-Id": f"v-{i}"})
                out.append(1000 * (time.perf_counter() - began) if r.status_code == 200 else None)
            except httpx.TransportError:
                out.append(None)
            i += 1
            await asyncio.sleep(0.1)
    finally:
        await shared.aclose()
    return out


def summary(latencies: list[float | None]) -> dict[str, Any]:
    ok = sorted(x for x in latencies if x is not None)
    return {
        "requests": len(latencies),
        "served": len(ok),
        "served_share": round(len(ok) / len(latencies), 4) if latencies else None,
        "median_ms": round(statistics.median(ok), 1) if ok else None,
        "p90_ms": round(ok[int(0.9 * (len(ok) - 1))], 1) if ok else None,
    }


def attackers(args: argparse.Namespace, kind: str, port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--role", kind, "--port", str(port), "--seconds", str(args.seconds)]
    cmd += ["--attackers", str(args.attackers), "--body-mib", str(args.body_mib)]
    cmd += ["--connections", str(args.connections)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


infra_pids: dict[str, int] = {}


def run_side(args: argparse.Namespace, root: Path, infra: dict[str, str], name: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"turnstream-hostile-{name}-"))
    keys = tmp / "keys"
    keys.write_text(f"attacker {ATTACKER_KEY}\nvictim {VICTIM_KEY}\n")
    keys.chmod(0o600)
    out: dict[str, Any] = {}
    for kind in args.attack.split(","):
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "TURNSTREAM_KAFKA_BOOTSTRAP": infra["bootstrap"],
            "TURNSTREAM_KAFKA_NAMESPACE": infra["namespace"],
            "TURNSTREAM_REDIS_URL": infra["redis"],
            "TURNSTREAM_REDIS_KEY_PREFIX": f"{infra['namespace']}{name}.{kind}.",
            "TURNSTREAM_ENGINE_URL": infra["engine"],
            "TURNSTREAM_PROXY_PORT": str(port),
            "TURNSTREAM_PROXY_SPOOL_DIR": str(tmp / f"spool-{kind}"),
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(tmp),
            "TURNSTREAM_PROXY_KEYS_FILE": str(keys),
            "TURNSTREAM_PROXY_RELOAD": "false",
            "TURNSTREAM_LOGGING_LEVEL": "WARNING",
        }
        proxy = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "proxy"], env=env, cwd=root, stdout=subprocess.DEVNULL
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            fresh = kind == "connections"
            asyncio.run(victim(url, 2, fresh))  # warm
            quiet = summary(asyncio.run(victim(url, args.seconds / 2, fresh)))
            before = psutil.Process(proxy.pid).memory_info().rss
            attack = attackers(args, kind, port)
            time.sleep(2)  # the attack under way
            watched = {"proxy": proxy.pid, "attacker": attack.pid, "engine": infra_pids["engine"]}
            cpu0 = {name: cpu_seconds(pid) for name, pid in watched.items()}
            began = time.monotonic()
            with PeakRss(proxy.pid) as rss:
                attacked = summary(asyncio.run(victim(url, args.seconds - 4, fresh)))
            cpu = {
                name: round((cpu_seconds(pid) - cpu0[name]) / (time.monotonic() - began), 2)
                for name, pid in watched.items()
            }
            sent, _ = attack.communicate(timeout=args.seconds + 120)
            out[kind] = {
                "quiet": quiet,
                "attacked": attacked,
                "attacker": json.loads(sent.splitlines()[-1]) if sent.strip() else None,
                "latency_ratio_median": (
                    round(attacked["median_ms"] / quiet["median_ms"], 2) if attacked["median_ms"] else None
                ),
                "cpu_cores_under_attack": cpu,
                "rss_before_mb": round(before / 2**20, 1),
                "rss_growth_mb": round((rss.peak - before) / 2**20, 1),
            }
        finally:
            proxy.terminate()
            proxy.wait(60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="bf2bec2", help="git revision to compare the working tree against")
    ap.add_argument("--attack", default="bodies,connections")
    ap.add_argument("--sides", default="base,work", help="which to run: the base revision, the working tree")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each attack")
    ap.add_argument("--attackers", type=int, default=12)
    ap.add_argument("--body-mib", type=int, default=8)
    ap.add_argument("--connections", type=int, default=1030)
    ap.add_argument("--latency-ms", type=int, default=20, help="the stub engine's time per answer")
    ap.add_argument("--role", choices=["bodies", "connections"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        role(args)
        return

    worktree = Path(tempfile.mkdtemp(prefix="turnstream-hostile-")) / "base"
    subprocess.run(
        ["git", "worktree", "add", "-q", "--detach", str(worktree), args.base], cwd=REPO, check=True
    )
    started: Started = []
    stub = None
    results: dict[str, Any] = {}
    try:
        bootstrap, redis_url = start_kafka(started), start_redis(started)
        namespace = f"bench-{uuid.uuid4().hex[:8]}."
        asyncio.run(create_topics(KafkaConfig(bootstrap=bootstrap, namespace=namespace), partitions=3))
        stub_port = free_port()
        engine = [sys.executable, str(REPO / "bench/stub_engine.py"), "--port", str(stub_port)]
        stub = subprocess.Popen([*engine, "--latency-ms", str(args.latency_ms), "--tokens", "8"])
        wait_http(f"http://127.0.0.1:{stub_port}/health")
        infra_pids["engine"] = stub.pid
        infra = {
            "bootstrap": bootstrap,
            "redis": redis_url,
            "namespace": namespace,
            "engine": f"http://127.0.0.1:{stub_port}",
        }
        for name, root in (("base", worktree), ("work", REPO)):
            if name in args.sides.split(","):
                results[name] = run_side(args, root, infra, name)
    finally:
        if stub is not None:
            stub.terminate()
        stop_started(started)
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    print(
        json.dumps(
            {
                "base": args.base,
                "seconds": args.seconds,
                "attackers": args.attackers,
                "body_mib": args.body_mib,
                "connections": args.connections,
                "engine_latency_ms": args.latency_ms,
                **results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
