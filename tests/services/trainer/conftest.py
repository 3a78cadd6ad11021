from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from schemas import Sample
from schemas.topics import SAMPLES
from services.bus import EventProducer
from services.config import KafkaConfig


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


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
