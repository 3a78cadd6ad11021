"""Several policy servers behind one proxy: which replica a request goes to, and which ones may take traffic.

The proxy knows what a router in front of SGLang cannot: the session a turn belongs to, and the weight version
each replica serves. So it routes itself (docs/scaling.md):

- **affinity** (the default): a session's next turn goes to the replica that served its last one, where its prefix
  is cached, unless that replica is overloaded (``proxy.overload_abs`` more requests in flight than the least
  loaded, and ``proxy.overload_rel`` times as many), when the session moves to the least loaded one and stays
  there. A new session goes to the least loaded replica, load counted in tokens in flight (each request's
  estimate: its body's bytes / 4 plus its ``max_tokens``), then requests; ties broken by a hash of its key keyed
  with the deployment's secret (``routing_secret``), so proxies that see the same loads agree and a client cannot
  choose session ids that all land on one replica (issue 55 put 12 of 12 there with the unkeyed hash). The key is
  the session id where the client sent one, else a hash of the conversation's opening (system prompt and first
  user message), which every turn of a conversation repeats.
- **round_robin**: each request to the next replica: the baseline ``bench/routing.py`` measures against.

A replica takes traffic only while it is **ready**: its engine answers and it serves the version its reloader
wants (a replica that starts or restarts on its starting weights loads the served version first). While none is
ready (every replica reloading at once) requests go to those that answer; SGLang holds them through a pause.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge

from runtime.engine.client import EngineClient
from services.proxy.adapters import Adapters
from services.proxy.versions import ServedVersions

ROUTED = Counter(
    "turnstream_proxy_routed_total",
    "Requests sent to each policy replica, by why it was chosen",
    ["replica", "reason"],
)
IN_FLIGHT = Gauge(
    "turnstream_proxy_replica_requests", "Requests in flight to each policy replica", ["replica"]
)
READY = Gauge("turnstream_proxy_replica_ready", "1 while a policy replica takes traffic", ["replica"])

DOWN_FOR_S = 2.0
"""A replica that refused a connection gets no new request for this long (unless none other answers)."""


@dataclass(eq=False)
class Replica:
    """One policy server and what the proxy keeps about it."""

    name: str
    """Its ``host:port`` (``replica_name``): the label of its metrics, recorded with each turn it answers."""
    url: str
    engine: EngineClient
    versions: ServedVersions = field(default_factory=ServedVersions)
    """What it serves (a streamed turn is labelled from it)."""
    adapters: Adapters | None = None
    """With LoRA: which adapter its requests go to."""
    reloader: Any = None
    """Its ``Reloader`` (``proxy.reload``), which says which version it should serve."""
    in_flight: int = 0
    tokens: int = 0
    """The token estimates of the requests in flight (``cost``)."""
    down_until: float = 0.0
    """Monotonic time before which it is skipped: it refused a connection."""

    def __post_init__(self) -> None:
        READY.labels(self.name).set_function(lambda: 1.0 if self.ready else 0.0)

    @property
    def answering(self) -> bool:
        return self.down_until <= time.monotonic() and self.versions.reachable

    @property
    def ready(self) -> bool:
        """Answering and on the version it should serve."""
        if not self.answering:
            return False
        return self.reloader is None or bool(self.reloader.serves_wanted(self.versions.current))

    def begin(self, tokens: int = 0) -> None:
        self.in_flight += 1
        self.tokens += tokens
        IN_FLIGHT.labels(self.name).set(self.in_flight)

    def end(self, tokens: int = 0) -> None:
        self.in_flight -= 1
        self.tokens -= tokens
        IN_FLIGHT.labels(self.name).set(self.in_flight)

    def refused(self) -> None:
        """It could not be reached: skipped for a moment, and its next probe says when it is back."""
        self.down_until = time.monotonic() + DOWN_FOR_S


def opening_key(body: dict[str, Any]) -> str:
    """What every turn of a conversation repeats: its messages up to the first user message."""
    opening: list[Any] = []
    for message in body.get("messages") or ():
        opening.append(message.get("content") if isinstance(message, dict) else message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    return hashlib.blake2b(repr(opening).encode(), digest_size=12).hexdigest()


def cost(raw_bytes: int, forward: dict[str, Any]) -> int:
    """A request's weight in a replica's load, in tokens: its prompt (about 4 bytes a token) and its longest
    answer. An estimate made before the engine is asked; 16 requests of 200 KB count as what they are."""
    longest = forward.get("max_tokens") or forward.get("max_completion_tokens")
    return raw_bytes // 4 + (longest if isinstance(longest, int) and not isinstance(longest, bool) else 0)


def routing_secret(*secrets: str | None) -> bytes:
    """The key of the routing hash: derived from the deployment's own secrets (``proxy.routing_secret``, else the
    engine's keys, else the proxy's key), which every proxy of it shares and no client holds. None set (a laptop on
    loopback): no key, and nobody to steer against."""
    material = next((s for s in secrets if s), "")
    return (
        hashlib.blake2b(material.encode(), digest_size=32, person=b"ts-routing").digest() if material else b""
    )


def rank(key: str, name: str, secret: bytes = b"") -> bytes:
    """Rendezvous hashing: every proxy orders the replicas (by ``Replica.name``) for a key the same way."""
    return hashlib.blake2b(f"{key}|{name}".encode(), digest_size=8, key=secret).digest()


def first_choice(key: str, names: Iterable[str], secret: bytes = b"") -> str:
    """The replica a new session keyed ``key`` goes to when all of ``names`` are equally loaded."""
    return min(names, key=lambda name: rank(key, name, secret))


class Router:
    def __init__(
        self,
        replicas: list[Replica],
        policy: str = "affinity",
        *,
        overload_abs: int = 4,
        overload_rel: float = 1.5,
        max_sessions: int = 100_000,
        secret: bytes = b"",
    ) -> None:
        self.replicas = replicas
        self.secret = secret
        """The routing hash's key (``routing_secret``)."""
        self.policy = policy
        self.overload_abs = overload_abs
        self.overload_rel = overload_rel
        self.max_sessions = max_sessions
        self._homes: OrderedDict[str, Replica] = OrderedDict()
        self._turn = itertools.count()

    def candidates(self, exclude: Iterable[Replica] = ()) -> list[Replica]:
        """Those that should take a request: the ready ones, else those answering, else any not excluded."""
        skip = set(exclude)
        left = [r for r in self.replicas if r not in skip]
        return [r for r in left if r.ready] or [r for r in left if r.answering] or left

    def pick(self, key: str | None, exclude: Iterable[Replica] = ()) -> Replica | None:
        """The replica for a request whose affinity key is ``key`` (None: no session to keep)."""
        pool = self.candidates(exclude)
        if not pool:
            return None
        if len(self.replicas) == 1:
            return pool[0]
        if self.policy == "round_robin":
            return self._note(pool[next(self._turn) % len(pool)], "round_robin")
        if key is None:  # nothing to keep: the least loaded, ties taken in turn
            return self._note(self._least_loaded(pool, str(next(self._turn))), "no_key")
        home = self._homes.get(key)
        least = self._least_loaded(pool, key)
        if home is not None and home in pool:
            self._homes.move_to_end(key)
            if not self._overloaded(home, least):
                return self._note(home, "affinity")
            reason = "overloaded"
        else:
            reason = "new" if home is None else "moved"
        self._homes[key] = least
        if len(self._homes) > self.max_sessions:
            self._homes.popitem(last=False)
        return self._note(least, reason)

    def _least_loaded(self, pool: list[Replica], key: str) -> Replica:
        return min(pool, key=lambda r: (r.tokens, r.in_flight, rank(key, r.name, self.secret)))

    def _overloaded(self, home: Replica, least: Replica) -> bool:
        return (
            home.in_flight >= least.in_flight + self.overload_abs
            and home.in_flight > self.overload_rel * least.in_flight
        )

    @staticmethod
    def _note(replica: Replica, reason: str) -> Replica:
        ROUTED.labels(replica.name, reason).inc()
        return replica
