from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventProducer
from schemas import Sample
from schemas.topics import SAMPLES


def save_tiny_llama(out: Path, vocab_size: int = 512, max_positions: int = 256) -> Path:
    """A two-layer Llama with tied embeddings and grouped KV heads, random weights (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def trainer_env(kafka: KafkaConfig, model: Path, out: Path) -> dict[str, str]:
    """Environment for a ``turnstream trainer`` subprocess: batches of 4, every sample fresh (all come from v0)."""
    return {
        **kafka.client_env(),
        "TURNSTREAM_KAFKA_SEAL_KEYS_URL": kafka.seal_keys_url,
        "TURNSTREAM_KAFKA_NAMESPACE": kafka.namespace,
        "TURNSTREAM_TRAINER_HF_CHECKPOINT": str(model),
        "TURNSTREAM_TRAINER_OUTPUT_DIR": str(out),
        "TURNSTREAM_TRAINER_ROLLOUT_BATCH_SIZE": "4",
        "TURNSTREAM_TRAINER_LR": "0.001",
        "TURNSTREAM_TRAINER_MAX_STALENESS": "100",
        "OMP_NUM_THREADS": "1",
    }


def make_sample(i: int, weight_version: int = 0) -> Sample:
    n = 3 + i % 4
    return Sample(
        sample_id=f"s{i % 3}:{i + 1}",
        session_id=f"s{i % 3}",
        mode="rl",
        kind="rl",
        tokens=[1 + (i * 7 + k) % 500 for k in range(5 + n)],
        response_length=n,
        loss_mask=[1] * n,
        rollout_logprobs=[-6.0] * n,
        reward=1.0 if i % 2 else -1.0,
        weight_version=weight_version,
        created_at=time.time(),
    )


async def publish(kafka: KafkaConfig, samples: list[Sample]) -> None:
    async with EventProducer(kafka) as producer:
        for s in samples:
            await producer.send(SAMPLES, s, s.session_id)


def save_random_model(out: Path, **overrides: object) -> Path:
    """A random Llama-family folder (config.json and one safetensors file) of a size given by ``overrides``,
    written directly from tensor shapes: no transformers model is built, so ~1B parameters take seconds."""
    import json

    from safetensors.torch import save_file

    from services.trainer.model import hf_shapes
    from services.trainer.spec import ModelSpec

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 32000,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **overrides,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = hf_shapes(ModelSpec.from_hf(config))
    save_file(
        {k: torch.randn(*s, generator=g) * 0.02 for k, s in shapes.items()}, str(out / "model.safetensors")
    )
    return out
