"""``turnstream run``: the whole pipeline on this machine."""

from __future__ import annotations

import argparse
import asyncio

import msgspec

from runtime.configuration.config import Config, ConfigError
from runtime.process.commands import Subparsers, command, override, refuse


def register(sub: Subparsers) -> None:
    run_ = command(sub, "run", "the whole pipeline on this machine, with live progress, until Ctrl-C", run)
    run_.add_argument("--run-dir", help="where service logs and status.json go (default: <cache>/run/<time>)")
    run_.add_argument(
        "--no-local-infra",
        dest="local_infra",
        action="store_false",
        default=None,
        help="use the configured Kafka and Redis instead of starting local ones",
    )
    run_.add_argument(
        "--judge-backend", choices=["engine", "rules"], help="default: run.judge_backend (rules)"
    )
    run_.add_argument(
        "--simulate", type=int, metavar="N", help="also drive N simulated users (default: run.simulate, 0)"
    )
    run_.add_argument(
        "--lora",
        action="store_true",
        default=None,
        help="train LoRA adapters (trainer.lora) and serve them from one engine that also answers the judge and"
        " the teacher",
    )
    run_.add_argument(
        "--policy-replicas",
        type=int,
        metavar="N",
        help="start N policy servers behind the proxy's routing (default: run.policy_replicas, 1)",
    )
    run_.add_argument(
        "--until-version",
        type=int,
        metavar="N",
        help="stop once version N's held-out evaluation is published (default: run.until_version, 0: Ctrl-C)",
    )


def run(config: Config, args: argparse.Namespace) -> int:
    from services.run.main import run_pipeline

    flags = ("run_dir", "local_infra", "judge_backend", "simulate", "until_version", "policy_replicas")
    try:
        config = override(config, "run", {f: getattr(args, f) for f in flags})
        if args.lora:
            lora = {**msgspec.to_builtins(config.trainer.lora), "enabled": True}
            config = override(config, "trainer", {"lora": lora})
    except ConfigError as exc:
        return refuse("run", exc)
    return asyncio.run(run_pipeline(config, args.config))
