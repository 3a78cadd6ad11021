from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import redis.asyncio as aioredis

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.engine.model_store import fetch_smollm2
from runtime.messaging.topics import create_topics
from services.engine.launch import EngineProcess
from tests.infra import Service, start_kafka, start_private_kafka, start_private_redis, start_redis

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest_plugins = ["tests.report", "tests.lanes", "tests.engines"]
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
    return namespaced_kafka(kafka_service.address, redis_service.address, namespace, **kafka_service.login)


def namespaced_kafka(bootstrap: str, seal_keys_url: str, namespace: str, **settings: Any) -> KafkaConfig:
    """A test's Kafka settings: its namespace, its own sealing keys (a test that forgets its session ``s2`` must not
    destroy the key of another test's ``s2`` in the shared Redis), short polls and sessions (failures are noticed
    in seconds). ``KafkaConfig.client_env`` hands all but the polls to the services a test starts."""
    return KafkaConfig(
        bootstrap=bootstrap,
        seal_keys_url=seal_keys_url,
        seal_keys_prefix=settings.pop("seal_keys_prefix", f"{namespace}dek:"),
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
    return proxy_settings(kafka, redis_config, engine, tmp_path)


def proxy_settings(kafka: KafkaConfig, redis: RedisConfig, engine: Any, folder: Path) -> dict[str, str]:
    """``proxy_env`` for any namespace, Redis prefix, engine (a test server: tests/engines.py) and folder (for its
    spool and weights). The engine's admin key goes along: the proxy's reloader pauses, loads and continues it."""
    keyed = (
        {"TURNSTREAM_ENGINE_ADMIN_API_KEY": engine.admin_key} if getattr(engine, "admin_key", None) else {}
    )
    return {
        **keyed,
        **kafka.client_env(),
        "TURNSTREAM_REDIS_URL": redis.url,
        "TURNSTREAM_REDIS_KEY_PREFIX": redis.key_prefix,
        "TURNSTREAM_ENGINE_URL": engine.url,
        "TURNSTREAM_PROXY_SPOOL_DIR": str(folder / "spool"),
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(folder / "weights"),
    }
