"""A service's Prometheus figures as tests read them: over HTTP, as an operator's scraper would."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scraped(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples at ``url``/metrics whose labels include ``labels`` (0 when none)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
