"""The reloader's adapter path against a scripted engine (fault injection; the real SGLang runs it in
test_lora_serving.py): an engine restart that lost the adapters sends requests to the base until the newest is
loaded again, a refused adapter is dead-lettered while an unreachable engine is tried again, and an older adapter
is unloaded only once its leases are released and its evaluation hold is gone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from runtime.configuration.config import KafkaConfig
from runtime.engine.client import EngineError, adapter_name
from runtime.messaging.bus import Record
from schemas import WeightsPublished
from services.proxy.adapters import Adapters
from services.proxy.reloader import Reloader
from services.proxy.versions import ServedVersions


class ScriptedEngine:
    """What the reloader calls of SGLang's LoRA API, with SGLang's answers (a taken name or bad path: 400)."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.refuse: EngineError | None = None

    async def adapter_versions(self) -> set[int]:
        return {int(n.rsplit("v", 1)[1]) for n in self.loaded}

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.calls.append(("load", name))
        if self.refuse is not None:
            raise self.refuse
        if name in self.loaded:
            raise EngineError(f"Failed to load LoRA adapter {name} because it is already loaded", 400)
        self.loaded[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        self.loaded.pop(name)


class Letters:
    def __init__(self) -> None:
        self.errors: list[str] = []

    async def dead_letter(self, rec: Record[WeightsPublished], error: str) -> None:
        self.errors.append(error)


def record(version: int, root: Path, fmt: str = "peft-lora") -> Record[WeightsPublished]:
    event = WeightsPublished(
        version=version,
        path=str(root / f"v{version}"),
        base_model="m",
        step=version,
        created_at=time.time(),
        format=fmt,
    )
    return Record(event, "weights", 0, version, b"policy", 0)


async def reloader(
    tmp_path: Path, held: set[int] | None = None
) -> tuple[Reloader, ScriptedEngine, Adapters, Letters]:
    engine, adapters, letters = ScriptedEngine(), Adapters(), Letters()

    async def is_held(version: int) -> bool:
        return version in (held or set())

    r = Reloader(
        KafkaConfig(),
        engine,  # type: ignore[arg-type]
        tmp_path,
        ServedVersions(),
        held=is_held,
        adapters=adapters,
        retry_s=0.05,
    )
    await r.consumer.stop()  # never started: only its clients are closed
    r.consumer = letters  # type: ignore[assignment]
    return r, engine, adapters, letters


async def test_after_an_engine_restart_requests_go_to_the_base_until_the_newest_is_loaded_again(
    tmp_path: Path,
) -> None:
    r, engine, adapters, _ = await reloader(tmp_path)
    await r.handle([record(3, tmp_path)])
    assert adapters.current == 3 and engine.loaded == {adapter_name(3): str(tmp_path / "v3")}
    engine.loaded.clear()  # the engine restarted: its adapters are gone
    seen: list[int] = []
    load = engine.load_lora_adapter

    async def watching(name: str, path: str) -> None:
        seen.append(adapters.current)  # what requests are sent to while the newest loads again
        await load(name, path)

    engine.load_lora_adapter = watching  # type: ignore[method-assign]
    r.engine_changed(0)
    await asyncio.sleep(0.05)
    assert seen == [0] and adapters.current == 3 and r.versions.current == 3


async def test_a_refused_adapter_is_dead_lettered_and_an_unreachable_engine_tried_again(
    tmp_path: Path,
) -> None:
    r, engine, adapters, letters = await reloader(tmp_path)
    engine.refuse = EngineError("LoRA adapter v1 with rank 32 is incompatible", 400)
    await r.handle([record(1, tmp_path)])
    assert adapters.current == 0 and r.newest is None and "rank 32" in letters.errors[0]
    engine.refuse = EngineError("cannot connect", None)
    await r.handle([record(2, tmp_path)])
    assert adapters.current == 0 and r.newest is not None and len(letters.errors) == 1
    engine.refuse = None
    await asyncio.sleep(0.2)  # the retry after retry_s
    assert adapters.current == 2
    await r.handle([record(3, tmp_path, fmt="hf-safetensors")])
    assert "serves LoRA adapters" in letters.errors[-1] and adapters.current == 2


async def test_an_older_adapter_is_unloaded_once_released_and_no_longer_held(tmp_path: Path) -> None:
    held: set[int] = set()
    r, engine, adapters, _ = await reloader(tmp_path, held)
    await r.handle([record(1, tmp_path)])
    version, name = adapters.lease()  # a request on its way to version 1
    assert (version, name) == (1, adapter_name(1))
    await r.handle([record(2, tmp_path)])
    assert adapters.current == 2 and adapters.lease()[0] == 2  # new requests go to 2 at once
    await asyncio.sleep(0.1)
    assert adapter_name(1) in engine.loaded, "still leased: not unloaded"
    held.add(1)  # an evaluation of version 1 that began just before version 2 was loaded
    adapters.release(1)
    await asyncio.sleep(0.1)
    assert adapter_name(1) in engine.loaded, "still held by its evaluation: not unloaded"
    held.clear()
    await asyncio.sleep(1.2)
    assert set(engine.loaded) == {adapter_name(2)} and ("unload", adapter_name(1)) in engine.calls
