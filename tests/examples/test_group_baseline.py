"""examples/plugins/group_baseline.py through the real trainer service and Kafka: on a batch whose rewards are all
equal the group baseline teaches nothing (the published weights are the starting ones), where the default formula
moves the policy; on mixed rewards its advantages are the z-scores of the rewards."""

from __future__ import annotations

import asyncio
import time
import warnings
from pathlib import Path

import msgspec
import pytest
import torch

from runtime.configuration.config import Config, KafkaConfig, TrainerConfig
from runtime.messaging.bus import read_topic
from schemas import Sample
from schemas.topics import WEIGHTS
from services.trainer.model import read_hf_weights
from services.trainer.worker import run_trainer
from tests.services.trainer.conftest import make_sample, publish, save_tiny_llama

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
PLUGIN = "examples.plugins.group_baseline"


def trainer_config(kafka: KafkaConfig, model: Path, out: Path, **trainer: object) -> Config:
    tc = msgspec.convert(
        {
            "hf_checkpoint": str(model),
            "output_dir": str(out),
            "rollout_batch_size": 4,
            "lr": 1e-3,
            "weight_decay": 0.0,
            "max_steps": 1,
            "group_id": f"trainer-{out.name}",
            **trainer,
        },
        TrainerConfig,
    )
    return Config(kafka=kafka, trainer=tc)


@pytest.mark.integration
async def test_equal_rewards_teach_nothing_under_the_group_baseline(
    kafka: KafkaConfig, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    model = save_tiny_llama(tmp_path / "tiny")
    await publish(kafka, [msgspec.structs.replace(make_sample(i), reward=1.0) for i in range(4)])
    start = read_hf_weights(model)
    moved: dict[str, bool] = {}
    for name, advantages in (("default", None), ("grpo", f"{PLUGIN}:per_batch")):
        extra = {"advantages": advantages} if advantages else {}
        await asyncio.wait_for(
            run_trainer(trainer_config(kafka, model, tmp_path / name, **extra), install_signals=False), 180
        )
        published = [
            r.event
            async for r in read_topic(kafka, WEIGHTS)
            if Path(r.event.path).is_relative_to(tmp_path / name)
        ]
        assert len(published) == 1
        weights = read_hf_weights(Path(published[0].path))
        moved[name] = any(not torch.equal(weights[k], start[k]) for k in start)
    assert moved == {"default": True, "grpo": False}


def sample(
    session: str, reward: float, kind: str = "rl", mode: str = "rl", teacher: list[float] | None = None
) -> Sample:
    return Sample(
        sample_id=f"{session}:{reward}:{time.monotonic_ns()}",
        session_id=session,
        mode=mode,
        kind=kind,
        tokens=[1, 2, 3, 4, 5],
        response_length=2,
        loss_mask=[1, 1],
        rollout_logprobs=[-1.0, -2.0],
        reward=reward,
        weight_version=0,
        created_at=time.time(),
        teacher_logprobs=teacher,
    )


def test_the_advantages_are_the_rewards_z_scores_within_each_group() -> None:
    from examples.plugins.group_baseline import per_batch, per_session

    settings = TrainerConfig(w_opd=1.0, w_rl=1.0)
    batch = [
        sample("a", 1.0),
        sample("a", -1.0),
        sample("b", 1.0),
        sample("b", 1.0),
        sample("c", 0.0, kind="opd", mode="opd", teacher=[-0.5, -1.0]),
    ]
    z = [(r - 0.5) / (3**0.5 / 2 + 1e-6) for r in (1.0, -1.0, 1.0, 1.0)]  # mean 1/2, std sqrt(3)/2
    got = per_batch(batch, settings)
    assert [a[0].item() for a in got[:4]] == pytest.approx(z, abs=1e-5)
    assert got[4].tolist() == [0.5, 1.0], (
        "an opd sample keeps its teacher term and stays out of the statistics"
    )
    by_session = per_session(batch, settings)
    assert [a[0].item() for a in by_session[:4]] == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
