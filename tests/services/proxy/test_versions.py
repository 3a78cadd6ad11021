"""How a streamed turn (SGLang's chunks carry no weight version) is labelled: never newer than the oldest weights
that could have produced one of its tokens, and only after a probe of the engine that began after it ended."""

from __future__ import annotations

import asyncio

from services.proxy.versions import ServedVersions


class Engine:
    """What /model_info would report, and how many times it was asked."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.probes = 0

    async def probe(self) -> int:
        self.probes += 1
        await asyncio.sleep(0.01)
        return self.version


async def labelled(versions: ServedVersions, engine: Engine, during: list[int]) -> int:
    """A stream that starts now, during which the engine serves each of ``during`` in turn (the reloader and the
    probes noticing each), and then completes."""
    runner = asyncio.create_task(versions.run(engine.probe, interval_s=0.05))
    try:
        await asyncio.sleep(0.1)
        start = versions.epoch
        for v in during:
            engine.version = v
            await asyncio.sleep(0.15)  # a few probes
        return await versions.label(start, timeout_s=5)
    finally:
        runner.cancel()


async def test_a_stream_on_unchanged_weights_gets_their_version() -> None:
    assert await labelled(ServedVersions(3), Engine(3), []) == 3


async def test_a_stream_across_a_reload_gets_the_version_before() -> None:
    assert await labelled(ServedVersions(3), Engine(3), [4]) == 3


async def test_a_stream_across_a_restart_and_a_reapply_gets_the_starting_weights() -> None:
    versions = ServedVersions(3)
    assert await labelled(versions, Engine(3), [0, 3]) == 0
    assert versions.current == 3


async def test_the_label_waits_for_a_probe_that_began_after_the_stream_ended() -> None:
    """An engine restarted just before the stream ended, unnoticed so far: the label is only given after a probe
    has seen it, so it is 0, not the 5 the proxy believed."""
    versions = ServedVersions(5)
    engine = Engine(0)  # restarted; no probe has run yet
    runner = asyncio.create_task(versions.run(engine.probe, interval_s=60))  # idle probes far apart
    try:
        await asyncio.sleep(0.05)  # no probe yet: idle probes wait for the interval
        start = versions.epoch
        probes = engine.probes
        assert await versions.label(start, timeout_s=5) == 0
        assert engine.probes > probes, "the completed stream asked for a probe at once"
    finally:
        runner.cancel()


async def test_without_any_probe_the_label_is_the_oldest_version_seen_after_the_timeout() -> None:
    versions = ServedVersions(2)
    start = versions.epoch
    versions.changed(3)
    assert await versions.label(start, timeout_s=0.1) == 2


async def test_an_adapter_drains_when_its_last_lease_ends_and_new_leases_go_to_the_current() -> None:
    from runtime.engine.client import adapter_name
    from services.proxy.adapters import Adapters

    adapters = Adapters()
    assert adapters.lease() == (0, None)  # no adapter yet: the base model
    adapters.release(0)
    adapters.serve(3)
    v, name = adapters.lease()
    v2, _ = adapters.lease()
    assert (v, name, v2) == (3, adapter_name(3), 3)
    adapters.serve(4)
    assert adapters.lease() == (4, adapter_name(4))
    drained = asyncio.create_task(adapters.drained(3))
    adapters.release(3)
    await asyncio.sleep(0.01)
    assert not drained.done()  # one request of version 3 is still on its way
    adapters.release(3)
    await asyncio.wait_for(drained, 1)
    await asyncio.wait_for(adapters.drained(5), 1)  # never leased: drained at once
    assert adapters.leased(4) == 1


async def test_an_engine_that_answers_again_on_the_same_version_is_reported_so_a_missed_load_is_retried() -> (
    None
):
    """A version published while the engine was down could not be loaded; it comes back on the weights it had,
    so no version changed, and the reloader must still hear of it (else the replica waits for the next version)."""
    engine = Engine(0)
    down = False

    async def probe() -> int:
        if down:
            raise ConnectionError("refused")
        return await engine.probe()

    told: list[int] = []
    versions = ServedVersions(0)
    runner = asyncio.create_task(versions.run(probe, interval_s=0.02, on_change=told.append))
    try:
        await asyncio.sleep(0.1)
        assert told == [] and versions.reachable  # answering, unchanged: nothing to tell
        down = True
        await asyncio.sleep(0.1)
        assert not versions.reachable and told == []
        down = False
        await asyncio.sleep(0.1)
        assert versions.reachable and told == [0]  # back, on the same version: told once
        engine.version = 1
        await asyncio.sleep(0.1)
        assert told == [0, 1]  # a change is told as before
    finally:
        runner.cancel()
