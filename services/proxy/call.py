"""One request on its way through the proxy: what ``ChatProxy.serve`` worked out before the engine was asked, handed
to the part that answers (whole, or streamed) as one value instead of a dozen arguments."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from services.proxy.apis.base import Api, Exchange
from services.proxy.replicas import Replica
from services.proxy.session import SessionInfo
from services.proxy.session_flow import Fence, Pending


@dataclass(slots=True)
class Call:
    session: SessionInfo
    """Where the turn is recorded (its session once ``pending`` settles)."""
    body: dict[str, Any]
    """The chat request as the client (or the API's translation) made it."""
    forward: dict[str, Any]
    """What the engine is sent: ``body`` with the proxy's own additions."""
    created: float
    owner: str = ""
    """The key's user when keys are per user (stored responses are theirs alone)."""
    index: asyncio.Future[int | None] | None = None
    """The turn's number in its session, being fetched beside the engine's work."""
    wants: dict[str, bool] | None = None
    """Which of the proxy's additions the chat client asked for itself (None for a translated API)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Response headers (``X-Session-Id``, ``Server-Timing``)."""
    leased: int | None = None
    """The adapter version the request is routed to, given back when it ends."""
    pending: Pending | None = None
    """The continuity lookup still to settle, for a request without a session id."""
    fence: Fence | None = None
    """The erasure fence to check before answering, for an explicit session id."""
    api: Api | None = None
    exchange: Exchange | None = None
    replica: Replica | None = None
    """The policy replica it is sent to (``Router.pick``)."""
    key: str | None = None
    """Its affinity key: what a replica chosen again for it (the first one down) is picked by."""
    cost: int = 0
    """Its weight in its replica's load, in tokens (``replicas.cost``)."""

    @property
    def main(self) -> bool:
        return self.session.turn_type == "main"
