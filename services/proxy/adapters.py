"""Which LoRA adapter the policy's requests go to, when the engine serves versions as adapters
(``Config.lora_adapters``).

Each version is loaded under its own name (``engine_client.adapter_name``) next to the one before; the reloader
then points new requests at it (``serve``) and unloads the older adapter once no request the proxy leased it to is
still on its way to the engine (``drained``). SGLang itself refuses requests naming an unloaded adapter and waits
for those already running before it unloads, so the lease only covers the gap between choosing the adapter and the
engine admitting the request. A turn's version is the adapter it was sent to: no probe and no span is needed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from prometheus_client import Gauge

from services.engine_client import adapter_name

LEASED = Gauge("turnstream_proxy_adapter_requests", "Requests on their way to a LoRA adapter", ["version"])


class Adapters:
    def __init__(self) -> None:
        self.current = 0
        """The version new requests go to (0: the base model, no adapter)."""
        self._leases: Counter[int] = Counter()
        self._idle: dict[int, asyncio.Event] = {}

    def serve(self, version: int) -> None:
        self.current = version

    def lease(self) -> tuple[int, str | None]:
        """(version, adapter name or None for the base) for one request; ``release`` it once answered."""
        version = self.current
        self._leases[version] += 1
        LEASED.labels(str(version)).set(self._leases[version])
        self._event(version).clear()
        return version, adapter_name(version) if version else None

    def release(self, version: int) -> None:
        self._leases[version] -= 1
        LEASED.labels(str(version)).set(self._leases[version])
        if self._leases[version] <= 0:
            del self._leases[version]
            self._event(version).set()

    def leased(self, version: int) -> int:
        return self._leases[version]

    async def drained(self, version: int) -> None:
        """Until no request leased ``version`` is outstanding (call once new requests go elsewhere)."""
        if self._leases[version] > 0:
            await self._event(version).wait()
        self._idle.pop(version, None)

    def _event(self, version: int) -> asyncio.Event:
        event = self._idle.get(version)
        if event is None:
            event = self._idle[version] = asyncio.Event()
            if not self._leases[version]:
                event.set()
        return event


def with_version(response: dict[str, Any], version: int) -> dict[str, Any]:
    """A non-streamed response as its client should see it: SGLang's ``metadata`` names the base weights' version
    (its own, unchanged by adapters), the policy's version is the adapter's."""
    meta = response.get("metadata")
    if not isinstance(meta, dict):
        return response
    spans = meta.get("weight_versions")
    relabelled = {**meta, "weight_version": str(version)}
    if isinstance(spans, list):
        relabelled["weight_versions"] = [
            {**span, "version": str(version)} for span in spans if isinstance(span, dict)
        ]
    return {**response, "metadata": relabelled}
