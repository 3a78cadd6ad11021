"""A service's Prometheus figures as tests read them: over HTTP, as an operator's scraper would."""

from __future__ import annotations

import httpx

from runtime.observability.metrics import parse_samples


def scraped(url: str, name: str, *, headers: dict[str, str] | None = None, **labels: str) -> float:
    """The sum of ``name``'s samples at ``url``/metrics whose labels include ``labels`` (0 when none); ``headers``
    for a service whose /metrics needs a key."""
    reply = httpx.get(url + "/metrics", headers=headers, timeout=10)
    reply.raise_for_status()
    samples = parse_samples(reply.text).get(name, {})
    return sum(value for key, value in samples.items() if labels.items() <= dict(key).items())
