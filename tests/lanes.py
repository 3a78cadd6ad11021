"""``pytest --lanes``: the suite as two lanes on two pytest-xdist workers, one per core.

A test that talks to a real SGLang server spends most of its time waiting on that server's one busy thread (one
torch thread per process, the house rule), which leaves the machine's second core idle for minutes at a time. So:
the ``engines`` lane (worker gw0) runs every test that uses an SGLang server, in the usual order, with the servers
started ahead as tests/conftest.py arranges; the ``cpu`` lane (worker gw1) runs everything else beside it: the
trainer, the fault rig on stub engines, the brokers' and Redis's own tests, the unit tests. Each worker is a whole
pytest session of its own (its own fixtures), both on one Kafka broker and one Redis server, which the controller
starts before the workers and stops after them.

A test is in the engines lane when it uses one of ``ENGINE_FIXTURES`` (directly or through another fixture) or is
marked ``starts_engines`` (it starts SGLang itself, as ``turnstream run`` does: tests/engines.py). Without
``--lanes``, or with ``-n 0``, everything runs in one process as before.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.engines import USERS
from tests.infra import LOGIN_ENV, Service, start_kafka, start_redis

ENGINE_FIXTURES = frozenset(USERS)
LANES = ("engines", "cpu")
_services: list[Service] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lanes",
        action="store_true",
        help="two xdist workers: tests that use an SGLang server on one, the rest on the other (tests/lanes.py)",
    )


def _worker(config: pytest.Config) -> str | None:
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else None


def lanes_on(config: pytest.Config) -> bool:
    """Whether this run is split into lanes (in the controller and in both workers)."""
    return bool(config.getoption("lanes")) and config.getoption("numprocesses", None) != 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """In the controller: two workers, each running what it collects (``--dist each``: each worker deselects the
    other lane's tests, so no test runs twice)."""
    if lanes_on(config) and _worker(config) is None and not config.option.collectonly:
        config.option.numprocesses = len(LANES)
        config.option.dist = "each"


def pytest_configure(config: pytest.Config) -> None:
    if not lanes_on(config) or _worker(config) is not None or config.option.collectonly:
        return
    # One broker and one Redis for both workers, named to them by the environment they inherit.
    for start, variable in (
        (start_kafka, "TURNSTREAM_KAFKA_BOOTSTRAP"),
        (start_redis, "TURNSTREAM_REDIS_URL"),
    ):
        service = start()
        _services.append(service)
        os.environ[variable] = service.address
        if service.login:
            os.environ[LOGIN_ENV] = json.dumps(service.login)


_collected: dict[str, int] = {}
_session: list[pytest.Session] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _session[:] = [session]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """In the controller: count each lane's tests (xdist takes the last worker's count as the run's, which made
    the progress read 473%)."""
    _collected[node.gateway.id] = len(ids)
    reporter = _session[0].config.pluginmanager.get_plugin("terminalreporter") if _session else None
    if reporter is not None and len(_collected) == len(LANES):
        counts = ", ".join(
            f"{LANES[int(w.removeprefix('gw')) % len(LANES)]} {n}" for w, n in sorted(_collected.items())
        )
        reporter.write_line(f"lanes: {counts} tests (xdist's count below is one worker's)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _collected and _session and _worker(_session[0].config) is None:
        _session[0].testscollected = sum(_collected.values())


def pytest_unconfigure(config: pytest.Config) -> None:
    if not os.environ.get("TURNSTREAM_KEEP_SERVICES"):
        for service in _services:
            service.stop()
    _services.clear()


def lane(item: pytest.Item) -> str:
    """``engines`` for a test that needs an SGLang server, ``cpu`` for the rest."""
    uses = ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))
    return "engines" if uses or item.get_closest_marker("starts_engines") else "cpu"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    worker = _worker(config)
    if not lanes_on(config) or worker is None:
        return
    mine = LANES[int(worker.removeprefix("gw")) % len(LANES)]
    keep = [item for item in items if lane(item) == mine]
    deselected = [item for item in items if lane(item) != mine]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = keep
