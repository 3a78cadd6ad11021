"""``turnstream``: one command that starts any part of the pipeline. Each service declares its own command
(``services/<name>/command.py``: its flags and what runs it); this entry point only assembles them, and wires
what one service needs of another (``forget`` deletes the console's rows)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import msgspec

from runtime.configuration.config import Config, ConfigError, load_config
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
    return p


def _housekeeping(sub: Subparsers) -> None:
    """The commands of no service: topics, models, the resolved configuration."""
    topics = command(sub, "topics", "create or describe the Kafka topics", _topics)
    topics.add_argument("action", choices=["create", "describe"])
    topics.add_argument("--namespace", help="topic name prefix (default: kafka.namespace from the config)")
    topics.add_argument("--partitions", type=int, help="override the partition count of new topics")
    topics.add_argument("--bootstrap", help="Kafka bootstrap servers (default: kafka.bootstrap)")

    models = command(sub, "models", "fetch and convert models into the cache", _models)
    models.add_argument("action", choices=["fetch"])
    models.add_argument("name", choices=["smollm2"])

    cfg = command(sub, "config", "print the resolved configuration as JSON", _config)
    cfg.add_argument("action", choices=["show"])


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
