"""What ``turnstream run`` starts: order, ports, loopback binds, which engine each worker talks to."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.configuration.config import load_config
from services.run.plan import plan


def test_default_plan_starts_engines_then_proxy_then_workers_on_loopback() -> None:
    config = load_config(env={})
    services = plan(config, "/models/smollm2", "/etc/turnstream.toml")
    names = [s.name for s in services]
    assert names == [
        "engine",
        "teacher-engine",
        "proxy",
        "pairer",
        "judge",
        "teacher",
        "dispatcher",
        "trainer",
        "eval",
        "console",
    ]
    assert [s.stage for s in services] == [0, 0, 1, 2, 2, 2, 2, 2, 2, 2]
    ports = [s.port for s in services]
    assert (
        len(set(ports)) == len(ports)
        and ports[:3] == [30000, 30002, 8000]
        and ports[3:8] == list(range(9101, 9106))
        and ports[8] == 9107  # after simulate's
        and ports[9] == 8080
    )
    by = {s.name: s for s in services}
    for s in services:
        assert s.args[:2] == ["--config", "/etc/turnstream.toml"]  # every service reads the same config file
        if "--host" in s.args:
            assert s.args[s.args.index("--host") + 1] == "127.0.0.1"
    assert "--host" in by["engine"].args and "--host" in by["proxy"].args
    assert by["proxy"].args[-2:] == ["--engine-url", "http://127.0.0.1:30000"]
    assert by["teacher"].args[-2:] == [
        "--engine-url",
        "http://127.0.0.1:30002",
    ]  # fixed weights, never reloaded
    assert by["judge"].args[-2:] == ["--backend", "rules"]
    assert by["trainer"].args[-2:] == ["--hf-checkpoint", "/models/smollm2"]
    assert by["eval"].args[-2:] == ["--engine-url", "http://127.0.0.1:30000"]  # the engine, not the proxy
    assert by["dispatcher"].env == {"TURNSTREAM_METRICS_PORT": "9104"}
    assert (
        by["trainer"].stop_timeout_s == 180 and by["dispatcher"].stop_timeout_s == 30
    )  # a step + a checkpoint
    assert by["engine"].ready_path == "/health" and by["proxy"].ready_path == "/healthz"
    assert by["console"].args[-4:] == ["--host", "127.0.0.1", "--port", "8080"]
    assert by["console"].env == {
        "TURNSTREAM_CONSOLE_TOKENIZER": "/models/smollm2"
    }  # token texts of the policy
    assert by["console"].ready_path == "/healthz"


def test_engine_judge_and_ports_follow_the_configuration() -> None:
    config = load_config(
        env={
            "TURNSTREAM_RUN_JUDGE_BACKEND": "engine",
            "TURNSTREAM_RUN_ENGINE_PORT": "31000",
            "TURNSTREAM_RUN_METRICS_PORT_BASE": "9500",
            "TURNSTREAM_PROXY_PORT": "8100",
            "TURNSTREAM_CONSOLE_PORT": "8181",
        }
    )
    by = {s.name: s for s in plan(config, "/m")}
    assert by["console"].port == 8181 and by["console"].args[-1] == "8181"
    assert "console" not in {s.name for s in plan(load_config(env={"TURNSTREAM_RUN_CONSOLE": "0"}), "/m")}
    assert by["judge"].args == ["judge", "--backend", "engine", "--engine-url", "http://127.0.0.1:30002"]
    assert by["proxy"].args[-1] == "http://127.0.0.1:31000" and by["proxy"].port == 8100
    assert by["trainer"].port == 9504 and by["engine"].args[0] == "engine"


def test_rl_runs_no_teacher_worker() -> None:
    from runtime.configuration.config import load_config

    names = [s.name for s in plan(load_config(env={"TURNSTREAM_DISPATCHER_MODE": "rl"}), "/m")]
    assert "teacher" not in names and "teacher-engine" in names, "the engine still serves the judge"


def test_lora_runs_one_engine_for_the_policy_the_judge_and_the_teacher() -> None:
    """With adapters the base model answers the judge and the teacher on the policy's engine: one SGLang fewer,
    and every service knows the versions are adapters."""
    from runtime.configuration.config import load_config

    config = load_config(
        env={"TURNSTREAM_TRAINER_LORA_ENABLED": "true", "TURNSTREAM_RUN_JUDGE_BACKEND": "engine"}
    )
    by = {s.name: s for s in plan(config, "/m")}
    assert "teacher-engine" not in by and by["engine"].args[-1] == "--lora"
    assert by["judge"].args[-1] == by["teacher"].args[-1] == by["proxy"].args[-1] == "http://127.0.0.1:30000"
    assert all(s.env.get("TURNSTREAM_TRAINER_LORA_ENABLED") == "true" for s in by.values())
    merged = load_config(
        env={"TURNSTREAM_TRAINER_LORA_ENABLED": "1", "TURNSTREAM_TRAINER_LORA_PUBLISH": "merged"}
    )
    assert "teacher-engine" in {s.name for s in plan(merged, "/m")}, "merged weights: served as full weights"


def test_every_engine_takes_keys_and_only_the_proxy_holds_the_admin_key() -> None:
    """Issue 32, item 3: both SGLang servers started without keys, so any local user could load weights from any
    path or pause generation. With the run's keys, each engine gets both, every client of theirs the API key, and
    the admin key (weight updates, pauses, adapters) reaches only the engines and the proxy's reloader."""
    config = load_config(
        env={"TURNSTREAM_ENGINE_API_KEY": "a" * 32, "TURNSTREAM_ENGINE_ADMIN_API_KEY": "b" * 32}
    )
    by = {s.name: s for s in plan(config, "/m")}
    for name, service in by.items():
        configured = load_config(env=service.env)  # what the service reads from its environment
        holds_admin = name in ("engine", "teacher-engine", "proxy")
        assert configured.engine.admin_api_key == ("b" * 32 if holds_admin else None), name
        assert configured.engine.api_key == configured.judge.api_key == configured.teacher.api_key == "a" * 32


def test_a_gate_runs_beside_the_eval_when_enabled() -> None:
    """``gate.enabled``: the gate service decides promotions from the evaluations; off, none runs."""
    assert "gate" not in {s.name for s in plan(load_config(env={}), "/m")}
    config = load_config(
        env={"TURNSTREAM_GATE_ENABLED": "true", "TURNSTREAM_GATE_MECHANISM": "serve-then-check"}
    )
    by = {s.name: s for s in plan(config, "/m")}
    gate = by["gate"]
    assert gate.args[-1] == "gate" and gate.stage == 2 and gate.port == 9108
    assert len({s.port for s in by.values()}) == len(by)


def test_a_trainer_folder_of_ones_own_is_where_the_proxy_loads_versions_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative ``trainer.output_dir`` once left the proxy refusing every version (outside its default weights
    root, dead-lettered) while the trainer announced paths no engine could resolve: nothing was ever served."""
    from services.proxy.reloader import inside

    monkeypatch.chdir(tmp_path)
    config = load_config(env={"TURNSTREAM_TRAINER_OUTPUT_DIR": "runs/a/weights"})
    by = {s.name: s for s in plan(config, "/m")}
    weights = tmp_path / "runs/a/weights"
    for name in ("proxy", "trainer"):
        assert by[name].env["TURNSTREAM_TRAINER_OUTPUT_DIR"] == str(weights), name
    root = by["proxy"].env["TURNSTREAM_PROXY_WEIGHTS_ROOT"]
    assert inside(Path(root), str(weights / "versions" / "v1"))
    # A root the user chose stays theirs.
    config = load_config(
        env={"TURNSTREAM_TRAINER_OUTPUT_DIR": "w", "TURNSTREAM_PROXY_WEIGHTS_ROOT": "/srv/w"}
    )
    assert "TURNSTREAM_PROXY_WEIGHTS_ROOT" not in plan(config, "/m")[2].env


def test_policy_replicas_each_get_a_server_and_the_proxy_routes_between_them() -> None:
    config = load_config(env={"TURNSTREAM_RUN_POLICY_REPLICAS": "2"})
    services = plan(config, "/m")
    by = {s.name: s for s in services}
    assert [s.name for s in services][:3] == ["engine", "engine-1", "teacher-engine"]
    assert by["engine-1"].port == 30100 and by["engine-1"].stage == 0
    assert by["engine-1"].args[by["engine-1"].args.index("--served-model-name") + 1] == "policy"
    assert by["proxy"].args[-2:] == ["--engine-url", "http://127.0.0.1:30000,http://127.0.0.1:30100"]
    # the eval asks the first replica that answers (every one serves the version it checks)
    assert by["eval"].args[-2:] == ["--engine-url", "http://127.0.0.1:30000,http://127.0.0.1:30100"]
    from services.eval.command import with_engines

    evaluated = with_engines(config, "http://a:1,http://b:2")
    assert evaluated.engine.urls == ["http://a:1", "http://b:2"] and evaluated.eval.engine_url == ""
    assert with_engines(config, "http://a:1").eval.engine_url == "http://a:1"
    assert with_engines(config, None) == config
    from services.proxy.command import engines

    both = engines(config.engine, "http://a:1, http://b:2")
    assert both.urls == ["http://a:1", "http://b:2"] and both.url == "http://a:1"
    assert engines(config.engine, "http://a:1").urls == ["http://a:1"]
    assert engines(config.engine, None) == config.engine


def test_the_preflight_names_a_port_in_use_and_the_defaults_avoid_the_ephemeral_range() -> None:
    import socket

    from runtime.process.ports import ephemeral_low, free_port
    from services.run.preflight import busy, ephemeral

    assert ephemeral(plan(load_config(env={}), "/m")) == []
    port, high = free_port(), min(ephemeral_low() + 7, 65535)
    config = load_config(env={"TURNSTREAM_PROXY_PORT": str(port), "TURNSTREAM_RUN_ENGINE_PORT": str(high)})
    services = [s for s in plan(config, "/m") if s.name in ("proxy", "engine")]
    assert ephemeral(services) == [f"engine ({high})"]
    proxy = [s for s in services if s.name == "proxy"]  # the ephemeral one may be anybody's source port now
    assert busy(proxy) == []
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert busy(proxy) == [f"proxy ({port})"]
