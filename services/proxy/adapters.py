"""Which LoRA adapter the policy's requests go to, when the engine serves versions as adapters
(``Config.lora_adapters``).

Each version is loaded under its own name (``engine_client.adapter_name``) next to the one before; the reloader
then points new requests at it (``serve``) and unloads the older adapter once no request the proxy leased it to is
still open (``drained``). SGLang waits for the requests it is running before it unloads; a request naming an
adapter after that is not refused but loads it again from its path (SGLang 0.5.23 remembers every adapter's path),
which would keep it in memory until the next version retires it: the leases, held from choosing the adapter to the
response's end (and through a re-scoring), are what prevents that. A turn's version is the adapter it was sent to:
no probe and no span is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

from prometheus_client import Gauge

from runtime.engine.client import adapter_name

LEASED = Gauge("turnstream_proxy_adapter_requests", "Requests on their way to a LoRA adapter", ["version"])


class Adapters:
    def __init__(self, served_model: str | None = None) -> None:
        self.current = 0
        """The version new requests go to (0: the base model, no adapter)."""
        self.served_model = served_model
        """The engine's ``--served-model-name`` (``/model_info``), for ``without_adapter``."""
        self._leases: Counter[int] = Counter()
        self._idle: dict[int, asyncio.Event] = {}

    def serve(self, version: int) -> None:
        self.current = version

    def lease(self) -> tuple[int, str | None]:
        """(version, adapter name or None for the base) for one request; ``release`` it once answered."""
        version = self.current
        self.hold(version)
        return version, adapter_name(version) if version else None

    def hold(self, version: int) -> None:
        """One more request on ``version`` (a re-scoring of a turn it made); ``release`` it too."""
        self._leases[version] += 1
        LEASED.labels(str(version)).set(self._leases[version])
        self._event(version).clear()

    def release(self, version: int) -> None:
        self._leases[version] -= 1
        if self._leases[version] <= 0:
            del self._leases[version]
            self._event(version).set()
            with contextlib.suppress(KeyError):  # one series per version would pile up
                LEASED.remove(str(version))
        else:
            LEASED.labels(str(version)).set(self._leases[version])

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


def without_adapter(model: str, served_model: str | None) -> str:
    """A request's ``model`` as SGLang 0.5.23 will read it naming no adapter, so that the proxy's ``lora_path``
    decides. SGLang (``serving_base._parse_model_parameter``) takes "<base>:<adapter>" in ``model`` over
    ``lora_path``, but never splits its exact served name, colons and all ("qwen3:4b" stays whole)."""
    if ":" not in model or model == served_model:
        return model
    if served_model and model.startswith(served_model + ":"):
        return served_model
    return model.partition(":")[0].strip()


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
