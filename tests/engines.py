"""The real SGLang servers of a test run: which there are, when each starts, how many run at once.

An SGLang start costs about 70 s and 90 CPU-seconds on this machine (three processes importing torch and SGLang),
and a running server about 3.6 GB (its weights, its KV cache, and those three processes). So a run has as few
configurations as the tests allow, each started once:

- ``shared``: SmolLM2 with LoRA on and an admin key (``turnstream engine --lora``, as the one-GPU LoRA recipe runs
  it; requests naming no adapter get the base model, and full-weight updates work beside adapters), 16,384 tokens of
  KV cache for the clients' long prompts. It starts as soon as collection shows that a selected test needs it, and
  serves the whole run: ``engine`` uses it as it is; ``own_engine`` and ``lora_engine`` lend it to a module that
  changes its weights or loads adapters on it (or restarts it), and give it back as the next module expects it:
  version 0, no adapter.
- ``second``: the same configuration with 4,096 tokens of KV, the second replica of the replica tests (full
  weights and adapters); ``reasoning``: SmolLM2 behind the qwen3 reasoning parser. Each starts ``LEAD_MODULES``
  modules ahead of its first use, so that its start-up overlaps other tests, is lent to each module that uses it
  (``second_engine``, ``reasoning_engine``) and stops after its last use.
- At most ``MAX_ALIVE`` servers run at once (``TURNSTREAM_TEST_MAX_ENGINES``): a start ahead waits for room.
  Beside them runs the other lane (tests/lanes.py) and, at times, a three-broker Kafka; 24 GB holds no more.
- A test that starts servers of its own (marked ``starts_engines(n)``: ``turnstream run`` starts two) runs last,
  and the shared server is stopped before it when no test after it needs it.

A restart on purpose (a test that kills a server) is the only other start. The bill at the end of the run
(tests/report.py) counts them all.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
import pytest

from runtime.engine.model_store import fetch_smollm2
from services.engine.launch import EngineProcess

MAX_ALIVE = int(os.environ.get("TURNSTREAM_TEST_MAX_ENGINES", "3"))
LEAD_MODULES = 3
LORA_ENV = {"TURNSTREAM_TRAINER_LORA_ENABLED": "true"}
ADMIN_KEY = "test-engine-admin-key-0123456789"
ENGINE_KEYS = {
    "TURNSTREAM_ENGINE_API_KEY": "test-engine-api-key-0123456789",
    "TURNSTREAM_ENGINE_ADMIN_API_KEY": ADMIN_KEY,
}
"""What a proxy (or any client of turnstream's) is given to drive the servers: the admin key is the servers' own
(``--admin-api-key``: weight updates, pauses, adapters need it); the API key they do not check (no ``--api-key``,
so that every test may ask them directly) and a client sends harmlessly. turnstream run's test covers a server that
checks both."""


class Server(EngineProcess):
    """A test server: ``turnstream engine`` with its admin key known (None: the server has none)."""

    def __init__(
        self, name: str, *flags: str, admin_key: str | None = None, env: dict[str, str] | None = None
    ):
        self.admin_key = admin_key
        keyed = {"TURNSTREAM_ENGINE_ADMIN_API_KEY": admin_key} if admin_key else {}
        super().__init__(
            fetch_smollm2(log=False), *flags, log=_log(name), env={**(env or {}), **keyed}, wait=False
        )


class RunningEngine:
    """An SGLang server someone else started (``TURNSTREAM_TEST_ENGINE_URL``): a developer's warm engine, so a
    rerun does not wait a minute and a half for start-up. It must be configured as ``shared`` is (SmolLM2 at
    version 0, ``turnstream engine --lora`` with ``TURNSTREAM_ENGINE_ADMIN_API_KEY`` set to ``ADMIN_KEY``)."""

    admin_key = ADMIN_KEY

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def stop(self) -> None:
        return None


def admin(server: Server | RunningEngine) -> dict[str, str]:
    """The header that unlocks a server's admin routes."""
    return {"Authorization": f"Bearer {server.admin_key}"} if server.admin_key else {}


def _log(name: str) -> IO[str]:
    return open(os.path.join(tempfile.gettempdir(), f"turnstream-test-{name}.log"), "w")


CONFIGS: dict[str, Callable[[], Server]] = {
    "shared": lambda: Server("engine", "--lora", admin_key=ADMIN_KEY, env=LORA_ENV),
    "second": lambda: Server(
        "second-engine", "--lora", "--max-total-tokens", "4096", admin_key=ADMIN_KEY, env=LORA_ENV
    ),
    "reasoning": lambda: Server(
        "reasoning-engine", "--reasoning-parser", "qwen3", "--max-total-tokens", "4096"
    ),
}
USERS = {"engine": "shared", "own_engine": "shared", "lora_engine": "shared"}
USERS |= {"second_engine": "second", "reasoning_engine": "reasoning"}
"""Each fixture that hands out a server, and the configuration it hands out."""
AHEAD = ("second", "reasoning")
"""The configurations started ahead of their first use and stopped after their last."""


@dataclass
class Servers:
    """This process's servers, and the plan of when each starts and stops."""

    started: dict[str, Server] = field(default_factory=dict)
    first_module: dict[str, str] = field(default_factory=dict)
    last_item: dict[str, str] = field(default_factory=dict)
    due: list[str] = field(default_factory=list)
    items: list[pytest.Item] = field(default_factory=list)

    def start(self, config: str) -> Server:
        if config not in self.started:
            self.started[config] = CONFIGS[config]()
        return self.started[config]

    def stop(self, config: str) -> None:
        server = self.started.pop(config, None)
        if server is not None:
            server.stop()


SERVERS = Servers()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "starts_engines(n): starts n SGLang servers itself; runs last, in the engines lane"
    )


def _starts(item: pytest.Item) -> int:
    marker = item.get_closest_marker("starts_engines")
    return int(marker.args[0]) if marker else 0


def _configs(item: pytest.Item) -> set[str]:
    return {USERS[f] for f in getattr(item, "fixturenames", ()) if f in USERS}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that start servers of their own go last (stable), when the shared one can be stopped first."""
    items[:] = [i for i in items if not _starts(i)] + [i for i in items if _starts(i)]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared server as soon as the selected tests (this lane's) are known to need it; plan when each
    other server starts (``LEAD_MODULES`` ahead of its first use) and stops (after its last)."""
    if session.config.option.collectonly:
        return
    SERVERS.items = list(session.items)
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in session.items))
    for item in session.items:
        module = modules.index(item.nodeid.split("::")[0])
        for config in _configs(item) & set(AHEAD):
            SERVERS.first_module.setdefault(config, modules[max(0, module - LEAD_MODULES)])
            SERVERS.last_item[config] = item.nodeid
    if any("shared" in _configs(i) for i in session.items) and not os.environ.get(
        "TURNSTREAM_TEST_ENGINE_URL"
    ):
        SERVERS.start("shared")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start a server that is due, while there is room; before a test that starts its own, stop the shared one if
    nothing after it needs it."""
    module = item.nodeid.split("::")[0]
    SERVERS.due += [c for c, m in SERVERS.first_module.items() if m == module and c not in SERVERS.due]
    while SERVERS.due and len(SERVERS.started) < MAX_ALIVE:
        SERVERS.start(SERVERS.due.pop(0))
    if _starts(item) and "shared" in SERVERS.started and item in SERVERS.items:
        later = SERVERS.items[SERVERS.items.index(item) + 1 :]
        if not any("shared" in _configs(i) for i in later):
            SERVERS.stop("shared")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After a server's last test (and its module's fixtures) is done, it stops: its memory for the next."""
    try:
        return (yield)
    finally:
        for config, last in SERVERS.last_item.items():
            if last == item.nodeid:
                SERVERS.stop(config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for config in list(SERVERS.started):  # the shared one, and any that no test came to use
        SERVERS.stop(config)


def restore(server: Server | RunningEngine) -> None:
    """Back as the next module expects it: the starting weights (version 0), no adapter loaded."""
    info = httpx.get(server.url + "/model_info", timeout=30).json()
    if info["weight_version"] != "0":
        back = httpx.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(fetch_smollm2(log=False)), "weight_version": "0"},
            headers=admin(server),
            timeout=600,
        )
        assert back.status_code == 200, back.text
    for model in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]:
        if model.get("parent"):
            gone = httpx.post(
                server.url + "/unload_lora_adapter", json={"lora_name": model["id"]}, headers=admin(server)
            )
            assert gone.status_code == 200, gone.text
    assert httpx.get(server.url + "/model_info", timeout=30).json()["weight_version"] == "0"


def lend(config: str) -> Iterator[Server]:
    """A module's use of a server: started (or started now), answering, and given back restored."""
    server = SERVERS.start(config)
    if config in SERVERS.due:
        SERVERS.due.remove(config)
    server.wait_ready(server.ready_path)
    yield server
    if server.proc.poll() is None:  # a test that killed it for good leaves nothing to restore
        restore(server)


@pytest.fixture(scope="session")
def engine() -> Iterator[Server | RunningEngine]:
    """The shared real SGLang server, for tests that neither change its weights nor load adapters on it."""
    if url := os.environ.get("TURNSTREAM_TEST_ENGINE_URL"):
        yield RunningEngine(url)
        return
    server = SERVERS.start("shared")
    server.wait_ready(server.ready_path)
    yield server


@pytest.fixture(scope="module")
def own_engine(engine: Server | RunningEngine) -> Iterator[Server]:
    """The shared server for a module that changes its weights or restarts it; given back at version 0. (Beside a
    developer's running engine, which cannot be restarted from here, a server of the module's own.)"""
    if isinstance(engine, Server):
        yield engine
        restore(engine)
        return
    server = CONFIGS["shared"]()
    try:
        server.wait_ready(server.ready_path)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lora_engine(engine: Server | RunningEngine) -> Iterator[Server | RunningEngine]:
    """The shared server for a module that loads adapters on it; given back with none loaded."""
    yield engine
    restore(engine)


@pytest.fixture(scope="module")
def second_engine() -> Iterator[Server]:
    """A second policy replica, configured as the shared one (the replica tests, full weights and adapters)."""
    yield from lend("second")


@pytest.fixture(scope="module")
def reasoning_engine() -> Iterator[Server]:
    """SmolLM2 behind SGLang's qwen3 reasoning parser."""
    yield from lend("reasoning")
