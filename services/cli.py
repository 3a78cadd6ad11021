"""``turnstream``: one command that starts any part of the pipeline. Each service declares its own command
(``services/<name>/command.py``: its flags and what runs it); this entry point only assembles them, and wires
what one service needs of another (``forget`` deletes the console's rows)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

import msgspec

from runtime.configuration.config import Config, ConfigError, KafkaConfig, load_config
from runtime.observability.logs import setup_logging
from runtime.process.commands import Subparsers, command, refuse
from services.console import command as console
from services.console.projection import forget_sessions, session_rows
from services.dispatcher import command as dispatcher
from services.engine import command as engine
from services.eval import command as eval_
from services.forget import command as forget
from services.gate import command as gate
from services.judge import command as judge
from services.pairer import command as pairer
from services.proxy import command as proxy
from services.proxy import keys_command as keys
from services.replay import command as replay
from services.run import command as run
from services.simulate import command as simulate
from services.teacher import command as teacher
from services.trainer import command as trainer
from services.versions import command as versions


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turnstream", description=__doc__.split(".")[0])
    p.add_argument("--config", help="TOML config file (default: $TURNSTREAM_CONFIG, then ./turnstream.toml)")
    sub = p.add_subparsers(dest="command", required=True)
    _housekeeping(sub)
    for service in (engine, proxy, run, simulate, pairer, judge, teacher, dispatcher, trainer, eval_, gate):
        service.register(sub)
    versions.register(sub)
    console.register(sub)
    forget.register(sub, forget.Projection(delete_rows=forget_sessions, count_rows=session_rows))
    replay.register(sub)
    keys.register(sub)
    return p


def _housekeeping(sub: Subparsers) -> None:
    """The commands of no service: topics, models, the resolved configuration."""
    topics = command(sub, "topics", "create, describe or wait for the Kafka topics", _topics)
    topics.add_argument(
        "action",
        choices=["create", "describe", "wait"],
        help="wait: until every topic exists and Redis answers (a pod's init container; exit 1 at --timeout)",
    )
    topics.add_argument("--timeout", type=float, default=600.0, help="wait: seconds before giving up")
    topics.add_argument("--namespace", help="topic name prefix (default: kafka.namespace from the config)")
    topics.add_argument("--partitions", type=int, help="override the partition count of new topics")
    topics.add_argument("--bootstrap", help="Kafka bootstrap servers (default: kafka.bootstrap)")

    models = command(sub, "models", "fetch and convert models into the cache", _models)
    models.add_argument("action", choices=["fetch"])
    models.add_argument("name", choices=["smollm2"])

    cfg = command(sub, "config", "print the resolved configuration as JSON", _config)
    cfg.add_argument("action", choices=["show"])

    users = command(
        sub, "redis-users", "write Redis's ACL file: a user per service (passwords from env)", _users
    )
    users.add_argument("--out", help="the file to write (default: standard output)")
    users.add_argument("--sentinel-out", help="also write the Sentinels' user lines here (redis+sentinel://)")

    kusers = command(
        sub,
        "kafka-users",
        "make Kafka's users and ACLs: a user per service (passwords from env)",
        _kafka_users,
    )
    kusers.add_argument(
        "action",
        choices=["apply", "show"],
        help="apply: as kafka.sasl_username (a super user); show: print the ACLs",
    )
    kusers.add_argument("--namespace", help="topic name prefix (default: kafka.namespace from the config)")


def _users(config: Config, args: argparse.Namespace) -> int:
    """The ACL file for ``aclfile``: each user's password from ``REDIS_PASSWORD_<USER>`` (hashed in the
    file), the key patterns from this configuration's prefixes. Compose's ``redis-users`` step and the chart's Redis
    init container run it; the file holds no password, so Redis's own user may read it."""
    import os
    from pathlib import Path

    from runtime.security.redis_users import NAMES, acl_file, sentinel_users

    passwords = {n: os.environ.get(f"REDIS_PASSWORD_{n.upper()}", "") for n in NAMES}
    try:
        text = acl_file(passwords, config.redis.key_prefix, config.kafka.seal_keys_prefix)
    except ValueError as exc:
        return refuse("redis-users", f"{exc} (REDIS_PASSWORD_<USER>)")
    if not args.out:
        print(text, end="")
        return 0
    for path, content in ((args.out, text), (args.sentinel_out, sentinel_users(passwords))):
        if path:
            out = Path(path)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(content)
            tmp.chmod(0o644)
            os.replace(tmp, out)
            print(f"turnstream redis-users: {content.count('user ')} users written to {out}", file=sys.stderr)
    return 0


def _kafka_users(config: Config, args: argparse.Namespace) -> int:
    """Each service's SCRAM user (password from ``KAFKA_PASSWORD_<SERVICE>``) and exactly the ACLs
    ``runtime/security/kafka_users.py`` declares, in the namespace. Compose's ``topics`` step and the chart's topics
    job run it as the operator before they make the topics; run again, it changes only what differs."""
    import os

    from runtime.security.kafka_users import USERS, all_acls, apply, required

    if args.namespace is not None:
        config = msgspec.structs.replace(config, kafka=config.kafka.in_namespace(args.namespace))
    if args.action == "show":
        for a in all_acls(config):
            print(
                f"{a.principal:<16} {a.op.name:<10} {a.resource.name.lower():<6} {a.name} ({a.pattern.name.lower()})"
            )
        return 0
    passwords = {n: os.environ.get(f"KAFKA_PASSWORD_{n.upper()}", "") for n in USERS}
    try:
        required(passwords, tuple(USERS))
    except ValueError as exc:
        return refuse("kafka-users", f"{exc} (KAFKA_PASSWORD_<SERVICE>)")
    changed = asyncio.run(apply(config, passwords))
    print(f"turnstream kafka-users: {len(passwords)} users, {changed} ACLs changed", file=sys.stderr)
    return 0


def _topics(config: Config, args: argparse.Namespace) -> int:
    from runtime.messaging.topics import create_topics, describe_topics

    kafka = config.kafka
    try:
        if args.namespace is not None or args.bootstrap:
            kafka = msgspec.structs.replace(
                kafka,
                namespace=args.namespace if args.namespace is not None else kafka.namespace,
                bootstrap=args.bootstrap or kafka.bootstrap,
            )
            kafka.__post_init__()
        if args.action == "wait":
            return _wait_for_topics(config, kafka, args.timeout)
        if args.action == "create":
            created = asyncio.run(create_topics(kafka, partitions=args.partitions))
            states = asyncio.run(describe_topics(kafka))
            for state, outcome in zip(states, created, strict=True):
                state.status = outcome.status
        else:
            states = asyncio.run(describe_topics(kafka))
    except ValueError as exc:
        return refuse("topics", exc)
    width = max(len(s.name) for s in states)
    for s in states:
        detail = f"partitions={s.partitions}" if s.partitions else ""
        if s.replicas:
            detail += f" replicas={s.replicas}"
        if s.configs:
            detail += " " + " ".join(f"{k}={v}" for k, v in sorted(s.configs.items()))
        print(f"{s.name:<{width}}  {s.status:<8} {detail}".rstrip())
    return 1 if any(s.status == "missing" for s in states) else 0


def _wait_for_topics(config: Config, kafka: KafkaConfig, timeout_s: float) -> int:
    """Until every topic exists and Redis answers: what compose's depends_on (topics done, Redis healthy) gives a
    service, for orchestrators that start everything at once (the Helm chart's init containers)."""
    from runtime.messaging.topics import describe_topics
    from runtime.transport.redis_urls import redis_client

    async def ready() -> str | None:
        try:
            missing = [s.name for s in await describe_topics(kafka) if s.status == "missing"]
        except Exception as exc:  # Kafka not up yet: asked again
            return f"Kafka: {type(exc).__name__}: {exc}"
        if missing:
            return f"topics missing: {', '.join(missing)}"
        client = redis_client(config.redis.url, socket_timeout=5)
        try:
            await client.ping()
        except Exception as exc:
            return f"Redis: {type(exc).__name__}: {exc}"
        finally:
            await client.aclose()
        return None

    async def wait() -> int:
        deadline = time.monotonic() + timeout_s
        while (why := await ready()) is not None:
            if time.monotonic() > deadline:
                print(f"not ready after {timeout_s:.0f} s: {why}", file=sys.stderr)
                return 1
            print(f"waiting: {why}", file=sys.stderr)
            await asyncio.sleep(2.0)
        print("every topic exists and Redis answers")
        return 0

    return asyncio.run(wait())


def _models(config: Config, args: argparse.Namespace) -> int:
    from runtime.engine.model_store import fetch

    print(fetch(args.name))
    return 0


def _config(config: Config, args: argparse.Namespace) -> int:
    from runtime.configuration.config import redacted

    print(msgspec.json.format(msgspec.json.encode(redacted(config)).decode()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.process.launch import die_with_parent_from_env

    die_with_parent_from_env()
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"turnstream: invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.logging.level, config.logging.format)
    code: int = args.handler(config, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
