"""``turnstream pairer``."""

from __future__ import annotations

from runtime.process.commands import Subparsers, command, worker


def register(sub: Subparsers) -> None:
    command(
        sub,
        "pairer",
        "pairs each turn with its next state (turns -> turns.paired)",
        worker("pairer", (), "services.pairer.worker:run_pairer"),
    )
