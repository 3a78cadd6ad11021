"""compose.yaml for a GPU host, checked the way `docker compose config` checks it (scripts/compose-config.sh:
the compose plugin where installed, else compose-go, the loader it is built on), and against turnstream itself:
every service command parses with turnstream's CLI, every TURNSTREAM_* setting is a real, valid config field,
GPUs and model paths come from the environment, judges scale and a second judge group can be attached."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runtime.configuration.config import load_config
from runtime.security import kafka_users
from runtime.security.redis_users import NAMES
from runtime.security.tokens import console_login_url
from runtime.transport.redis_urls import sentinel_target
from services.cli import _parser

REPO = Path(__file__).resolve().parent.parent
OURS = ("topics", "proxy", "pairer", "judge", "teacher", "dispatcher", "trainer", "eval", "gate", "console")
REDIS_USERS = NAMES


def resolve(*files: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("POLICY_", "TRAINER_", "COMPOSE_"))}
    # what scripts/compose-secrets.sh writes to .env
    secrets = {
        "GRAFANA_ADMIN_PASSWORD": "test-password",
        "PROXY_API_KEY": "test-proxy-key-0123456789",
        "ENGINE_API_KEY": "test-engine-key-0123456789",
        "ENGINE_ADMIN_API_KEY": "test-engine-admin-key-0123456789",
        **{f"REDIS_PASSWORD_{u.upper()}": f"test-redis-{u}" for u in REDIS_USERS},
        **{f"KAFKA_PASSWORD_{u.upper()}": f"test-kafka-{u}" for u in (*kafka_users.NAMES, "controller")},
    }
    return subprocess.run(
        ["bash", "scripts/compose-config.sh", *files],
        cwd=REPO,
        env={**secrets, **clean, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def default() -> dict[str, Any]:
    out = resolve()
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def gpus(service: dict[str, Any]) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    return list(devices[0]["device_ids"])


def test_the_services_the_issue_names_with_health_checks_and_restart_policies(
    default: dict[str, Any],
) -> None:
    services = default["services"]
    assert set(services) == {
        "kafka",
        "redis",
        "sglang-policy",
        "sglang-teacher",
        "prometheus",
        "grafana",
        "redis-users",
        "kafka-format",
        *OURS,
    }
    for name, s in services.items():
        if name in (
            "topics",
            "redis-users",
            "kafka-format",
        ):  # one-shot jobs: each does its part, exits, the others wait for it
            assert s["restart"] == "on-failure" and s.get("healthcheck", {"disable": True})["disable"]
            continue
        assert s["restart"] == "unless-stopped", name
        assert s["healthcheck"]["test"], name
    kafka_version = re.search(
        r"<kafka.version>(.+)</kafka.version>", (REPO / "scripts/kafka/pom.xml").read_text()
    )
    assert kafka_version and services["kafka"]["image"] == f"apache/kafka:{kafka_version.group(1)}"
    assert (
        "KRaft" not in services["kafka"]["environment"]
        and services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    )
    assert services["proxy"]["depends_on"]["sglang-policy"]["condition"] == "service_healthy"
    assert services["pairer"]["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_gpus_and_models_come_from_the_environment(default: dict[str, Any]) -> None:
    s = default["services"]
    assert (
        gpus(s["sglang-policy"]) == ["0"]
        and gpus(s["sglang-teacher"]) == ["1"]
        and gpus(s["trainer"]) == ["2"]
    )
    out = resolve(
        POLICY_MODEL="/models/Qwen3-8B",
        TEACHER_MODEL="/models/Qwen3-32B",
        POLICY_GPUS="4",
        TEACHER_GPUS="5,6",
        TRAINER_GPUS="0,1,2,3",
        TRAINER_NPROC="4",
        TRAINER_TP="2",
        MODELS_DIR="/data/models",
    )
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)["services"]
    assert gpus(s["sglang-policy"]) == ["4"] and gpus(s["sglang-teacher"]) == ["5,6"]
    assert gpus(s["trainer"]) == ["0,1,2,3"]
    assert "--model-path /models/Qwen3-8B" in shlex.join(s["sglang-policy"]["command"])
    assert "--model-path /models/Qwen3-32B" in shlex.join(s["sglang-teacher"]["command"])
    assert s["trainer"]["command"][-1] == "/models/Qwen3-8B"
    assert s["trainer"]["entrypoint"][:5] == ["torchrun", "--standalone", "--nproc-per-node", "4", "-m"]
    assert s["trainer"]["environment"]["TURNSTREAM_TRAINER_TENSOR_PARALLEL"] == "2"
    assert s["teacher"]["environment"]["TURNSTREAM_TEACHER_TOKENIZER"] == "/models/Qwen3-32B"
    assert any(v["source"] == "/data/models" and v["target"] == "/models" for v in s["proxy"]["volumes"])


def test_weight_versions_travel_through_one_shared_volume(default: dict[str, Any]) -> None:
    s = default["services"]

    def weights(name: str) -> dict[str, Any]:
        return next(v for v in s[name]["volumes"] if v["source"] == "weights")

    assert weights("trainer")["target"] == "/weights" and not weights("trainer").get("read_only")
    assert weights("sglang-policy")["read_only"] and weights("proxy")["read_only"]
    assert s["trainer"]["environment"]["TURNSTREAM_TRAINER_OUTPUT_DIR"] == "/weights"
    assert (
        s["proxy"]["environment"]["TURNSTREAM_PROXY_WEIGHTS_ROOT"] == "/weights"
    )  # the reloader's allowed root


def test_judges_scale_and_a_second_judge_group_attaches(default: dict[str, Any]) -> None:
    judge = default["services"]["judge"]
    assert "container_name" not in judge and not judge.get("ports"), (
        "a fixed name or port would block --scale"
    )
    assert "judge-alt" not in default["services"]  # only with its profile
    out = resolve(COMPOSE_PROFILES="judge-alt", ALT_JUDGE_ID="strict", ALT_JUDGE_PROMPTS="/models/prompts")
    assert out.returncode == 0, out.stderr
    alt = json.loads(out.stdout)["services"]["judge-alt"]
    assert alt["environment"]["TURNSTREAM_JUDGE_JUDGE_ID"] == "strict"
    assert alt["environment"]["TURNSTREAM_JUDGE_PROMPTS_DIR"] == "/models/prompts"
    assert (
        load_config(env={k: v for k, v in alt["environment"].items() if v is not None}).judge.group_id
        == "turnstream-judge-strict"
    )  # a group of its own


def test_every_service_runs_a_real_command_with_a_valid_configuration(default: dict[str, Any]) -> None:
    """What compose starts is what turnstream accepts: the command parses, the environment validates."""
    out = resolve(COMPOSE_PROFILES="judge-alt")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    for name in (*OURS, "judge-alt"):
        s = services[name]
        entry = s.get("entrypoint") or ["python", "-m", "services.cli"]
        if entry == ["sh", "-c"]:  # topics: the Kafka users, then the topics, as the operator
            steps = [shlex.split(c.strip()) for c in s["command"][0].split("&&")]
            assert [step[:3] for step in steps] == [
                ["python", "-m", "services.cli"],
                ["exec", "python", "-m"],
            ]
            parsed = [_parser().parse_args(step[step.index("services.cli") + 1 :]) for step in steps]
            assert [(a.command, a.action) for a in parsed] == [("kafka-users", "apply"), ("topics", "create")]
        else:
            assert entry[-2:] == ["-m", "services.cli"], name
            assert _parser().parse_args(s["command"]).command == ("judge" if name == "judge-alt" else name)
        assert name != "gate" or _parser().parse_args(s["command"]).standby, (
            "the gate off stands by, no restarts"
        )
        env = {k: v for k, v in s["environment"].items() if v is not None}
        config = load_config(env=env)  # raises on an unknown or invalid TURNSTREAM_* setting
        user = "judge" if name == "judge-alt" else name  # each service logs in to Redis as its own user
        assert config.kafka.bootstrap == "kafka:9092"
        kafka_user = "admin" if name == "topics" else user  # and to Kafka (SCRAM), with ACLs of its own
        assert (config.kafka.security_protocol, config.kafka.sasl_mechanism) == (
            "SASL_PLAINTEXT",
            "SCRAM-SHA-512",
        )
        assert (config.kafka.sasl_username, config.kafka.sasl_password) == (
            kafka_user,
            f"test-kafka-{kafka_user}",
        )
        assert config.redis.url == f"redis://{user}:test-redis-{user}@redis:6379/0", name
    assert load_config(env=services["dispatcher"]["environment"]).dispatcher.mode == "combine"
    # the held-out evaluation asks the policy server itself: through the proxy it would become training traffic
    assert load_config(env=services["eval"]["environment"]).eval.engine_url == "http://sglang-policy:30000"
    for name in OURS:
        env = {k: v for k, v in services[name]["environment"].items() if v is not None}
        assert load_config(env=env).metrics.host == "0.0.0.0", f"{name}: a Prometheus elsewhere can scrape it"
    trainer_env = {k: v for k, v in services["trainer"]["environment"].items() if v is not None}
    assert load_config(env=trainer_env).trainer.precision == "bf16", "no GPU: the trainer fails at start"


def test_every_service_knows_the_mode_and_the_judge_takes_its_votes_from_it() -> None:
    out = resolve(TURNSTREAM_MODE="rl")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    configs = {
        name: load_config(env={k: v for k, v in services[name]["environment"].items() if v is not None})
        for name in OURS
    }
    assert {name: c.dispatcher.mode for name, c in configs.items()} == dict.fromkeys(OURS, "rl")
    assert configs["judge"].judge.m == 3, "rl's PRM_M, OpenClaw's, when the host sets none"
    assert (
        json.loads(resolve(TURNSTREAM_MODE="rl", PRM_M="2").stdout)["services"]["judge"]["environment"][
            "PRM_M"
        ]
        == "2"
    )


def test_sglang_is_pinned_to_the_tested_version_with_raw_logprobs_and_parsers() -> None:
    from services.engine.launch import SGLANG_VERSION

    assert (REPO / "scripts" / "sglang" / "version").read_text().strip() == SGLANG_VERSION
    out = resolve(POLICY_GPUS="0,1", POLICY_TP="2")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    for name in ("sglang-policy", "sglang-teacher"):
        s = services[name]
        assert s["image"].startswith(f"lmsysorg/sglang:v{SGLANG_VERSION}"), s["image"]
        assert s["environment"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
        command = " ".join(s["command"])
        assert (
            "--tool-call-parser qwen " in command and "--reasoning-parser" not in command
        )  # only when asked
        assert "--weight-version 0" in command and "--enable-metrics" in command
    for files in (("compose.yaml",), ("compose.yaml", "compose.one-gpu.yaml")):
        asked = json.loads(resolve(*files, REASONING_PARSER="qwen3").stdout)["services"]["sglang-policy"]
        assert " --reasoning-parser qwen3 " in " ".join(asked["command"]), files
    policy = services["sglang-policy"]
    assert "--tp 2" in " ".join(policy["command"])
    assert policy["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0,1"]


def test_the_dockerfile_copies_what_exists_and_runs_the_cli() -> None:
    text = (REPO / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in source.split():
            assert (REPO / path).exists(), path
    assert 'ENTRYPOINT ["python", "-m", "services.cli"]' in text
    assert "uv pip sync" in text


def dockerfile_stage(name: str) -> str:
    """One stage of the Dockerfile, from its FROM line to the next."""
    text = (REPO / "Dockerfile").read_text()
    match = re.search(rf"^FROM .* AS {name}\n(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    assert match, name
    return match.group(1)


def _pins(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", path.read_text(), re.M))


def test_the_runtime_image_installs_the_services_dependencies_and_no_dev_tools() -> None:
    """requirements-runtime.lock is requirements.lock without the dev extras, at the same versions (what the
    suite tests is what the image runs), and it is what the Dockerfile's runtime stage installs."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime, full = _pins(REPO / "requirements-runtime.lock"), _pins(REPO / "requirements.lock")
    drifted = {name: (v, full.get(name)) for name, v in runtime.items() if full.get(name) != v}
    assert not drifted, f"regenerate with the command at the top of requirements-runtime.lock: {drifted}"
    for dep in project["dependencies"]:
        name, version = dep.split("==")
        assert runtime.get(name) == version, dep
    for dep in project["optional-dependencies"]["dev"]:
        name = dep.split("==")[0]
        assert name not in runtime, f"{name} is a dev tool: not in the runtime image"
    stage = dockerfile_stage("runtime")
    assert "uv pip sync --system --no-cache requirements-runtime.lock" in stage
    steps = [line for line in stage.splitlines() if line.startswith(("COPY", "RUN"))]
    assert not any("requirements.lock" in line for line in steps), "the dev lock stays out of the image"


def test_an_invalid_compose_file_is_rejected(tmp_path: Path) -> None:
    """The check really validates: a misspelled key and a wrong type fail with the loader's reason."""
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  proxy:\n    image: x\n    restartt: always\n")
    out = resolve(str(bad))
    assert out.returncode != 0 and "restartt" in out.stderr
    bad.write_text("services:\n  proxy:\n    image: x\n    ports: 8000\n")
    out = resolve(str(bad))
    assert out.returncode != 0 and "ports" in out.stderr


def _metrics_port(name: str, service: dict[str, Any]) -> int:
    """Where a compose service serves /metrics: turnstream's workers on TURNSTREAM_METRICS_PORT, the proxy on its
    own HTTP port, SGLang (with --enable-metrics) on its serving port."""
    if name.startswith("sglang-"):
        command = " ".join(service["command"]) if isinstance(service["command"], list) else service["command"]
        assert "--enable-metrics" in command, name
        return int(re.search(r"--port (\d+)", command).group(1))  # type: ignore[union-attr]
    config = load_config(env={k: v for k, v in service["environment"].items() if v is not None})
    assert config.metrics.host == "0.0.0.0", name
    if (
        name == "console"
    ):  # its pages' port needs the console's token: /metrics on metrics.port for Prometheus
        assert config.console.host == "0.0.0.0"
    assert config.metrics.port is not None, name
    return config.metrics.port


def test_every_prometheus_target_is_a_compose_service_serving_metrics_there(default: dict[str, Any]) -> None:
    import yaml

    services = default["services"]
    prometheus = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    targets: set[tuple[str, int]] = set()
    for job in prometheus["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets.add((host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            targets |= {(name, int(dns["port"])) for name in dns["names"]}
    scaled = json.loads(resolve("compose.yaml", "compose.replicas.yaml", "compose.ha.yaml").stdout)[
        "services"
    ]
    for host, port in targets:
        assert host in scaled, f"{host}: no such compose service"
        assert _metrics_port(host, scaled[host]) == port, host
    scraped = {host for host, _ in targets}
    # every long-running turnstream service and every engine (topics is a one-shot job; judge-alt a profile), the
    # second policy server (compose.replicas.yaml) by DNS, so compose.yaml alone has no target down
    assert scraped == {*OURS, "sglang-policy", "sglang-teacher", "sglang-policy-2"} - {"topics"}
    assert "sglang-policy-2" not in services
    by_dns = {
        n for job in prometheus["scrape_configs"] for d in job.get("dns_sd_configs", []) for n in d["names"]
    }
    assert "sglang-policy-2" in by_dns
    assert services["prometheus"]["volumes"][0]["source"].endswith("deploy/prometheus/prometheus.yml")
    mounted = {v["target"] for v in services["grafana"]["volumes"]}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= mounted


def test_the_dashboard_queries_only_metrics_that_exist() -> None:
    """Every metric a Grafana panel reads is one a turnstream service registers (imported here, read from the
    registry) or one SGLang 0.5.23 exports (its metrics collector's source): a renamed metric fails here, not as
    an empty panel on someone's GPU host."""
    import importlib
    import pkgutil

    from prometheus_client import REGISTRY

    import services

    for module in pkgutil.walk_packages(services.__path__, "services."):
        if module.name.endswith(("worker", "app", "recorder", "driver", "progress")):
            importlib.import_module(module.name)
    ours = {sample for metric in REGISTRY.collect() for sample in (metric.name, metric.name + "_total")}
    sglang_source = (
        REPO / ".venv-sglang/lib/python3.11/site-packages/sglang/srt/observability/metrics_collector.py"
    )
    theirs = (
        set(re.findall(r'name="(sglang:[a-z_]+)"', sglang_source.read_text()))
        if sglang_source.exists()
        else set()
    )
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/turnstream.json").read_text())
    datasource = yaml_load(REPO / "deploy/grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        for target in panel["targets"]:
            used |= set(re.findall(r"\b((?:turnstream_|sglang:)[a-z_:]+)", target["expr"]))
    assert used, "the dashboard queries something"
    missing = {m for m in used if m.startswith("turnstream_") and m not in ours}
    assert not missing, missing
    assert {m for m in used if m.startswith("sglang:")} <= theirs and theirs
    assert {
        "turnstream_eval_score",
        "turnstream_trainer_version",
        "turnstream_dispatcher_samples_total",
    } <= used


def yaml_load(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def test_the_one_gpu_layout_serves_policy_judge_and_teacher_from_one_lora_engine() -> None:
    """compose.one-gpu.yaml over compose.yaml: no judge/teacher server, its users on the policy server, which serves
    adapters of the trainer's rank and targets; everything on GPU 0 (that the shares fit: the recipes' test)."""
    out = resolve("compose.yaml", "compose.one-gpu.yaml")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)["services"]
    assert "sglang-teacher" not in s
    for name in ("judge", "teacher"):
        assert set(s[name]["depends_on"]) == {"topics", "redis", "sglang-policy"}
    assert s["judge"]["environment"]["TURNSTREAM_JUDGE_ENGINE_URL"] == "http://sglang-policy:30000"
    assert s["teacher"]["environment"]["TURNSTREAM_TEACHER_ENGINE_URL"] == "http://sglang-policy:30000"
    assert gpus(s["sglang-policy"]) == gpus(s["trainer"]) == ["0"]
    assert s["trainer"]["depends_on"]["sglang-policy"]["condition"] == "service_healthy"
    configs = {
        name: load_config(
            env={k: v for k, v in s[name]["environment"].items() if k.startswith("TURNSTREAM_")}
        )
        for name in ("proxy", "eval", "trainer")
    }
    assert all(c.lora_adapters for c in configs.values()), "every service that meets a version knows it"
    lora = configs["trainer"].trainer.lora
    cmd = s["sglang-policy"]["command"]
    at = cmd.index("--lora-target-modules")
    assert cmd[cmd.index("--max-lora-rank") + 1] == str(lora.rank) and "--enable-lora" in cmd
    assert cmd[at + 1 : at + 1 + len(lora.target_modules)] == lora.target_modules
    assert s["trainer"]["environment"]["TURNSTREAM_TRAINER_RECOMPUTE"] == "full"


def test_one_setting_guards_learning_for_the_gate_the_proxy_and_the_trainer() -> None:
    """GATE_ENABLED alone: the gate decides, the proxy's reloader serves what it promotes and the trainer
    restores, with the mechanism each layout can run (full weights: serve-then-check; one GPU, LoRA: adapter)."""
    for files, mechanism in (
        (("compose.yaml",), "serve-then-check"),
        (("compose.yaml", "compose.one-gpu.yaml"), "adapter"),
    ):
        for enabled in ("true", "false"):
            out = resolve(*files, GATE_ENABLED=enabled, GATE_MARGIN="0.02")
            assert out.returncode == 0, out.stderr
            s = json.loads(out.stdout)["services"]
            for name in ("gate", "proxy", "trainer", "eval"):
                env = {k: v for k, v in s[name]["environment"].items() if v is not None}
                gate = load_config(
                    env=env
                ).gate  # validates: adapter needs LoRA, which the one-GPU layout has
                assert gate.enabled == (enabled == "true") and gate.margin == 0.02, (files, name)
                if name in ("gate", "proxy"):
                    assert gate.mechanism == mechanism, (files, name)


H200_GIB = 139.0
"""An H200's memory as torch reports it (141 GB on the box)."""
SGLANG_OVERHEAD_GIB = 8.0
"""What an SGLang server takes beyond ``--mem-fraction-static`` (weights and KV cache): its CUDA context, CUDA
graphs, a prefill chunk's activations."""
RECIPES = sorted((REPO / "deploy" / "recipes").glob("*.env"))


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (
        line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")
    )
    return {k.strip(): v.strip() for k, v in pairs}


def image_has_transformer_engine(target: str) -> bool:
    """Whether the Dockerfile's ``target`` installs Transformer Engine: the runtime image syncs
    requirements-runtime.lock, which must not name it; only the te stage adds it."""
    runtime = dockerfile_stage("runtime")
    assert "requirements-runtime.lock" in runtime
    lock = (REPO / "requirements-runtime.lock").read_text()
    assert "transformer-engine" not in lock and "transformer_engine" not in lock
    assert "transformer-engine==2.11.0" in dockerfile_stage("te"), "the te target adds it"
    return target == "te"


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"one-gpu-lora.env", "one-gpu-full.env", "eight-gpu.env"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_fits_its_gpus_with_the_image_and_settings_compose_gives_it(recipe: Path) -> None:
    """Each deploy/recipes file, resolved as compose resolves it, planned as the trainer in that container plans
    (recompute and attention resolved for CUDA and the image's Transformer Engine or not), fits its cap; and on
    every GPU the SGLang servers' shares plus the trainer's cap fit an H200."""
    from services.trainer.memory import GIB, for_trainer, plan, resolve_layer_spec, resolve_recompute
    from services.trainer.spec import ModelSpec

    env = read_env_file(recipe)
    files = env.pop("COMPOSE_FILE", "compose.yaml").split(":")
    out = resolve(*files, **env)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    trainer = services["trainer"]
    tc = load_config(env={k: v for k, v in trainer["environment"].items() if v is not None}).trainer
    nproc = int(trainer["entrypoint"][trainer["entrypoint"].index("--nproc-per-node") + 1])
    trainer_gpus = gpus(trainer)[0].split(",")
    assert len(trainer_gpus) == nproc, "one torchrun process per GPU given"
    te = image_has_transformer_engine(env.get("TURNSTREAM_BUILD_TARGET", "runtime"))
    tp, pp = tc.tensor_parallel, tc.pipeline_parallel
    lay = for_trainer(
        tc,
        tp=tp,
        pp=pp,
        dp=nproc // (tp * pp),
        dtype_bytes=2,
        recompute=resolve_recompute(tc.recompute, cuda=True),
        attention=resolve_layer_spec(tc.layer_spec, te_usable=te),
    )
    # agents' turns: a 32k-token sample on the LoRA recipe, 16k on full fine-tuning, counted by the plan
    assert tc.max_sample_tokens >= (32768 if tc.lora.enabled else 16384), recipe.name
    assert lay.max_sample_tokens == tc.max_sample_tokens
    spec = ModelSpec.from_dir(
        REPO / "tests/services/trainer/configs" / Path(env["POLICY_MODEL"]).name.lower()
    )
    planned = plan(spec, lay).total / GIB
    cap = tc.gpu_memory_gib or H200_GIB
    assert planned <= cap, f"{recipe.name}: the trainer plans {planned:.1f} GiB, over its {cap:.0f} GiB"
    servers = {name: Server.of(s, spec) for name, s in services.items() if name.startswith("sglang-")}
    shared = any(g in s.gpus for s in servers.values() for g in trainer_gpus)
    assert tc.gpu_memory_gib or not shared, (
        "a trainer beside SGLang needs a cap: free memory depends on order"
    )
    after = set(trainer.get("depends_on", {}))
    for gpu in {g for s in servers.values() for g in s.gpus} | set(trainer_gpus):
        here = {n: s for n, s in servers.items() if gpu in s.gpus}
        holds = cap if gpu in trainer_gpus else 0.0
        if holds:
            assert set(here) <= after, f"{recipe.name}: the trainer races {set(here) - after} for GPU {gpu}"
        # compose starts the servers together, each measuring the GPU before any loaded its weights; the trainer
        # after them: every server fits, and the trainer finds its cap free
        first = starts_together(here, H200_GIB)
        assert H200_GIB - sum(first.values()) >= holds, f"{recipe.name}: GPU {gpu}: no room for the trainer"
        # a server restarted later, its neighbours holding what they hold: it still fits
        for name, server in here.items():
            free = H200_GIB - holds - sum(v for n, v in first.items() if n != name)
            server.start(free, free - server.weights_gib, f"{recipe.name}: {name} restarted on GPU {gpu}")


CUDA_CONTEXT_GIB = 1.0
"""What a process holds on a GPU before SGLang measures it (``bootstrap.measure_pre_model_load_memory`` runs after
the CUDA context and NCCL are up)."""


@dataclass(frozen=True)
class Server:
    """An SGLang 0.5.23 server's memory as it sizes it: at start it records the free memory F0, loads its weights,
    measures the free memory F1 and gives the KV cache ``F1 - F0 x (1 - mem_fraction_static)``
    (``kv_cache_configurator._profile_available_bytes``; none left: "Loaded weights leave no GPU memory for the
    KV cache"), capped at ``--max-total-tokens`` (``_apply_token_constraints``); beyond it, its CUDA graphs and
    activations (``SGLANG_OVERHEAD_GIB``)."""

    gpus: tuple[str, ...]
    fraction: float
    weights_gib: float
    kv_cap_gib: float | None

    @classmethod
    def of(cls, service: dict[str, Any], spec: Any) -> Server:
        from services.trainer.memory import GIB, total_params

        cmd = service["command"]
        tokens = int(cmd[cmd.index("--max-total-tokens") + 1]) if "--max-total-tokens" in cmd else None
        per_token = spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * 2  # k and v in bf16
        return cls(
            gpus=tuple(gpus(service)[0].split(",")),
            fraction=float(cmd[cmd.index("--mem-fraction-static") + 1]),
            weights_gib=total_params(spec) * 2 / GIB,
            kv_cap_gib=None if tokens is None else tokens * per_token / GIB,
        )

    def start(self, free: float, after_weights: float, what: str) -> float:
        """GiB the server holds once started, given the free memory before it and after every weight loaded
        meanwhile; fails as SGLang would."""
        f0 = free - CUDA_CONTEXT_GIB
        kv = after_weights - CUDA_CONTEXT_GIB - f0 * (1 - self.fraction)
        assert kv > 0, f"{what}: loaded weights leave no GPU memory for the KV cache ({kv:.1f} GiB)"
        if self.kv_cap_gib is not None:
            kv = min(kv, self.kv_cap_gib)
        held = CUDA_CONTEXT_GIB + self.weights_gib + kv + SGLANG_OVERHEAD_GIB
        assert held <= free, f"{what}: needs {held:.1f} GiB, {free:.1f} free"
        return held


def starts_together(servers: dict[str, Server], total: float) -> dict[str, float]:
    """Each server's GiB when they start at once on one GPU (compose starts them without an order)."""
    weights = sum(s.weights_gib + CUDA_CONTEXT_GIB for s in servers.values())
    held = {
        n: s.start(total, total - weights + CUDA_CONTEXT_GIB, f"{n} at start") for n, s in servers.items()
    }
    assert sum(held.values()) <= total, f"servers starting together need {sum(held.values()):.1f} GiB"
    return held


@pytest.mark.parametrize(
    ("layout", "cpu"),
    [
        ([], ["compose.cpu.yaml"]),
        (["compose.one-gpu.yaml"], ["compose.cpu.yaml"]),
        (["compose.replicas.yaml", "compose.ha.yaml"], ["compose.cpu.yaml", "compose.cpu.replicas.yaml"]),
    ],
    ids=["two-engines", "one-gpu", "replicas"],
)
def test_the_cpu_rehearsal_overlay_replaces_images_gpus_and_precision_and_nothing_else(
    layout: list[str], cpu: list[str]
) -> None:
    """What `make rehearse` runs is what ships: compose.cpu.yaml (and compose.cpu.replicas.yaml) may swap images
    (stand-ins), drop GPU reservations and set the trainer's precision (bf16 refuses a machine without a GPU);
    every other key of every service (commands, environment, volumes, users, health checks, dependencies) is the
    shipped files'. The images the rehearsal names in the environment reach the services that extend others."""
    images = {
        "KAFKA_IMAGE": "turnstream-rehearse/kafka:4.4.0",
        "REDIS_IMAGE": "turnstream-rehearse/redis:7",
        "SGLANG_IMAGE": "turnstream-rehearse/sglang:v0.5.23-cpu",
    }
    shipped = resolve("compose.yaml", *layout)
    rehearsed = resolve("compose.yaml", *layout, *cpu, **images)
    everywhere = json.loads(rehearsed.stdout)["services"]
    assert all(
        s["image"] in (*images.values(), "turnstream:latest", "turnstream-rehearse/prometheus:v3.5.0")
        for n, s in everywhere.items()
        if n != "grafana"
    ), {n: s["image"] for n, s in everywhere.items()}
    rehearsed = resolve("compose.yaml", *layout, *cpu)
    assert shipped.returncode == 0 and rehearsed.returncode == 0, shipped.stderr + rehearsed.stderr
    before, after = json.loads(shipped.stdout)["services"], json.loads(rehearsed.stdout)["services"]
    assert set(before) == set(after)
    allowed = {"image", "deploy"}
    for name, service in before.items():
        changed = {k for k in service.keys() | after[name].keys() if service.get(k) != after[name].get(k)}
        if name == "trainer":
            env_changed = {
                k
                for k in service["environment"].keys() | after[name]["environment"].keys()
                if service["environment"].get(k) != after[name]["environment"].get(k)
            }
            assert env_changed == {"TURNSTREAM_TRAINER_PRECISION"}
            assert after[name]["environment"]["TURNSTREAM_TRAINER_PRECISION"] == "fp32"
            changed -= {"environment"}
        assert changed <= allowed, f"{name}: {changed - allowed}"
        if name in OURS:
            assert after[name]["image"] == service["image"], "turnstream's own image is the real Dockerfile's"
        assert "deploy" not in after[name] or not after[name]["deploy"].get("resources")


def test_the_validator_loads_compose_files_as_the_rehearsed_docker_compose_does() -> None:
    """scripts/compose-check (CI, where no plugin is built) is the compose-go that Docker Compose v2.40.3, the
    rehearsal's plugin, is built on: a newer one resolved `!reset` through a YAML alias where compose did not."""
    plugin = (REPO / "scripts/rehearse/compose-plugin/go.mod").read_text()
    check = (REPO / "scripts/compose-check/go.mod").read_text()
    pattern = r"github.com/compose-spec/compose-go/v2 (v[0-9.]+)"
    assert re.search(pattern, check) and re.search(pattern, plugin)
    assert re.search(pattern, check).group(1) == re.search(pattern, plugin).group(1)  # type: ignore[union-attr]


def test_every_named_volume_a_service_writes_is_created_for_its_user_in_the_image(
    default: dict[str, Any],
) -> None:
    """A new named volume takes its owner from the image's mount point; one the image lacks is root's, and a
    service running as uid 10001 cannot write it (the console could not open its database at first contact)."""
    dockerfile = dockerfile_stage("runtime")
    made = re.search(r"mkdir -p ([^\n\\]+)", dockerfile)
    owned = re.search(r"chown turnstream ([^\n\\]+)", dockerfile)
    assert made and owned and "USER turnstream" in dockerfile
    for name in OURS:
        service = default["services"][name]
        if service.get("user") == "root":
            continue
        for volume in service.get("volumes", []):
            if volume["type"] == "volume" and not volume.get("read_only"):
                target = volume["target"]
                assert target in made.group(1).split() and target in owned.group(1).split(), (name, target)


def test_the_judge_backend_and_its_answer_length_come_from_the_host() -> None:
    """A judge model's context bounds its answers (SGLang refuses prompt + max_tokens over it: SmolLM2's 8,192 at
    combine's default 8,192), and a judge may be the rules or a plugin: both are the host's to set."""
    default = json.loads(resolve().stdout)["services"]["judge"]["environment"]
    config = load_config(env={k: v for k, v in default.items() if v is not None})
    assert config.judge.backend == "engine" and config.judge.max_tokens == 8192, "the mode's, as OpenClaw-RL"
    out = resolve(PRM_MAX_NEW_TOKENS="512", JUDGE_BACKEND="rules", COMPOSE_PROFILES="judge-alt")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    for name in ("judge", "judge-alt"):
        env = {k: v for k, v in services[name]["environment"].items() if v is not None}
        assert load_config(env=env).judge.max_tokens == 512, name
    judge = {k: v for k, v in services["judge"]["environment"].items() if v is not None}
    assert load_config(env=judge).judge.backend == "rules"


def test_the_host_driver_the_images_need_is_documented() -> None:
    """Both torch wheels (the services' and SGLang's) pin CUDA 13.0 in their metadata and SGLang's image is a
    -cu130 build: a CUDA 13.0 runtime needs driver R580 or newer, which the GPU-host docs must say."""
    import importlib.metadata

    requires = importlib.metadata.requires("torch") or []
    toolkit = [r for r in requires if r.startswith("cuda-toolkit")]
    assert toolkit and "==13.0" in toolkit[0], toolkit
    sglang_torch = list(
        (REPO / ".venv-sglang/lib/python3.11/site-packages").glob("torch-*.dist-info/METADATA")
    )
    assert sglang_torch and "cuda-toolkit[" in sglang_torch[0].read_text()
    assert "==13.0" in re.search(r"cuda-toolkit\[[^\]]*\]==[0-9.]+", sglang_torch[0].read_text()).group(0)  # type: ignore[union-attr]
    assert "-cu130" in json.loads(resolve().stdout)["services"]["sglang-policy"]["image"]
    for doc in ("README.md", "docs/gpu-host.md"):
        assert "R580 or newer" in (REPO / doc).read_text(), doc


def test_grafana_has_no_default_password_and_no_anonymous_access(
    default: dict[str, Any], tmp_path: Path
) -> None:
    """Issue 32, item 10: Grafana's admin password defaulted to ``admin``, with anonymous read access. Without
    GRAFANA_ADMIN_PASSWORD compose refuses to start, naming the script that makes one; anonymous is opt-in."""
    grafana = default["services"]["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "test-password"
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    for secret in ("GRAFANA_ADMIN_PASSWORD", "PROXY_API_KEY", "ENGINE_API_KEY", "ENGINE_ADMIN_API_KEY"):
        out = resolve(**{secret: ""})
        assert out.returncode != 0 and "compose-secrets.sh" in out.stderr, out.stderr[-2000:]
    # The script writes it (and the console's token) once, 0600, and keeps what is there.
    env_file = tmp_path / "secrets.env"

    def make_secrets() -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "COMPOSE_SECRETS_FILE": str(env_file)}
        return subprocess.run(
            ["bash", "scripts/compose-secrets.sh"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    made = make_secrets()
    assert made.returncode == 0, made.stderr
    first = env_file.read_text()
    assert re.search(r"^GRAFANA_ADMIN_PASSWORD=[A-Za-z0-9_-]{24,}$", first, re.M), first
    assert re.search(r"^CONSOLE_TOKEN=[A-Za-z0-9_-]{24,}$", first, re.M), first
    for name in ("PROXY_API_KEY", "ENGINE_API_KEY", "ENGINE_ADMIN_API_KEY"):
        assert re.search(rf"^{name}=[A-Za-z0-9_-]{{24,}}$", first, re.M), first
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    again = make_secrets()
    assert again.returncode == 0 and env_file.read_text() == first


@pytest.mark.parametrize("layout", [("compose.yaml",), ("compose.yaml", "compose.one-gpu.yaml")])
def test_the_engines_take_both_keys_on_an_internal_network_and_only_the_proxy_holds_the_admin_key(
    layout: tuple[str, ...],
) -> None:
    """Issue 32, item 3: both SGLang servers started without keys on the network every container shares, so any
    container could load weights from any path, load adapters or pause generation. Now each takes both keys, sits
    on the internal ``engines`` network with no published port, and only the services that ask it join that
    network; the admin key reaches the proxy alone."""
    out = resolve(*layout, COMPOSE_PROFILES="judge-alt")
    assert out.returncode == 0, out.stderr
    project = json.loads(out.stdout)
    services = project["services"]
    assert any(net.get("internal") for name, net in project["networks"].items() if name.endswith("engines"))
    engines = [name for name in ("sglang-policy", "sglang-teacher") if name in services]
    assert engines == (
        ["sglang-policy"] if "compose.one-gpu.yaml" in layout else ["sglang-policy", "sglang-teacher"]
    )
    for name in engines:
        cmd = services[name]["command"]
        cmd = shlex.split(cmd) if isinstance(cmd, str) else cmd
        # one argument each (=): a generated key can start with "-", which SGLang's argparse took for an option
        assert "--api-key=test-engine-key-0123456789" in cmd, name
        assert "--admin-api-key=test-engine-admin-key-0123456789" in cmd, name
        assert set(services[name]["networks"]) == {"engines"} and not services[name].get("ports"), name
    for name in ("proxy", "judge", "judge-alt", "teacher", "eval", "prometheus"):
        assert "engines" in services[name]["networks"], f"{name} asks an engine"
    for name in ("pairer", "dispatcher", "trainer", "console", "grafana", "kafka", "redis"):
        assert "engines" not in services[name].get("networks", {}), f"{name} needs no engine"
    for name in (*OURS, "judge-alt"):
        env = {k: v for k, v in services[name]["environment"].items() if v is not None}
        config = load_config(env=env)
        assert config.engine.admin_api_key == (
            "test-engine-admin-key-0123456789" if name == "proxy" else None
        )
        if name in ("proxy", "eval"):
            assert config.engine.api_key == "test-engine-key-0123456789", name
    for name, section in (("judge", "judge"), ("judge-alt", "judge"), ("teacher", "teacher")):
        env = {k: v for k, v in services[name]["environment"].items() if v is not None}
        assert getattr(load_config(env=env), section).api_key == "test-engine-key-0123456789", name


def test_the_consoles_login_link_names_the_published_port(default: dict[str, Any]) -> None:
    """In its container the console listens on 8080 whatever port compose publishes: the link it logs must name the
    published one (first contact: with CONSOLE_PORT=18080 it named 8080), or CONSOLE_URL when people come from
    elsewhere."""

    def link(service: dict[str, Any]) -> str:
        env = {k: v for k, v in service["environment"].items() if v is not None}
        config = load_config(env=env)
        config.console.token = "T"
        return console_login_url(config)

    assert link(default["services"]["console"]) == "http://127.0.0.1:8080/login?token=T"
    moved = json.loads(resolve(CONSOLE_PORT="18080").stdout)["services"]
    assert moved["console"]["ports"][0]["published"] == "18080"
    assert link(moved["console"]) == "http://127.0.0.1:18080/login?token=T"
    named = json.loads(resolve(CONSOLE_URL="https://gpu-host.example:8443").stdout)["services"]
    assert link(named["console"]) == "https://gpu-host.example:8443/login?token=T"


def test_replicas_every_policy_server_is_routed_reloaded_and_evaluated() -> None:
    """compose.replicas.yaml: the second policy server is the first one (command, keys, volumes, network, health
    check) on its own GPUs; the proxy names both as replicas and waits for both; the eval asks either."""
    out = resolve("compose.yaml", "compose.replicas.yaml", POLICY_2_GPUS="5")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    first, second = services["sglang-policy"], services["sglang-policy-2"]
    assert gpus(second) == ["5"] and gpus(first) == ["0"]
    for key in ("image", "command", "volumes", "networks", "healthcheck", "environment"):
        assert first[key] == second[key], key
    env = {k: v for k, v in services["proxy"]["environment"].items() if v is not None}
    engine = load_config(env=env).engine
    policies = sorted(n for n in services if n.startswith("sglang-policy"))
    assert engine.urls == [f"http://{n}:30000" for n in policies]
    assert {"sglang-policy", "sglang-policy-2"} <= set(services["proxy"]["depends_on"])
    assert {"sglang-policy", "sglang-policy-2"} <= set(services["trainer"]["depends_on"])
    eval_config = load_config(env={k: v for k, v in services["eval"]["environment"].items() if v is not None})
    assert eval_config.eval.engine_url == "" and eval_config.engine.urls == engine.urls


def test_ha_every_service_reaches_three_brokers_and_the_redis_master_through_sentinel() -> None:
    """compose.ha.yaml: three KRaft brokers of one cluster (their own ids, addresses and volumes), every topic made
    with 3 copies and 2 in sync, every turnstream service bootstrapped from all three and on Redis through its
    Sentinels, which watch the master compose.yaml runs; the sealing keys wait for the replica."""
    out = resolve("compose.yaml", "compose.replicas.yaml", "compose.ha.yaml", COMPOSE_PROFILES="judge-alt")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    brokers = [services[n] for n in ("kafka", "kafka-2", "kafka-3")]
    envs = [b["environment"] for b in brokers]
    assert [e["KAFKA_NODE_ID"] for e in envs] == ["1", "2", "3"]
    assert len({e["CLUSTER_ID"] for e in envs}) == 1
    assert {e["KAFKA_CONTROLLER_QUORUM_VOTERS"] for e in envs} == {
        "1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"
    }
    assert [e["KAFKA_ADVERTISED_LISTENERS"] for e in envs] == [
        f"CLIENT://{n}:9092" for n in ("kafka", "kafka-2", "kafka-3")
    ]
    assert len({b["volumes"][0]["source"] for b in brokers}) == 3
    assert all(e["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3" for e in envs)
    sentinels = [n for n in services if n.startswith("redis-sentinel-")]
    assert len(sentinels) == 3
    script = services[sentinels[0]]["command"][-1]
    assert "sentinel monitor turnstream redis 6379 2" in script
    assert "--replicaof" in services["redis-replica"]["command"]
    # Authenticated all the way (issue 55, row 8): the servers take the ACL file and log in to each other as
    # `replica`; the Sentinels take their user lines, log in to the servers as `sentinel` and to each other as admin;
    # each service logs in as its own user, and to the Sentinels as `client`.
    for server in ("redis", "redis-replica"):
        command = services[server]["command"]
        assert command[command.index("--aclfile") + 1] == "/acl/users.acl", server
        assert command[command.index("--masteruser") + 1] == "replica", server
        assert command[command.index("--masterauth") + 1] == "test-redis-replica", server
    assert "--sentinel-out" in services["redis-users"]["command"]
    for name in sentinels:
        assert "cat /acl/sentinel-users.conf" in services[name]["command"][-1]
        assert "sentinel auth-user turnstream sentinel" in services[name]["command"][-1]
        assert any(v["target"] == "/acl" and v["read_only"] for v in services[name]["volumes"])
        assert "--user client" in services[name]["healthcheck"]["test"][-1]
    for name in (*OURS, "judge-alt"):
        env = {k: v for k, v in services[name]["environment"].items() if v is not None}
        config = load_config(env=env)
        assert config.kafka.bootstrap == "kafka:9092,kafka-2:9092,kafka-3:9092", name
        user = "judge" if name == "judge-alt" else name
        target = sentinel_target(config.redis.url)
        assert target and (target.username, target.password) == (user, f"test-redis-{user}"), name
        assert (target.sentinel_username, target.sentinel_password) == ("client", "test-redis-client")
        assert config.kafka.seal_keys_url == config.redis.url
        assert config.kafka.seal_keys_replicas == 1, name
        if name != "topics":
            assert set(sentinels) <= set(services[name]["depends_on"]), name
    topics = load_config(
        env={k: v for k, v in services["topics"]["environment"].items() if v is not None}
    ).kafka
    assert topics.replication(3) == (3, 2)
    assert {"kafka", "kafka-2", "kafka-3"} <= set(services["topics"]["depends_on"])


def test_per_user_keys_are_a_volume_the_proxy_reads_and_only_the_keys_service_writes() -> None:
    """Issue 55, row 9: compose set ``TURNSTREAM_PROXY_KEYS_FILE`` and mounted nothing, so per-user keys could not
    be deployed. Now the proxy reads the file from the ``proxy-keys`` volume, read-only; ``docker compose run --rm
    keys add alice`` (profile ``admin``, never started by ``up``, no network) is what writes it; the image makes
    the mount point its user's, so a new volume is writable by the keys service and readable by the proxy."""
    services = json.loads(resolve(COMPOSE_PROFILES="admin").stdout)["services"]
    proxy, keys = services["proxy"], services["keys"]
    path = proxy["environment"]["TURNSTREAM_PROXY_KEYS_FILE"]
    assert keys["environment"]["TURNSTREAM_PROXY_KEYS_FILE"] == path
    folder = str(Path(path).parent)

    def mount(service: dict[str, Any]) -> dict[str, Any]:
        return next(v for v in service["volumes"] if v["target"] == folder)

    assert mount(proxy)["source"] == mount(keys)["source"] == "proxy-keys"
    assert mount(proxy)["read_only"] and not mount(keys).get("read_only")
    assert keys["profiles"] == ["admin"] and keys["network_mode"] == "none" and not keys.get("depends_on")
    entry = [*keys["entrypoint"][3:], *keys["command"]]
    assert _parser().parse_args(entry).command == "keys"
    assert {s for s, c in services.items() if folder in str(c.get("volumes", []))} == {"proxy", "keys"}
    assert re.search(rf"chown turnstream [^\n]*{folder}", (REPO / "Dockerfile").read_text())
    assert "keys" not in json.loads(resolve().stdout)["services"]


def test_each_service_logs_in_to_redis_as_its_own_user_from_the_acl_file_redis_users_writes() -> None:
    """Issue 55, row 8: Redis ran with no password, so any container on the network read every key and could flush
    it. Now ``redis-users`` (no network) renders runtime/security/redis_users.py's users into the ACL file Redis
    starts with (read-only to it), from a password per user that scripts/compose-secrets.sh makes; every turnstream
    service's URL names its own user and password, and none holds another's."""
    services = json.loads(resolve(COMPOSE_PROFILES="judge-alt").stdout)["services"]
    redis, users = services["redis"], services["redis-users"]
    acl = users["command"][users["command"].index("--out") + 1]
    assert redis["command"][redis["command"].index("--aclfile") + 1] == acl
    assert _parser().parse_args(users["command"]).command == "redis-users"
    folder = str(Path(acl).parent)
    (mounted,) = [v for v in redis["volumes"] if v["target"] == folder]
    (written,) = [v for v in users["volumes"] if v["target"] == folder]
    assert mounted["source"] == written["source"] and mounted["read_only"] and not written.get("read_only")
    assert users["network_mode"] == "none"
    assert redis["depends_on"]["redis-users"]["condition"] == "service_completed_successfully"
    assert set(users["environment"]) == {f"REDIS_PASSWORD_{u.upper()}" for u in REDIS_USERS}
    made = re.search(r"redis_users=\(([^)]*)\)", (REPO / "scripts/compose-secrets.sh").read_text())
    assert made and made.group(1).split() == [u.upper() for u in REDIS_USERS]
    assert re.search(rf"chown turnstream [^\n]*{folder}", (REPO / "Dockerfile").read_text())
    for name in (*OURS, "judge-alt"):
        env = services[name]["environment"]
        assert "REDIS_PASSWORD" not in str(env).replace("TURNSTREAM_REDIS_URL", ""), name
        user = "judge" if name == "judge-alt" else name
        assert env["TURNSTREAM_REDIS_URL"] == f"redis://{user}:test-redis-{user}@redis:6379/0"
    holders = {n for n, s in services.items() if "test-redis-admin" in json.dumps(s)}
    assert holders == {"redis-users"}, "the operator's password is in no running service"


def test_kafka_and_redis_sit_on_a_network_of_their_own_and_turnstreams_containers_are_hardened() -> None:
    """Issue 55, rows 8 and 10: every container shared one network (Grafana could reach Redis and Kafka), and no
    container dropped anything. Now Kafka, Redis and its Sentinels are on the internal ``data`` network alone, with
    the services that use them; Prometheus reaches the services' /metrics over ``metrics`` and Grafana only
    Prometheus. turnstream's containers run with a read-only root (the trainer aside: GPU kernel caches), no
    capabilities and no privilege gained by exec; every image is pinned to a release."""
    out = resolve("compose.yaml", "compose.replicas.yaml", "compose.ha.yaml", COMPOSE_PROFILES="judge-alt")
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout)
    services, networks = resolved["services"], resolved["networks"]
    assert (
        networks["data"]["internal"] and networks["metrics"]["internal"] and networks["engines"]["internal"]
    )
    stores = {
        n for n in services if n.startswith(("kafka", "redis")) and n != "redis-users" and "format" not in n
    }
    assert {"kafka", "kafka-2", "kafka-3", "redis", "redis-replica", "redis-sentinel-1"} <= stores
    for name in stores:
        assert set(services[name]["networks"]) == {"data"}, name
    on_data = {n for n, s in services.items() if "data" in s.get("networks", {})}
    assert on_data == stores | {*OURS, "judge-alt"}
    assert set(services["grafana"]["networks"]) == {"dashboards"}
    assert set(services["prometheus"]["networks"]) == {"dashboards", "metrics", "engines"}
    admin = json.loads(resolve(COMPOSE_PROFILES="admin").stdout)["services"]
    formats = [services[n] for n in ("kafka-format", "kafka-format-2", "kafka-format-3")]
    for one_shot in formats:
        assert one_shot["network_mode"] == "none"
    for one_shot in (services["redis-users"], admin["keys"]):  # write a volume, no network at all
        assert (
            one_shot["read_only"] and one_shot["cap_drop"] == ["ALL"] and one_shot["network_mode"] == "none"
        )
    for name in (*OURS, "judge-alt"):
        s = services[name]
        assert "metrics" in s["networks"] or name == "topics", name
        assert s["cap_drop"] == ["ALL"] and "no-new-privileges:true" in s["security_opt"], name
        assert s.get("cap_add", []) == (["DAC_OVERRIDE"] if name == "trainer" else []), name
        assert bool(s.get("read_only")) is (name != "trainer"), name
        if s.get("read_only"):
            assert any(t.startswith("/tmp") for t in s["tmpfs"]), name
    for name, s in services.items():
        image = s["image"]
        if image.startswith("turnstream:"):  # built here, from the Dockerfile
            continue
        tag = image.rsplit(":", 1)[-1]
        assert re.fullmatch(r"v?\d+\.\d+\.\d+(-\w+)?", tag), f"{name}: {image} is not a pinned release"


def test_each_service_logs_in_to_kafka_as_its_own_user_and_the_brokers_allow_nothing_else() -> None:
    """Issue 55, row 8: Kafka listened in plain text with no login, so any container on its network could write
    ``samples`` (training past the judge) or read every conversation. Now every broker takes SCRAM logins only and
    authorizes each request by ACL (none: refused); the topics step, as the operator, makes each service's user with
    runtime/security/kafka_users.py's ACLs before it makes the topics; each service holds its own password alone, the
    operator's is held by the brokers, their storage format and the topics step only."""
    services = json.loads(resolve("compose.yaml", "compose.ha.yaml", COMPOSE_PROFILES="judge-alt").stdout)[
        "services"
    ]
    brokers = ("kafka", "kafka-2", "kafka-3")
    for name in brokers:
        env = services[name]["environment"]
        assert (
            env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"] == "CONTROLLER:SASL_PLAINTEXT,CLIENT:SASL_PLAINTEXT"
        )
        assert (
            env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
            and "StandardAuthorizer" in env["KAFKA_AUTHORIZER_CLASS_NAME"]
        )
        assert env["KAFKA_SUPER_USERS"] == "User:admin;User:controller"
        assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
        assert (
            'password="test-kafka-admin"'
            in env["KAFKA_LISTENER_NAME_CLIENT_SCRAM___SHA___512_SASL_JAAS_CONFIG"]
        )
        fmt = services[name.replace("kafka", "kafka-format")]
        assert services[name]["depends_on"][name.replace("kafka", "kafka-format")]["condition"] == (
            "service_completed_successfully"
        )
        assert fmt["environment"]["NODE_ID"] == env["KAFKA_NODE_ID"]
        assert fmt["environment"]["VOTERS"] == env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
        assert [v["source"] for v in fmt["volumes"]] == [v["source"] for v in services[name]["volumes"]]
        assert "name=admin,password=$$ADMIN_PASSWORD" in fmt["command"][0]
        assert [k for k in env if k.startswith("KAFKA_PASSWORD")] == [], (
            "the image would write it to its config"
        )
    topics = services["topics"]["environment"]
    assert {k for k in topics if k.startswith("KAFKA_PASSWORD_")} == {
        f"KAFKA_PASSWORD_{u.upper()}" for u in kafka_users.USERS
    }
    assert topics["TURNSTREAM_KAFKA_SASL_USERNAME"] == kafka_users.OPERATOR
    made = re.search(r"kafka_users=\(([^)]*)\)", (REPO / "scripts/compose-secrets.sh").read_text())
    assert made and set(made.group(1).split()) == {u.upper() for u in (*kafka_users.NAMES, "controller")}
    assert set(kafka_users.USERS) == set(OURS) - {"topics"}
    for user in kafka_users.NAMES:
        holders = {n for n, s in services.items() if f"test-kafka-{user}" in json.dumps(s)}
        own = {n for n in (*OURS, "judge-alt") if (n if n != "judge-alt" else "judge") == user}
        if user == kafka_users.OPERATOR:
            assert holders == {*brokers, "kafka-format", "kafka-format-2", "kafka-format-3", "topics"}
        else:
            assert holders == own | {"topics"}, user
