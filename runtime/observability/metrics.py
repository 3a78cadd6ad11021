"""Prometheus metrics shared by every service's runtime (the bus). Service-specific metrics live with them."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import Counter, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

CONSUMED = Counter(
    "turnstream_bus_consumed_total", "Records consumed and handed to a service", ["topic", "group"]
)
PRODUCED = Counter("turnstream_bus_produced_total", "Records produced (acknowledged)", ["topic"])
PRODUCERS_RENEWED = Counter(
    "turnstream_bus_producers_renewed_total",
    "Producers replaced after the broker lost (or fenced) their state",
)
FORGOTTEN = Counter(
    "turnstream_bus_forgotten_total",
    "Records of forgotten sessions skipped: read (their key destroyed), or not written (the session fenced)",
    ["topic"],
)
DEADLETTERED = Counter(
    "turnstream_bus_deadlettered_total",
    "Records sent to the dead-letter topic",
    ["topic", "group", "kind"],
)
HANDLER_ERRORS = Counter(
    "turnstream_bus_handler_errors_total", "Batches whose handler failed and were retried", ["group"]
)
LAG = Gauge(
    "turnstream_bus_consumer_lag", "High watermark minus committed offset", ["topic", "partition", "group"]
)


Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse_samples(text: str) -> Samples:
    """A /metrics page as {sample name: {sorted label pairs: value}}."""
    out: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def serve_metrics(port: int | None, host: str = "127.0.0.1") -> None:
    """Expose /metrics on ``port`` for services without an HTTP server of their own (``host`` 0.0.0.0 where a
    Prometheus in another container scrapes them)."""
    if port is not None:
        start_http_server(port, addr=host)
