"""The real SGLang servers of a test run: which there are, when each starts, how many run at once.

An SGLang start costs about 70 s and 90 CPU-seconds on this machine (three processes importing torch and SGLang),
and a running server about 3.6 GB (its weights, its KV cache, and those three processes). So:

- The shared server (``engine``: SmolLM2, no keys, 16,384 tokens of KV cache for the clients' long prompts)
  starts as soon as collection shows that a selected test needs it, and serves the whole run. ``own_engine`` lends
  it to a module that changes its weights or restarts it, and gives it back at version 0.
- Every other configuration (``MODULE_ENGINES``: LoRA with keys, a second replica, a second LoRA replica, the
  reasoning parser) is one module's own, started ``LEAD_MODULES`` modules ahead of its first use so that its
  start-up overlaps other tests, and stopped with that module. These need short prompts only: 4,096 tokens of KV.
- At most ``MAX_ALIVE`` servers run at once (``TURNSTREAM_TEST_MAX_ENGINES``): a start ahead waits for room.
  Beside them runs the other lane (tests/lanes.py) and, at times, a three-broker Kafka; 24 GB holds no more.
- A test that starts servers of its own (marked ``starts_engines(n)``: ``turnstream run`` starts two) runs last,
  and the shared server is stopped before it when no test after it needs it.

The bill at the end of the run (tests/report.py) counts the starts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from runtime.engine.model_store import fetch_smollm2
from services.engine.launch import EngineProcess

MAX_ALIVE = int(os.environ.get("TURNSTREAM_TEST_MAX_ENGINES", "3"))
LEAD_MODULES = 3
SHORT_KV = ("--max-total-tokens", "4096")
LORA_ENV = {"TURNSTREAM_TRAINER_LORA_ENABLED": "true"}
ENGINE_KEYS = {
    "TURNSTREAM_ENGINE_API_KEY": "test-engine-api-key-0123456789",
    "TURNSTREAM_ENGINE_ADMIN_API_KEY": "test-engine-admin-key-0123456789",
}
"""The LoRA engines' keys (``--api-key``, ``--admin-api-key``): their tests drive them as turnstream's own clients
do."""


class RunningEngine:
    """An SGLang server someone else started (``TURNSTREAM_TEST_ENGINE_URL``): a developer's warm engine, so a
    rerun does not wait a minute and a half for start-up. It must serve SmolLM2 at version 0, unmodified."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def stop(self) -> None:
        return None


def _log(name: str) -> IO[str]:
    return open(os.path.join(tempfile.gettempdir(), f"turnstream-test-{name}.log"), "w")


def _server(name: str, *flags: str, env: dict[str, str] | None = None) -> Callable[[], EngineProcess]:
    return lambda: EngineProcess(fetch_smollm2(log=False), *flags, log=_log(name), env=env, wait=False)


SHARED = _server("engine")
MODULE_ENGINES: dict[str, Callable[[], EngineProcess]] = {
    "lora_engine": _server("lora-engine", "--lora", *SHORT_KV, env={**LORA_ENV, **ENGINE_KEYS}),
    "reasoning_engine": _server("reasoning-engine", "--reasoning-parser", "qwen3", *SHORT_KV),
    "second_engine": _server("second-engine", *SHORT_KV),
    "second_lora_engine": _server("second-lora-engine", "--lora", *SHORT_KV, env={**LORA_ENV, **ENGINE_KEYS}),
}
"""The SGLang servers of one test module each (``module_engine``)."""


class Servers:
    """This process's servers: the shared one, those started ahead, and every one alive."""

    def __init__(self) -> None:
        self.shared: EngineProcess | None = None
        self.early: dict[str, EngineProcess] = {}
        self.alive: list[EngineProcess] = []
        self.start_before: dict[str, list[str]] = {}
        self.due: list[str] = []
        self.items: list[pytest.Item] = []

    def start(self, factory: Callable[[], EngineProcess]) -> EngineProcess:
        proc = factory()
        self.alive.append(proc)
        return proc

    def stop(self, proc: EngineProcess) -> None:
        proc.stop()
        if proc in self.alive:
            self.alive.remove(proc)


SERVERS = Servers()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "starts_engines(n): starts n SGLang servers itself; runs last, in the engines lane"
    )


def _starts(item: pytest.Item) -> int:
    marker = item.get_closest_marker("starts_engines")
    return int(marker.args[0]) if marker else 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that start servers of their own go last (stable), when the shared one can be stopped first."""
    items[:] = [i for i in items if not _starts(i)] + [i for i in items if _starts(i)]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared server as soon as the selected tests (this lane's) are known to need it, and plan when
    each module server starts."""
    if session.config.option.collectonly:
        return
    SERVERS.items = list(session.items)
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "engine" in wanted and not os.environ.get("TURNSTREAM_TEST_ENGINE_URL"):
        SERVERS.shared = SERVERS.start(SHARED)
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in session.items))
    first_use: dict[str, int] = {}
    for item in session.items:
        for name in MODULE_ENGINES.keys() & set(getattr(item, "fixturenames", ())):
            first_use.setdefault(name, modules.index(item.nodeid.split("::")[0]))
    for name, used in sorted(first_use.items(), key=lambda kv: kv[1]):
        SERVERS.start_before.setdefault(modules[max(0, used - LEAD_MODULES)], []).append(name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start the module server that is due, one ahead at a time and only while there is room; before a test that
    starts its own, stop the shared one if nothing after it needs it."""
    SERVERS.due.extend(SERVERS.start_before.pop(item.nodeid.split("::")[0], []))
    if SERVERS.due and not SERVERS.early and len(SERVERS.alive) < MAX_ALIVE:
        name = SERVERS.due.pop(0)
        SERVERS.early[name] = SERVERS.start(MODULE_ENGINES[name])
    if _starts(item) and SERVERS.shared is not None and item in SERVERS.items:
        later = SERVERS.items[SERVERS.items.index(item) + 1 :]
        if not any("engine" in getattr(i, "fixturenames", ()) for i in later):
            SERVERS.stop(SERVERS.shared)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for proc in list(SERVERS.alive):  # the shared one, and any started ahead that no test came to use
        SERVERS.stop(proc)


def module_engine(name: str) -> Iterator[EngineProcess]:
    """A module fixture's own SGLang server (``MODULE_ENGINES``): the one started ahead, else started now."""
    if name in SERVERS.due:
        SERVERS.due.remove(name)
    proc = SERVERS.early.pop(name, None) or SERVERS.start(MODULE_ENGINES[name])
    try:
        proc.wait_ready(proc.ready_path)
        yield proc
    finally:
        SERVERS.stop(proc)


@pytest.fixture(scope="session")
def engine() -> Iterator[EngineProcess | RunningEngine]:
    """The shared real SGLang server (SmolLM2) for the tests that do not change its weights (see above)."""
    if url := os.environ.get("TURNSTREAM_TEST_ENGINE_URL"):
        yield RunningEngine(url)
        return
    if SERVERS.shared is None:
        SERVERS.shared = SERVERS.start(SHARED)
    SERVERS.shared.wait_ready(SERVERS.shared.ready_path)
    yield SERVERS.shared


@pytest.fixture(scope="module")
def lora_engine() -> Iterator[EngineProcess]:
    """A real SGLang server (SmolLM2) started with --enable-lora and keys (``turnstream engine --lora``), for the
    tests of adapters."""
    yield from module_engine("lora_engine")


@pytest.fixture(scope="module")
def own_engine(
    engine: EngineProcess | RunningEngine, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """An SGLang server whose weights these tests may change and which they restart: the shared one when this
    run started it (a start costs 70-100 s of the two cores), given back afterwards as the other tests expect it
    (the starting weights, version 0); else one of the module's own."""
    if isinstance(engine, EngineProcess):
        yield engine
        back = httpx.post(
            engine.url + "/update_weights_from_disk",
            json={"model_path": str(smollm2_path), "weight_version": "0"},
            timeout=600,
        )
        assert back.status_code == 200, back.text
        assert httpx.get(engine.url + "/model_info", timeout=30).json()["weight_version"] == "0"
        return
    log = open(tmp_path_factory.mktemp("reload-engine") / "engine.log", "w")
    proc = SERVERS.start(lambda: EngineProcess(smollm2_path, log=log))
    try:
        yield proc
    finally:
        SERVERS.stop(proc)
        log.close()
