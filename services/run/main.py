"""``turnstream run``: the whole pipeline on this machine, on the embedded defaults.

Local Kafka and Redis (``scripts/``; or the configured ones with ``run.local_infra = false``), all topics, the
default model (fetched and converted if needed), a CPU policy engine and a separate engine with the fixed starting
weights for the judge and teacher, then the proxy, pairer, judge (rules backend by default), teacher, dispatcher
and trainer. Each service logs to ``<run_dir>/<name>.log``; the terminal shows live progress (also written to
``<run_dir>/status.json``). Ctrl-C or SIGTERM stops every service cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import msgspec
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from runtime.configuration.config import Config
from runtime.engine.model_store import cache_dir
from runtime.process.supervisor import Service, StartupFailed, Supervisor, tail
from runtime.security.files import private_dir
from runtime.security.tokens import console_login_url, engine_keys, proxy_key
from services.run.own_users import give_own_kafka_users, give_own_users, remove_kafka_users, remove_users
from services.run.plan import plan
from services.run.preflight import busy, ephemeral
from services.run.progress import Progress, scrape

REPO = Path(__file__).resolve().parents[2]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def start_local_infra(config: Config) -> Config:
    """Kafka and Redis from scripts/ on the ports the configuration names (left running afterwards), as deployed:
    ``config`` logging in to that Redis as its ``admin`` (scripts/redis.sh's), unless ``redis.url`` names a user
    already, and to a Kafka started here as its operator (SCRAM; a broker already running in plain text stays so)."""
    kafka_port = config.kafka.bootstrap.split(",")[0].rsplit(":", 1)[-1]
    redis_port = str(urlparse(config.redis.url).port or 6379)
    kafka_env = {"KAFKA_PORT": kafka_port, "KAFKA_SASL": os.environ.get("KAFKA_SASL", "1")}
    for script, env in (("kafka.sh", kafka_env), ("redis.sh", {"REDIS_PORT": redis_port})):
        subprocess.run(
            ["bash", str(REPO / "scripts" / script), "start"], check=True, env={**os.environ, **env}
        )
    config = _kafka_operator(config, kafka_env)
    if urlparse(config.redis.url).password:
        return config
    admin = subprocess.run(
        ["bash", str(REPO / "scripts" / "redis.sh"), "url"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "REDIS_PORT": redis_port},
    ).stdout.strip()
    kafka = config.kafka
    if kafka.seal_keys_url == config.redis.url:
        kafka = msgspec.structs.replace(kafka, seal_keys_url=admin)
    return msgspec.structs.replace(
        config, redis=msgspec.structs.replace(config.redis, url=admin), kafka=kafka
    )


def _kafka_operator(config: Config, env: dict[str, str]) -> Config:
    """``config`` logging in to scripts/kafka.sh's broker as its operator, where it takes SASL logins and the
    configuration names no user of its own."""
    if config.kafka.sasl_mechanism:
        return config
    password = subprocess.run(
        ["bash", str(REPO / "scripts" / "kafka.sh"), "password"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    if password.returncode != 0:  # a broker in plain text (one started before, or KAFKA_SASL=0)
        return config
    kafka = msgspec.structs.replace(
        config.kafka,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="admin",
        sasl_password=password.stdout.strip(),
    )
    return msgspec.structs.replace(config, kafka=kafka)


def _write_status(path: Path, progress: Progress) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode({"time": time.time(), **msgspec.to_builtins(progress)}))
    os.replace(tmp, path)


def _banner(config: Config, run_dir: Path) -> str:
    url = f"http://127.0.0.1:{config.proxy.port}/v1"
    console = f"Console: {console_login_url(config)}\n" if config.run.console else ""
    key = config.proxy.api_key or "<a key from proxy.keys_file>"
    return f"""
turnstream is running. OpenAI-compatible API: {url}  (model "policy"; API key {key}; send each request
with the conversation so far and its session is found, or name it with X-Session-Id; clients: docs/clients.md)

  curl -s {url}/chat/completions -H 'content-type: application/json' -H 'Authorization: Bearer {key}' \\
       -d '{{"messages": [{{"role": "user", "content": "Hi!"}}], "max_tokens": 32}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}", api_key="{key}")
  client.chat.completions.create(model="policy", messages=[...])

{console}Logs: {run_dir}/<service>.log   Status: {run_dir}/status.json   Ctrl-C stops everything.
"""


async def run_pipeline(
    config: Config,
    config_path: str | None = None,
    *,
    stop: asyncio.Event | None = None,
    install_signals: bool = True,
) -> int:
    """Returns 0 after a requested stop, 1 if a service failed to start or died."""
    from runtime.engine.model_store import fetch_smollm2
    from runtime.messaging.topics import create_topics

    rc = config.run
    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    run_dir = Path(rc.run_dir) if rc.run_dir else cache_dir() / "run" / time.strftime("%Y%m%d-%H%M%S")
    private_dir(run_dir)  # logs and the simulated users' conversations
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if rc.local_infra:
        _say("starting local Kafka and Redis (scripts/kafka.sh, scripts/redis.sh)")
        config = await asyncio.to_thread(start_local_infra, config)
    await create_topics(config.kafka)
    model = config.trainer.hf_checkpoint or str(await asyncio.to_thread(fetch_smollm2))
    if not config.proxy.api_key and not config.proxy.keys_file:  # a key of its own, kept for the next run
        proxy = msgspec.structs.replace(config.proxy, api_key=proxy_key())
        config = msgspec.structs.replace(config, proxy=proxy)
    if not (
        config.engine.api_key and config.engine.admin_api_key
    ):  # nobody else on the host drives the engines
        api_key, admin_api_key = engine_keys()
        engine = msgspec.structs.replace(
            config.engine,
            api_key=config.engine.api_key or api_key,
            admin_api_key=config.engine.admin_api_key or admin_api_key,
        )
        config = msgspec.structs.replace(config, engine=engine)
    services = plan(config, model, config_path, str(run_dir))
    if taken := busy(services):
        _say(
            f"turnstream run: ports in use: {', '.join(taken)}; stop what holds them or choose others "
            "(run.engine_port, run.teacher_engine_port, run.metrics_port_base, proxy.port, console.port)"
        )
        return 1
    if risky := ephemeral(services):
        _say(
            f"turnstream run: warning: {', '.join(risky)} in the kernel's ephemeral range "
            "(/proc/sys/net/ipv4/ip_local_port_range), where any outgoing connection may take it first"
        )
    services, users = await _own_users(config, services)
    services, kafka_logins = await _own_kafka_users(config, services)
    supervisor = Supervisor(services, run_dir, rc.startup_timeout_s)
    _say(f"starting {', '.join(s.name for s in services)} (logs in {run_dir})")
    code = 0
    starting = asyncio.create_task(asyncio.to_thread(supervisor.start))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # stopped during startup
            supervisor.abort.set()
            await asyncio.gather(starting, return_exceptions=True)
            return 0
        try:
            starting.result()
        except StartupFailed as exc:
            _say(f"turnstream run: {exc}")
            return 1
        _say(_banner(config, run_dir))
        await _watch(config, supervisor, run_dir, stop)
        if supervisor.dead():
            code = 1
    finally:
        stopping.cancel()
        _say("stopping the services (Kafka and Redis keep running: make services-down)")
        codes = await asyncio.to_thread(supervisor.stop)
        killed = [name for name, c in codes if c is None]
        if killed:
            _say(f"had to kill: {', '.join(killed)}")
        await _write_curve(config, run_dir)
        try:
            await remove_users(config, users)
        except (RedisError, OSError) as exc:
            _say(f"could not remove this run's Redis users {', '.join(users)}: {exc!r}")
        try:
            await remove_kafka_users(config, kafka_logins)
        except (KafkaError, OSError, RuntimeError) as exc:
            _say(f"could not remove this run's Kafka users {', '.join(kafka_logins)}: {exc!r}")
    return code


async def _own_users(config: Config, services: list[Service]) -> tuple[list[Service], list[str]]:
    """With ``run.redis_users``: each service its own Redis user; where ``redis.url`` may not make users, the
    services share it, said."""
    if not config.run.redis_users:
        return services, []
    try:
        services, users = await give_own_users(config, services)
    except RedisError as exc:
        _say(f"turnstream run: warning: every service logs in to Redis as redis.url's user: it may not make "
             f"ACL users ({exc}); run.redis_users = false says so without this warning")  # fmt: skip
        return services, []
    _say(f"Redis: each service logs in as its own ACL user: {users[0].rsplit('-', 1)[0]}-<service>")
    return services, users


async def _own_kafka_users(config: Config, services: list[Service]) -> tuple[list[Service], list[str]]:
    """Where Kafka takes SASL logins: each service a SCRAM user of its own with its ACLs, made through the
    configuration's user (which must be a super user: scripts/kafka.sh's ``admin`` is)."""
    if not config.kafka.sasl_mechanism:
        return services, []
    services, logins = await give_own_kafka_users(config, services)
    _say(f"Kafka: each service logs in as its own user: {logins[0].rsplit('-', 1)[0]}-<service>")
    return services, logins


async def _write_curve(config: Config, run_dir: Path) -> None:
    from services.run.heldout import write_heldout

    try:
        async with asyncio.timeout(60):
            results = await write_heldout(config, run_dir)
    except (KafkaError, OSError, TimeoutError) as exc:
        _say(f"could not write the held-out curve: {exc!r}")
        return
    if results:
        last = results[-1]
        scores = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(last.scores.items()))
        _say(f"held-out curve: {run_dir}/heldout.png ({len(results)} versions; v{last.version}: {scores})")


async def _watch(config: Config, supervisor: Supervisor, run_dir: Path, stop: asyncio.Event) -> None:
    """Live progress until stopped or a service dies."""
    ports = {s.name: s.port for s in supervisor.services if s.ready_path == "/metrics"}
    ports["proxy"] = config.proxy.port
    # The proxy's /metrics takes a key like its API (the one this run made, unless keys come from a file).
    key = config.proxy.api_key
    headers = {"proxy": {"Authorization": f"Bearer {key}"}} if key else {}
    status = run_dir / "status.json"
    tty = sys.stderr.isatty()
    last_line = ""
    last_print = 0.0
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            dead = supervisor.dead()
            if dead:
                for name, rc in dead:
                    _say(f"turnstream run: {name} exited with {rc}; last lines of its log:\n"
                         f"{tail(supervisor.log_path(name))}")  # fmt: skip
                return
            progress = await scrape(http, ports, config.trainer.rollout_batch_size, headers)
            line = progress.line()
            now = time.monotonic()
            if tty:
                sys.stderr.write("\r\x1b[2K" + line[: os.get_terminal_size(2).columns - 1])
                sys.stderr.flush()
            elif line != last_line or now - last_print > 60:
                _say(line)
                last_print = now
            last_line = line
            # After the line: whoever sees this status in status.json can already read it in the output.
            _write_status(status, progress)
            until = config.run.until_version
            if until and progress.heldout_version is not None and progress.heldout_version >= until:
                _say(f"version {progress.heldout_version} is evaluated (--until-version {until}): stopping")
                return
            try:
                await asyncio.wait_for(stop.wait(), 2.0)
            except TimeoutError:
                pass
    if tty:
        sys.stderr.write("\n")
