"""``turnstream eval``: the held-out evaluation as a service, or (``--set``) one version scored once."""

from __future__ import annotations

import argparse
import asyncio

import msgspec

from runtime.configuration.config import Config, ConfigError
from runtime.process.commands import Subparsers, command, override, refuse, worker

_SERVE = worker("eval", ("engine_url",), "services.eval.worker:run_eval")


def register(sub: Subparsers) -> None:
    ev = command(
        sub, "eval", "the held-out evaluation of each weight version the engine serves (-> evals)", run
    )
    ev.add_argument("--engine-url", help="the policy engine (default: eval.engine_url, else engine.url)")
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
    return _sets(config, args) if args.sets else _SERVE(config, args)


def _sets(config: Config, args: argparse.Namespace) -> int:
    """One version scored on each set, a JSON line per set on stdout."""
    from runtime.pipeline.evalsets import EvalSetError, load_set
    from services.eval.set_runner import SetRunError, evaluate_sets

    try:
        config = override(config, "eval", {"engine_url": args.engine_url})
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
