"""Before ``turnstream run`` starts anything: every port it is about to hand out must be free, and should be out of
the kernel's ephemeral range (where any outgoing connection may take it between now and the service's bind)."""

from __future__ import annotations

from runtime.process.ports import bindable, ephemeral_low
from runtime.process.supervisor import Service


def busy(services: list[Service]) -> list[str]:
    """``name (port)`` of each service whose port something already holds."""
    return [f"{s.name} ({s.port})" for s in services if not bindable(s.port, reuse=True)]


def ephemeral(services: list[Service]) -> list[str]:
    """``name (port)`` of each service whose port lies in the ephemeral range."""
    low = ephemeral_low()
    return [f"{s.name} ({s.port})" for s in services if s.port >= low]
