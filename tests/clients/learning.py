"""The end of every client's test: its corrected turns judged by the rules judge, made training samples, and
trained on: one step of the real trainer (Megatron-core on the CPU) on the policy the engine serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from runtime.configuration.config import Config, DispatcherConfig, TrainerConfig
from schemas import Judgment, Sample, WeightsPublished
from schemas.topics import SAMPLES, WEIGHTS
from services.dispatcher.worker import run_dispatcher
from services.judge.worker import run_judge
from tests.kafka_wait import wait_for_events
from tests.services.judge.conftest import wait_for_judgments


async def judged(config: Config, wanted: set[str]) -> dict[tuple[str, str], Judgment]:
    """The judge's votes ((turn id, kind) -> judgment) on the ``wanted`` turns, once each has its hint vote."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_judge(config, install_signals=False, stop=stop))
    try:
        votes: list[Judgment] = await wait_for_judgments(
            config.kafka, lambda js: wanted <= {j.turn_id for j in js if j.kind == "hint"}, 120
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    return {(j.turn_id, j.kind): j for j in votes if j.turn_id in wanted}


async def taught(config: Config, wanted: set[str]) -> dict[str, Sample]:
    """The samples the dispatcher makes of the ``wanted`` turns in mode rl (the judged reward)."""
    rl = msgspec.structs.replace(config, dispatcher=DispatcherConfig(mode="rl", sweep_interval_s=0.2))
    stop = asyncio.Event()
    task = asyncio.create_task(run_dispatcher(rl, install_signals=False, stop=stop))
    try:
        samples: list[Sample] = await wait_for_events(
            config.kafka, SAMPLES, lambda ss: wanted <= {s.sample_id for s in ss}, 120
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    return {s.sample_id: s for s in samples if s.sample_id in wanted}


async def trained(config: Config, model: Path, out: Path, batch: int) -> WeightsPublished:
    """The version one trainer step publishes from the first ``batch`` samples on the topic (what the client's
    turns became), trained from ``model`` (the engine's SmolLM2) into ``out``."""
    from services.trainer.worker import run_trainer

    settings = {
        "hf_checkpoint": str(model),
        "output_dir": str(out),
        "rollout_batch_size": batch,
        "max_steps": 1,
        "lr": 1e-3,  # a step large enough to show in the published (bf16) weights
    }
    step = msgspec.structs.replace(config, trainer=msgspec.convert(settings, TrainerConfig))
    await asyncio.wait_for(run_trainer(step, install_signals=False), 600)
    published: list[WeightsPublished] = await wait_for_events(config.kafka, WEIGHTS, bool, 30)
    return published[0]
