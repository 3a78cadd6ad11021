from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import hypothesis
import pytest
import redis.asyncio as aioredis

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.engine.model_store import fetch_smollm2
from runtime.messaging.topics import create_topics
from services.engine.launch import EngineProcess
from tests.infra import Service, start_kafka, start_private_kafka, start_private_redis, start_redis

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest_plugins = ["tests.report", "tests.lanes"]
# No property test has a time limit per example: on a busy 2-core machine (an SGLang server starting beside it)
# one slow example is the machine's, not the code's.
hypothesis.settings.register_profile(
    "suite", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile("suite")

TEST_PARTITIONS = 3


@pytest.fixture(scope="session")
def kafka_service() -> Iterator[Service]:
    service = start_kafka()
    yield service
    if not os.environ.get("TURNSTREAM_KEEP_SERVICES"):
        service.stop()


@pytest.fixture(scope="session")
def redis_service() -> Iterator[Service]:
    service = start_redis()
    yield service
    if not os.environ.get("TURNSTREAM_KEEP_SERVICES"):
        service.stop()


@pytest.fixture(scope="module")
def private_kafka() -> Iterator[Service]:
    """A broker of this module's own, which its tests may stop and restart (``start_private_kafka``)."""
    service = start_private_kafka()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def private_redis() -> Iterator[Service]:
    """A Redis server of this module's own, which its tests may stop and restart."""
    service = start_private_redis()
    yield service
    service.stop()


@pytest.fixture
def namespace() -> str:
    """A topic namespace of this test's own, so tests never see each other's records."""
    return f"test-{uuid.uuid4().hex[:12]}."


@pytest.fixture
def kafka_config(kafka_service: Service, redis_service: Service, namespace: str) -> KafkaConfig:
    """The broker, in the test's namespace; records that hold conversations sealed with keys in the test Redis,
    as every service started with ``TURNSTREAM_REDIS_URL`` seals them."""
    return namespaced_kafka(kafka_service.address, redis_service.address, namespace)


def namespaced_kafka(bootstrap: str, seal_keys_url: str, namespace: str, **settings: Any) -> KafkaConfig:
    """A test's Kafka settings: its namespace, short polls and sessions (failures are noticed in seconds)."""
    return KafkaConfig(
        bootstrap=bootstrap,
        seal_keys_url=seal_keys_url,
        namespace=namespace,
        client_id="turnstream-test",
        poll_timeout_ms=200,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        **settings,
    )


@pytest.fixture
async def kafka(kafka_config: KafkaConfig) -> KafkaConfig:
    """The test's namespace, with every turnstream topic created (3 partitions each, 1 for weights)."""
    await create_topics(kafka_config, partitions=TEST_PARTITIONS)
    return kafka_config


@pytest.fixture
async def redis_config(redis_service: Service) -> RedisConfig:
    return RedisConfig(url=redis_service.address, key_prefix=f"test-{uuid.uuid4().hex[:12]}:")


@pytest.fixture
async def redis_client(redis_config: RedisConfig) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_config.url)
    yield client
    keys = [k async for k in client.scan_iter(match=f"{redis_config.key_prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return fetch_smollm2(log=False)


class RunningEngine:
    """An SGLang server someone else started (``TURNSTREAM_TEST_ENGINE_URL``): a developer's warm engine, so a
    rerun does not wait a minute and a half for start-up. It must serve SmolLM2 at version 0, unmodified."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def stop(self) -> None:
        return None


_early_engine: EngineProcess | None = None
_early_lora_engine: EngineProcess | None = None
LORA_ENV = {"TURNSTREAM_TRAINER_LORA_ENABLED": "true"}
ENGINE_KEYS = {
    "TURNSTREAM_ENGINE_API_KEY": "test-engine-api-key-0123456789",
    "TURNSTREAM_ENGINE_ADMIN_API_KEY": "test-engine-admin-key-0123456789",
}
"""The LoRA engine's keys (``--api-key``, ``--admin-api-key``): its tests drive it as turnstream's own clients do."""


def _log(name: str) -> IO[str]:
    return open(os.path.join(tempfile.gettempdir(), f"turnstream-test-{name}.log"), "w")


def _start_engine() -> EngineProcess:
    return EngineProcess(fetch_smollm2(log=False), log=_log("engine"), wait=False)


def _start_lora_engine() -> EngineProcess:
    return EngineProcess(
        fetch_smollm2(log=False),
        "--lora",
        log=_log("lora-engine"),
        env={**LORA_ENV, **ENGINE_KEYS},
        wait=False,
    )


MODULE_ENGINES: dict[str, Callable[[], EngineProcess]] = {
    "reasoning_engine": lambda: EngineProcess(
        fetch_smollm2(log=False), "--reasoning-parser", "qwen3", log=_log("reasoning-engine"), wait=False
    ),
    "second_engine": lambda: EngineProcess(fetch_smollm2(log=False), log=_log("second-engine"), wait=False),
    "second_lora_engine": lambda: EngineProcess(
        fetch_smollm2(log=False),
        "--lora",
        log=_log("second-lora-engine"),
        env={**LORA_ENV, **ENGINE_KEYS},
        wait=False,
    ),
}
"""The SGLang servers of one test module each (``module_engine``): started LEAD_MODULES modules before the first
module that uses one, so that its 60-160 s of start-up overlap those modules' tests. Not all at collection: each
costs about 4 GB while it lives."""
LEAD_MODULES = 3
_early: dict[str, EngineProcess] = {}
_start_before: dict[str, list[str]] = {}
_due: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared SGLang servers as soon as the selected tests are known to need them: their 70-130 s of
    start-up then overlap the tests that run before the first one that uses them. Plan the module servers' starts."""
    global _early_engine, _early_lora_engine
    if session.config.option.collectonly:
        return
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "engine" in wanted and not os.environ.get("TURNSTREAM_TEST_ENGINE_URL"):
        _early_engine = _start_engine()
    if "lora_engine" in wanted:
        _early_lora_engine = _start_lora_engine()
    modules = list(dict.fromkeys(item.nodeid.split("::")[0] for item in session.items))
    first_use = {}
    for item in session.items:
        for name in MODULE_ENGINES.keys() & set(getattr(item, "fixturenames", ())):
            first_use.setdefault(name, modules.index(item.nodeid.split("::")[0]))
    for name, used in sorted(first_use.items(), key=lambda kv: kv[1]):
        _start_before.setdefault(modules[max(0, used - LEAD_MODULES)], []).append(name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start the module servers that are due, one ahead at a time: a selection of a few modules must not start
    them all at once (4 GB each)."""
    _due.extend(_start_before.pop(item.nodeid.split("::")[0], []))
    if _due and not _early:
        name = _due.pop(0)
        _early[name] = MODULE_ENGINES[name]()


def module_engine(name: str) -> Iterator[EngineProcess]:
    """A module fixture's own SGLang server (``MODULE_ENGINES``): the one started ahead, else started now."""
    if name in _due:
        _due.remove(name)
    proc = _early.pop(name, None) or MODULE_ENGINES[name]()
    yield from _serving(proc)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for early in (_early_engine, _early_lora_engine, *_early.values()):
        if early is not None:  # never used (the tests that needed it failed before asking, or were cut)
            early.stop()


@pytest.fixture(scope="session")
def engine() -> Iterator[EngineProcess | RunningEngine]:
    """One shared real SGLang server (SmolLM2) for the tests that do not change its weights. Started once per
    session, at collection (see ``pytest_collection_finish``): start-up takes 70-130 s on this machine."""
    global _early_engine
    if url := os.environ.get("TURNSTREAM_TEST_ENGINE_URL"):
        yield RunningEngine(url)
        return
    proc, _early_engine = _early_engine or _start_engine(), None
    yield from _serving(proc)


@pytest.fixture(scope="module")
def lora_engine() -> Iterator[EngineProcess]:
    """A real SGLang server (SmolLM2) started with --enable-lora (``turnstream engine --lora``), for the tests of
    adapters; started at collection like ``engine``, and stopped with the module that used it: kept for the
    whole session, it left the pipeline test's two engines too little memory to start (SGLang sizes its CPU KV
    cache from the memory free at start)."""
    global _early_lora_engine
    proc, _early_lora_engine = _early_lora_engine or _start_lora_engine(), None
    yield from _serving(proc)


def _serving(proc: EngineProcess) -> Iterator[EngineProcess]:
    """A fixture's engine once it answers, stopped when the fixture ends."""
    try:
        proc.wait_ready(proc.ready_path)
        yield proc
    finally:
        proc.stop()


SMALL_LAYERS = 2


def save_small_smollm2(smollm2: Path, out: Path, layers: int = SMALL_LAYERS) -> Path:
    """SmolLM2 cut to its first ``layers`` layers, with random weights (seed 0) and SmolLM2's tokenizer: the model
    of tests about the step's logic (loss, masks, offsets, LoRA, parallelism, restarts), where the 30 trained
    layers only cost time. Every tensor it has is SmolLM2's, by name and shape (checked here)."""
    import shutil

    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(smollm2)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for extra in smollm2.iterdir():
        if extra.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(extra, out / extra.name)
    with (
        safe_open(smollm2 / "model.safetensors", "pt") as full,
        safe_open(out / "model.safetensors", "pt") as cut,
    ):
        shapes = {name: full.get_slice(name).get_shape() for name in full.keys()}
        for name in cut.keys():
            assert cut.get_slice(name).get_shape() == shapes[name], name
    return out


@pytest.fixture(scope="session")
def small_smollm2(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``save_small_smollm2``: two layers of SmolLM2's shapes, random weights, SmolLM2's vocabulary."""
    return save_small_smollm2(smollm2_path, tmp_path_factory.mktemp("small-smollm2"))


@pytest.fixture(scope="session")
def hf_model(smollm2_path: Path):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def perturbed_weights(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with every MLP down-projection scaled: a clearly different policy of the same shape."""
    out = tmp_path_factory.mktemp("smollm2-v1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(out)
    return out


@pytest.fixture
def proxy_env(
    kafka: KafkaConfig, redis_config: RedisConfig, engine: EngineProcess, tmp_path: Path
) -> dict[str, str]:
    """What ``turnstream proxy`` needs to serve from the CPU engine and record into the test's namespace."""
    return {
        "TURNSTREAM_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "TURNSTREAM_KAFKA_NAMESPACE": kafka.namespace,
        "TURNSTREAM_REDIS_URL": redis_config.url,
        "TURNSTREAM_REDIS_KEY_PREFIX": redis_config.key_prefix,
        "TURNSTREAM_ENGINE_URL": engine.url,
        "TURNSTREAM_PROXY_SPOOL_DIR": str(tmp_path / "spool"),
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(tmp_path / "weights"),
    }


@pytest.fixture(scope="module")
def own_engine(
    engine: EngineProcess, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """An SGLang server whose weights these tests may change and which they restart: the session's shared one
    when this session started it (an SGLang start costs 70-100 s of the two cores), given back afterwards as the
    other tests expect it (the starting weights, version 0); else one of the module's own."""
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
    proc = EngineProcess(smollm2_path, log=log)
    yield proc
    proc.stop()
    log.close()
