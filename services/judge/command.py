"""``turnstream judge``."""

from __future__ import annotations

from runtime.process.commands import Subparsers, command, worker

_FLAGS = ("judge_id", "backend", "m", "engine_url")


def register(sub: Subparsers) -> None:
    judge = command(
        sub,
        "judge",
        "eval and hindsight-hint votes (turns.paired -> judgments)",
        worker("judge", _FLAGS, "services.judge.worker:run_judge"),
    )
    judge.add_argument("--judge-id", help="default: judge.judge_id; each id is its own consumer group")
    judge.add_argument(
        "--backend", help="engine, rules or a plugin's package.module:Class (default: judge.backend)"
    )
    judge.add_argument("--m", type=int, help="eval votes and hint votes per turn (default: judge.m)")
    judge.add_argument("--engine-url", help="the judge engine (default: judge.engine_url)")
