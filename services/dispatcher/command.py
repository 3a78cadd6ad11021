"""``turnstream dispatcher``."""

from __future__ import annotations

from runtime.process.commands import MODE_HELP, Subparsers, command, worker


def register(sub: Subparsers) -> None:
    disp = command(
        sub,
        "dispatcher",
        "joins judgments and teacher scores into samples (-> samples)",
        worker("dispatcher", ("mode", "judge_ids"), "services.dispatcher.worker:run_dispatcher"),
    )
    disp.add_argument("--mode", help=MODE_HELP)
    disp.add_argument(
        "--judge-ids",
        type=lambda v: [j.strip() for j in v.split(",")],
        help="comma-separated judge ids to wait for (default: dispatcher.judge_ids)",
    )
