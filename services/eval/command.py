"""``turnstream eval``: the held-out evaluation as a service, or (``--set``) one version scored once."""

from __future__ import annotations

import argparse
import asyncio

import msgspec

from runtime.configuration.config import Config, ConfigError
from runtime.process.commands import Subparsers, command, override, refuse, worker

_SERVE = worker("eval", (), "services.eval.worker:run_eval")


def register(sub: Subparsers) -> None:
    ev = command(
        sub, "eval", "the held-out evaluation of each weight version the engine serves (-> evals)", run
    )
    ev.add_argument(
        "--engine-url",
        help="the policy engine, or several replicas comma-separated, asked in turn until one answers "
        "(default: eval.engine_url, else engine.replicas, else engine.url)",
    )
    ev.add_argument(
        "--set",
        action="append",
        dest="sets",
        metavar="FILE",
        help="score an evaluation set (JSONL, docs/evaluation.md) once and exit, instead of serving (repeat)",
    )
    ev.add_argument(
        "--version",
        type=int,
        help="with --set: the version to score (LoRA: any loaded adapter; full weights: the served one)",
    )
    ev.add_argument("--no-publish", action="store_true", help="with --set: print only, do not write to evals")


def run(config: Config, args: argparse.Namespace) -> int:
    try:
        config = with_engines(config, args.engine_url)
    except ConfigError as exc:
        return refuse("eval", exc)
    return _sets(config, args) if args.sets else _SERVE(config, args)


def with_engines(config: Config, flag: str | None) -> Config:
    """``--engine-url``: one policy engine (``eval.engine_url``), or several replicas (``engine.replicas``)."""
    urls = [url.strip() for url in (flag or "").split(",") if url.strip()]
    if len(urls) <= 1:
        return override(config, "eval", {"engine_url": urls[0] if urls else None})
    engine = msgspec.structs.replace(config.engine, url=urls[0], replicas=urls)
    return msgspec.structs.replace(
        config, engine=engine, eval=msgspec.structs.replace(config.eval, engine_url="")
    )


def _sets(config: Config, args: argparse.Namespace) -> int:
    """One version scored on each set, a JSON line per set on stdout."""
    from runtime.pipeline.evalsets import EvalSetError, load_set
    from services.eval.set_runner import SetRunError, evaluate_sets

    try:
        sets = [load_set(path) for path in args.sets]
        results = asyncio.run(evaluate_sets(config, sets, args.version, publish=not args.no_publish))
    except (ConfigError, EvalSetError, SetRunError) as exc:
        return refuse("eval", exc)
    for evalset, r in zip(sets, results, strict=True):
        line = {
            "set": evalset.name,
            "question_set": r.question_set,
            "version": r.version,
            "cases": len(r.answers),
            "scores": r.scores,
            "overall": r.overall,
            "duration_s": round(r.duration_s, 2),
            "published": not args.no_publish,
        }
        print(msgspec.json.encode(line).decode())
    return 0
