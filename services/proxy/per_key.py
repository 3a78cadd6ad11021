"""What one key may hold at once: requests in flight, and bodies over ``proxy.large_body_bytes``. One key holder
must not be able to take the proxy's memory or time from everyone else (issue 42: twelve 8 MiB bodies from one key
grew the proxy by 2 GB and slowed other users' requests from 22 ms to 8 s). Past a cap a request is a 429 with
Retry-After, before its body is read; what a request took is given back when its response has ended, streamed or
not (``services/proxy/asgi.py``'s ``ChatFirst``)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from prometheus_client import Counter

LIMITED = Counter(
    "turnstream_proxy_key_limited_total",
    "Requests answered 429 because their key was at a cap: requests (in flight) or large_bodies",
    ["cap"],
)

HELD = "turnstream.held"
"""The ASGI scope's list of (``PerKey``, key) a request took: given back when its response ends."""


class PerKey:
    """How many of something each key holds, against a cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[str, int] = {}

    def take(self, key: str, scope: MutableMapping[str, Any]) -> bool:
        """One more for ``key``, given back when the request of ``scope`` ends; False at the cap."""
        n = self.held.get(key, 0)
        if n >= self.cap:
            return False
        self.held[key] = n + 1
        scope.setdefault(HELD, []).append((self, key))
        return True

    def give(self, key: str) -> None:
        n = self.held[key] - 1
        if n:
            self.held[key] = n
        else:
            del self.held[key]


def give_back(scope: MutableMapping[str, Any]) -> None:
    """Everything the request of ``scope`` took."""
    for counter, key in scope.pop(HELD, ()):
        counter.give(key)
