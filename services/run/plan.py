"""What ``turnstream run`` starts, in which order, on which ports: a pure function of the configuration, so the
layout can be checked without starting anything. Every process binds to loopback."""

from __future__ import annotations

from pathlib import Path

from runtime.configuration.config import Config
from runtime.process.supervisor import Service
from schemas.modes import mode_spec

METRICS_SERVICES = ("pairer", "judge", "teacher", "dispatcher", "trainer", "simulate", "eval", "gate")
"""The workers whose /metrics ports are ``run.metrics_port_base`` and the ports after it, in this order."""


def plan(
    config: Config, model: str, config_path: str | None = None, run_dir: str | None = None
) -> list[Service]:
    """The pipeline on one machine: two engines (policy, and a fixed judge/teacher one; ``run.policy_replicas``
    policy servers behind the proxy's routing), then the proxy and the workers. ``model`` is the policy's Hugging
    Face folder (also the teacher's fixed weights and the trainer's start). With LoRA adapters
    (``Config.lora_adapters``) one engine serves both: the policy is the base plus the current adapter, the judge
    and the teacher ask the base (no adapter named)."""
    rc = config.run
    base = ["--config", config_path] if config_path else []
    one_engine = config.lora_adapters
    engine_url = f"http://127.0.0.1:{rc.engine_port}"
    ports = [rc.engine_port + 100 * i for i in range(rc.policy_replicas)]
    policy_urls = ",".join(f"http://127.0.0.1:{port}" for port in ports)
    teacher_url = engine_url if one_engine else f"http://127.0.0.1:{rc.teacher_engine_port}"
    # What `--lora` set on the command line reaches every service (the file, when there is one, they read too).
    shared = {"TURNSTREAM_TRAINER_LORA_ENABLED": "true"} if config.trainer.lora.enabled else {}
    if config.trainer.output_dir and not config.proxy.weights_root:
        # The trainer's folder, absolute (the engines load the path it announces, from their own working
        # directory), is where the proxy's reloader loads from: anywhere else it refuses every version.
        weights = str(Path(config.trainer.output_dir).resolve())
        shared |= {"TURNSTREAM_TRAINER_OUTPUT_DIR": weights, "TURNSTREAM_PROXY_WEIGHTS_ROOT": weights}
    if config.proxy.api_key:  # the proxy checks it and the simulated users send it
        shared["TURNSTREAM_PROXY_API_KEY"] = config.proxy.api_key
    if config.engine.api_key:  # both engines take it; every client of theirs sends it
        for section in ("ENGINE", "JUDGE", "TEACHER"):
            shared[f"TURNSTREAM_{section}_API_KEY"] = config.engine.api_key
    # The admin key (weight updates, pauses, adapters) only for the engines, which check it, and the proxy, whose
    # reloader sends it.
    admin = (
        {"TURNSTREAM_ENGINE_ADMIN_API_KEY": config.engine.admin_api_key}
        if config.engine.admin_api_key
        else {}
    )
    metrics = {name: rc.metrics_port_base + i for i, name in enumerate(METRICS_SERVICES)}

    def engine(name: str, port: int, served: str) -> Service:
        args = [
            "engine",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            served,
        ]
        return Service(
            name, base + args + (["--lora"] if one_engine else []), {**shared, **admin}, port, "/health", 0
        )

    def worker(name: str, args: list[str], stage: int = 2, stop_timeout_s: float = 30.0) -> Service:
        port = metrics[name]
        env = {**shared, "TURNSTREAM_METRICS_PORT": str(port)}
        return Service(name, base + args, env, port, "/metrics", stage, stop_timeout_s)

    judge_args = ["judge", "--backend", rc.judge_backend]
    if rc.judge_backend == "engine":
        judge_args += ["--engine-url", teacher_url]
    services = [
        engine("engine", rc.engine_port, "policy"),
        *(engine(f"engine-{i}", port, "policy") for i, port in enumerate(ports[1:], 1)),
        *([] if one_engine else [engine("teacher-engine", rc.teacher_engine_port, "teacher")]),
        Service(
            "proxy",
            [*base, "proxy", "--host", "127.0.0.1", "--engine-url", policy_urls],
            {**shared, **admin},
            config.proxy.port,
            "/healthz",
            1,
        ),
        worker("pairer", ["pairer"]),
        worker("judge", judge_args),
        worker("dispatcher", ["dispatcher"]),
        # A clean stop finishes the step in progress and writes a full checkpoint: ~30 s on this CPU.
        worker("trainer", ["trainer", "--hf-checkpoint", model], stop_timeout_s=180.0),
        worker("eval", ["eval", "--engine-url", policy_urls]),  # the policy engines directly, never the proxy
    ]
    if mode_spec(config.dispatcher.mode).needs_hint:  # rl scores no hints: no teacher worker
        services.insert(-3, worker("teacher", ["teacher", "--engine-url", teacher_url]))
    if config.gate.enabled:  # promotions decided from the evaluations (docs/evaluation.md)
        services.append(worker("gate", ["gate"]))
    if rc.console:  # its tokenizer is the policy's, for the heat map's token texts
        env = {**shared, "TURNSTREAM_CONSOLE_TOKENIZER": model}
        args = [*base, "console", "--host", "127.0.0.1", "--port", str(config.console.port)]
        services.append(Service("console", args, env, config.console.port, "/healthz", 2))
    if rc.simulate:  # after everything else is up: users arrive once the pipeline can learn from them
        proxy_url = f"http://127.0.0.1:{config.proxy.port}/v1"
        out = str(Path(run_dir or ".") / "simulation")
        args = ["simulate", "--users", str(rc.simulate), "--proxy-url", proxy_url, "--out", out]
        services.append(worker("simulate", args, stage=3))
    return services
