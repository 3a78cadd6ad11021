"""A service's Prometheus figures as tests read them: over HTTP, as an operator's scraper would."""

from __future__ import annotations

import httpx

from services.metrics import parse_samples


def scraped(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples at ``url``/metrics whose labels include ``labels`` (0 when none)."""
    samples = parse_samples(httpx.get(url + "/metrics", timeout=10).text).get(name, {})
    return sum(value for key, value in samples.items() if labels.items() <= dict(key).items())
