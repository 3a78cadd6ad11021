"""Structured logs and the Prometheus metrics every service's runtime reports."""
