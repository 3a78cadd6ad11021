"""``turnstream teacher``."""

from __future__ import annotations

from runtime.process.commands import Subparsers, command, worker


def register(sub: Subparsers) -> None:
    teacher = command(
        sub,
        "teacher",
        "teacher log-probs under accepted hints (judgments -> teacher)",
        worker("teacher", ("engine_url", "top_k"), "services.teacher.worker:run_teacher"),
    )
    teacher.add_argument("--engine-url", help="the teacher engine (default: teacher.engine_url)")
    teacher.add_argument(
        "--top-k", type=int, help="also the teacher's top-K per position (default: teacher.top_k)"
    )
