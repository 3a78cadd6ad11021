"""What a re-derive starts, without starting it: each stage's own configuration (as the process will load it from
its environment) carries the new namespace, Redis prefix, mode, judge model, prompts and id; the live config
is unchanged."""

from __future__ import annotations

import msgspec
import pytest

from runtime.configuration.config import Config, KafkaConfig, load_config
from services.replay.derive import DeriveOptions, derive_config, stages


def test_each_stage_loads_the_replay_configuration() -> None:
    live = Config(kafka=KafkaConfig(bootstrap="kafka:9092"))
    opts = DeriveOptions(
        into="replay-7",
        mode="opd",
        judge_backend="engine",
        judge_engine_url="http://judge:30001",
        judge_model="Qwen3-32B",
        judge_prompts="/prompts/strict",
        judge_id="strict",
        teacher_engine_url="http://teacher:30002",
        idle_timeout_s=60.0,
    )
    replay = derive_config(live, opts)
    planned = {s.name: s for s in stages(replay, None)}
    assert list(planned) == ["pairer", "judge", "teacher", "dispatcher"]  # opd needs the teacher
    ports = {s.port for s in planned.values()}
    assert len(ports) == 4
    for name, service in planned.items():
        assert service.args == [name] and service.ready_path == "/metrics"
        loaded = load_config(env={"TURNSTREAM_KAFKA_BOOTSTRAP": "kafka:9092", **service.env})
        assert loaded.kafka.namespace == "replay-7."
        assert loaded.redis.key_prefix == "turnstream:replay-7."
        assert loaded.metrics.port == service.port
        assert loaded.judge.judge_id == "strict" and loaded.judge.model == "Qwen3-32B"
        assert (
            loaded.judge.prompts_dir == "/prompts/strict" and loaded.judge.engine_url == "http://judge:30001"
        )
        assert loaded.dispatcher.mode == "opd" and loaded.dispatcher.judge_ids == ["strict"]
        assert loaded.teacher.engine_url == "http://teacher:30002"
        assert loaded.pairer.idle_timeout_s == 60.0
    assert live.kafka.namespace == "" and live.dispatcher.mode == "combine"


def test_rl_mode_runs_no_teacher_and_keeps_what_was_not_asked_to_change() -> None:
    live = Config(kafka=KafkaConfig(namespace="prod"))
    replay = derive_config(live, DeriveOptions(into="r2", mode="rl"))
    assert [s.name for s in stages(replay, "/etc/turnstream.toml")] == ["pairer", "judge", "dispatcher"]
    assert stages(replay, "/etc/turnstream.toml")[0].args == ["--config", "/etc/turnstream.toml", "pairer"]
    unchanged = msgspec.structs.replace(
        replay, kafka=live.kafka, redis=live.redis, dispatcher=live.dispatcher
    )
    assert unchanged == live


def test_an_unknown_mode_stops_the_replay_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"'grpo-z' is not one of combine, opd, opd-topk, rl"):
        derive_config(Config(), DeriveOptions(into="r3", mode="grpo-z"))
