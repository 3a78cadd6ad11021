"""The proxy's CPU per request and its client's p50, this checkout against another git revision, side by side in
one run. Prints JSON.

    .venv/bin/python bench/proxy_ab.py [--base HEAD] [--rounds 6] [--requests 300] [--concurrency 1] [--stream]
    .venv/bin/python bench/proxy_ab.py --conversations 8 [--system-chars 7600] ...
    .venv/bin/python bench/proxy_ab.py --api responses|messages [--stream] ...
    .venv/bin/python bench/proxy_ab.py --work-redis-user ...   # the proxy as its own Redis ACL user vs the operator
    .venv/bin/python bench/proxy_ab.py --work-kafka-user ...   # the proxy as its own Kafka user (SCRAM, ACLs) vs plain

``--api NAME``: the working tree's proxy is sent the same request in that API (``/v1/responses``,
``/v1/messages``), the base's as chat completions: with ``--base HEAD``, what translating costs per request.

``--conversations N``: requests carry no session id, as a stock client sends them: each worker holds
conversations of N turns, every request repeating the history so far (a system prompt of ``--system-chars``, the
earlier questions and the answers the proxy returned) and one new question; what session inference costs
(``services/proxy/continuity.py``) against a base that gives every such request a session of its own.

This machine's noise swamps a 10% change between two separate runs of bench/proxy.py. Here both proxies (the
base revision, checked out into a temporary git worktree, and the working tree) run at once against one stub
engine, Kafka and Redis, and take turns: each round sends the same load to one, then the other (paused with
SIGSTOP meanwhile, so that its timers do not run on the cores the measured one uses), and reads each proxy's CPU
time from /proc. The medians and their ratio are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import Started, start_kafka, start_redis, start_sasl_kafka, stop_started
from proxy import BODY, cpu_split, load, wait_http

from runtime.configuration.config import KafkaConfig
from runtime.messaging.topics import create_topics
from runtime.process.ports import free_port

REPO = Path(__file__).resolve().parent.parent
API_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", BODY),
    "responses": (
        "/v1/responses",
        {"model": "stub", "input": BODY["messages"], "max_output_tokens": BODY["max_tokens"], "store": False},
    ),
    "messages": (
        "/v1/messages",
        {"model": "stub", "messages": BODY["messages"], "max_tokens": BODY["max_tokens"]},
    ),
}
"""The same request in each API (``store: false``: Codex's; a stored response adds a Redis write)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree against")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=300, help="requests per round and proxy")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--stream", action="store_true", help="streamed requests (the stub sends 62 events)")
    ap.add_argument(
        "--conversations", type=int, default=0, help="turns per header-less conversation (0: X-Session-Id)"
    )
    ap.add_argument("--system-chars", type=int, default=7600, help="system prompt size in conversations")
    ap.add_argument(
        "--api",
        choices=["chat", "responses", "messages"],
        default="chat",
        help="the working tree's API (below)",
    )
    ap.add_argument(
        "--base-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the base proxy only (e.g. TURNSTREAM_PROXY_SESSION_INFERENCE=off "
        "with --base HEAD: one feature on and off in the same code)",
    )
    ap.add_argument(
        "--work-redis-user",
        action="store_true",
        help="the working tree's proxy logs in to Redis as its own ACL user (runtime/security/redis_users.py: "
        "its keys and commands only), the base as the operator: what the per-service users cost a request",
    )
    ap.add_argument(
        "--work-kafka-user",
        action="store_true",
        help="the working tree's proxy records into a broker run as deployed (SCRAM logins, ACLs), as its own "
        "Kafka user (runtime/security/kafka_users.py), the base into a plain-text broker: what the Kafka users "
        "cost a request",
    )
    args = ap.parse_args()
    if args.conversations and args.stream:
        ap.error("--conversations sends non-streamed requests")
    if args.conversations and args.api != "chat":
        ap.error("--conversations speaks chat completions")

    worktree = Path(tempfile.mkdtemp(prefix="turnstream-ab-")) / "base"
    subprocess.run(
        ["git", "worktree", "add", "-q", "--detach", str(worktree), args.base], cwd=REPO, check=True
    )
    started: Started = []
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    stub = None
    try:
        bootstrap, redis_url = start_kafka(started), start_redis(started)
        namespace = f"bench-{uuid.uuid4().hex[:8]}."
        asyncio.run(create_topics(KafkaConfig(bootstrap=bootstrap, namespace=namespace), partitions=3))
        stub_port = free_port()
        stub = subprocess.Popen(
            [sys.executable, str(REPO / "bench/stub_engine.py"), "--port", str(stub_port)]
        )
        urls = {"base": redis_url, "work": redis_url}
        if args.work_redis_user:
            urls["work"] = asyncio.run(own_user(redis_url, f"{namespace}work."))
        kafka_env = {n: {"TURNSTREAM_KAFKA_BOOTSTRAP": bootstrap} for n in ("base", "work")}
        if args.work_kafka_user:
            kafka_env["work"] = own_kafka_user(started, namespace)
        for name, root in (("base", worktree), ("work", REPO)):
            port, tmp = free_port(), tempfile.mkdtemp(prefix=f"turnstream-ab-{name}-")
            env = {
                **os.environ,
                "PYTHONPATH": str(root),
                **kafka_env[name],
                "TURNSTREAM_KAFKA_NAMESPACE": namespace,
                "TURNSTREAM_REDIS_URL": urls[name],
                "TURNSTREAM_REDIS_KEY_PREFIX": f"{namespace}{name}.",
                "TURNSTREAM_ENGINE_URL": f"http://127.0.0.1:{stub_port}",
                "TURNSTREAM_PROXY_PORT": str(port),
                "TURNSTREAM_PROXY_SPOOL_DIR": tmp + "/spool",
                "TURNSTREAM_PROXY_WEIGHTS_ROOT": tmp,
                "TURNSTREAM_LOGGING_LEVEL": "WARNING",
            }
            if name == "base":
                env.update(item.split("=", 1) for item in args.base_env)  # type: ignore[misc]
            cmd = [sys.executable, "-m", "services.cli", "proxy"]
            procs[name] = (subprocess.Popen(cmd, env=env, cwd=root), port)
        wait_http(f"http://127.0.0.1:{stub_port}/health")
        for name, (_, port) in procs.items():
            wait_http(f"http://127.0.0.1:{port}/metrics")
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            asyncio.run(load(url, 4, 100, False, lambda w, i, n=name: {"X-Session-Id": f"warm-{n}-{w}-{i}"}))
        per_request: dict[str, list[float]] = {"base": [], "work": []}
        p50s: dict[str, list[float]] = {"base": [], "work": []}
        """The client's median time per request in each round (the user's wait: the engine's 1 ms included)."""
        for rnd in range(args.rounds):
            for name, (proc, port) in procs.items():
                path, body = API_REQUESTS[args.api if name == "work" else "chat"]
                url = f"http://127.0.0.1:{port}{path}"
                # The other proxy is paused meanwhile: its own timers would otherwise run on the same two cores
                # and charge the one measured (for instance, a base with more wake-ups makes the work look worse).
                others = [p for n, (p, _) in procs.items() if n != name]
                for other in others:
                    other.send_signal(signal.SIGSTOP)
                try:
                    user0, sys0 = cpu_split(proc.pid)
                    if args.conversations:
                        asyncio.run(
                            converse(
                                url,
                                args.concurrency,
                                args.requests,
                                args.conversations,
                                args.system_chars,
                                rnd,
                            )
                        )
                    else:
                        headers = lambda w, i, r=rnd: {"X-Session-Id": f"r{r}-{w}-{i}"}  # noqa: E731
                        figures = asyncio.run(
                            load(url, args.concurrency, args.requests, args.stream, headers, body)
                        )
                        p50s[name].append(figures["p50_ms"])
                    user1, sys1 = cpu_split(proc.pid)
                finally:
                    for other in others:
                        other.send_signal(signal.SIGCONT)
                per_request[name].append(1000 * (user1 - user0 + sys1 - sys0) / args.requests)
                time.sleep(1.0)  # the resumed proxy catches up on its timers before its own round
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(30)
        if stub is not None:
            stub.terminate()
        stop_started(started)
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    medians = {name: statistics.median(v) for name, v in per_request.items()}
    print(
        json.dumps(
            {
                "base": args.base,
                "base_env": args.base_env,
                "work_redis_user": args.work_redis_user,
                "work_kafka_user": args.work_kafka_user,
                "concurrency": args.concurrency,
                "stream": args.stream,
                "api": args.api,
                "conversation_turns": args.conversations or None,
                "system_chars": args.system_chars if args.conversations else None,
                "requests_per_round": args.requests,
                "cpu_ms_per_request": {
                    name: {"median": round(medians[name], 3), "rounds": [round(x, 3) for x in v]}
                    for name, v in per_request.items()
                },
                "work_over_base": round(medians["work"] / medians["base"], 3),
                **latency(p50s),
            },
            indent=2,
        )
    )


def own_kafka_user(started: Started, namespace: str) -> dict[str, str]:
    """A broker as deployed, the namespace's topics made there as its operator and the proxy's user with its ACLs
    applied: the working tree's proxy's settings for it."""
    from runtime.configuration.config import Config
    from runtime.security.kafka_users import apply

    bootstrap, password = start_sasl_kafka(started)
    admin = KafkaConfig(
        bootstrap=bootstrap,
        namespace=namespace,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="admin",
        sasl_password=password,
    )
    asyncio.run(create_topics(admin, partitions=3))
    proxy_password = uuid.uuid4().hex
    asyncio.run(apply(Config(kafka=admin), {"proxy": proxy_password}))
    return {
        "TURNSTREAM_KAFKA_BOOTSTRAP": bootstrap,
        "TURNSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "TURNSTREAM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "TURNSTREAM_KAFKA_SASL_USERNAME": "proxy",
        "TURNSTREAM_KAFKA_SASL_PASSWORD": proxy_password,
    }


async def own_user(admin_url: str, prefix: str) -> str:
    """A ``proxy`` ACL user for keys under ``prefix`` (the sealing keys' default prefix too), made through the
    operator's URL: the URL that logs in as it."""
    from runtime.security.redis_users import provision, with_user
    from runtime.transport.redis_urls import redis_client

    admin = redis_client(admin_url)
    try:
        made = await provision(admin, ["proxy"], prefix, "turnstream:dek:", f"bench-{uuid.uuid4().hex[:6]}-")
    finally:
        await admin.aclose()
    return with_user(admin_url, *made["proxy"])


def latency(p50s: dict[str, list[float]]) -> dict[str, Any]:
    """The client's p50 per round and their medians (none for ``--conversations``, which times no request)."""
    if not p50s["base"]:
        return {}
    medians = {name: statistics.median(v) for name, v in p50s.items()}
    return {
        "client_p50_ms": {
            name: {"median": round(medians[name], 3), "rounds": [round(x, 3) for x in v]}
            for name, v in p50s.items()
        },
        "p50_work_over_base": round(medians["work"] / medians["base"], 3),
    }


async def converse(url: str, concurrency: int, total: int, turns: int, system_chars: int, rnd: int) -> None:
    """``total`` requests without session ids from ``concurrency`` clients, each working through conversations of
    ``turns`` turns as a chat client does: the history so far, the proxy's answers included, and a new question."""
    system = {
        "role": "system",
        "content": ("You are a careful assistant. " * (system_chars // 29 + 1))[:system_chars],
    }
    counter = iter(range(total))

    async def worker(w: int) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            history: list[dict[str, Any]] = []
            for i in counter:
                if i % turns == 0 or not history:
                    history = [system]
                history.append({"role": "user", "content": f"Question {i} from round {rnd}, client {w}?"})
                r = await http.post(url, json={**BODY, "messages": history})
                assert r.status_code == 200, r.text
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    await asyncio.gather(*(worker(w) for w in range(concurrency)))


if __name__ == "__main__":
    main()
