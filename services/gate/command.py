"""``turnstream gate``."""

from __future__ import annotations

from runtime.process.commands import Subparsers, command, worker


def register(sub: Subparsers) -> None:
    command(
        sub,
        "gate",
        "decide which weight versions are promoted, from their evaluations (-> versions)",
        worker("gate", (), "services.gate.worker:run_gate", standby="standby"),
    ).add_argument(
        "--standby",
        action="store_true",
        help="with gate.enabled off, stay up deciding nothing instead of refusing to start (compose)",
    )
