"""Which bind addresses reach only this machine: a service that would serve beyond them without a key refuses to
start (the proxy, the engine)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
