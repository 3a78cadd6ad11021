from __future__ import annotations

from pathlib import Path

import pytest

from runtime.configuration.config import OPENCLAW_ALIASES, ConfigError, load_config


def test_defaults_follow_the_design() -> None:
    c = load_config(env={})
    assert c.trainer.lr == 1e-5 and (c.trainer.adam_beta1, c.trainer.adam_beta2) == (0.9, 0.98)
    assert c.trainer.weight_decay == 0.1
    assert (c.trainer.eps_clip, c.trainer.eps_clip_high) == (0.2, 0.28)
    assert (c.trainer.w_opd, c.trainer.w_rl) == (1.0, 1.0)
    assert c.trainer.rollout_batch_size == 16
    assert c.judge.m == 1
    assert c.kafka.namespace == ""


def test_toml_file_then_env_override(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[kafka]\nbootstrap = "file:1"\nnamespace = "replay-1"\n[judge]\nm = 3\n')
    c = load_config(path, env={"TURNSTREAM_JUDGE_M": "5"})
    assert c.kafka.bootstrap == "file:1"
    assert c.kafka.namespace == "replay-1."
    assert c.judge.m == 5


def test_config_path_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[redis]\nurl = "redis://example:1/2"\n')
    assert load_config(env={"TURNSTREAM_CONFIG": str(path)}).redis.url == "redis://example:1/2"


@pytest.mark.parametrize(
    ("alias", "value", "section", "field", "expected"),
    [
        ("OPENCLAW_COMBINE_W_OPD", "0.5", "trainer", "w_opd", 0.5),
        ("OPENCLAW_COMBINE_W_RL", "2", "trainer", "w_rl", 2.0),
        ("PRM_M", "3", "judge", "m", 3),
        ("PRM_MAX_NEW_TOKENS", "16384", "judge", "max_tokens", 16384),
        ("SGLANG_API_KEY", "sk-x", "engine", "api_key", "sk-x"),
        ("OPENCLAW_EVAL_MODE", "0", "judge", "eval_mode", False),
        ("OPENCLAW_EVAL_MODE", "1", "judge", "eval_mode", True),
    ],
)
def test_openclaw_aliases(alias: str, value: str, section: str, field: str, expected: object) -> None:
    assert OPENCLAW_ALIASES[alias] == (section, field)
    c = load_config(env={alias: value})
    assert getattr(getattr(c, section), field) == expected


def test_train_epochs_is_refused_unless_it_is_one() -> None:
    """turnstream trains each sample once as it arrives; OpenClaw's TRAIN_EPOCHS other than 1 has no meaning here,
    and saying so beats ignoring it."""
    assert load_config(env={"TRAIN_EPOCHS": "1"}) == load_config(env={})
    with pytest.raises(ConfigError, match=r"TRAIN_EPOCHS=2.*once"):
        load_config(env={"TRAIN_EPOCHS": "2"})


def test_turnstream_variable_wins_over_alias() -> None:
    c = load_config(env={"PRM_M": "3", "TURNSTREAM_JUDGE_M": "7"})
    assert c.judge.m == 7


def test_list_fields_are_comma_separated_in_env() -> None:
    c = load_config(env={"TURNSTREAM_DISPATCHER_JUDGE_IDS": "a, b,c"})
    assert c.dispatcher.judge_ids == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"PRM_M": "0"}, ["judge.m", "$PRM_M"]),
        ({"TURNSTREAM_JUDGE_M": "many"}, ["judge.m", "$TURNSTREAM_JUDGE_M"]),
        ({"TURNSTREAM_DISPATCHER_MODE": "sft"}, ["dispatcher.mode", "$TURNSTREAM_DISPATCHER_MODE"]),
        ({"TURNSTREAM_PROXY_PORT": "70000"}, ["proxy.port"]),
        ({"TURNSTREAM_JUDGE_TYPO": "1"}, ["judge.typo", "unknown field"]),
        ({"TURNSTREAM_KAFKA_NAMESPACE": "bad name"}, ["kafka.namespace", "$TURNSTREAM_KAFKA_NAMESPACE"]),
        ({"TURNSTREAM_DISPATCHER_JUDGE_IDS": " , "}, ["dispatcher.judge_ids"]),
        ({"OPENCLAW_COMBINE_W_OPD": "-1"}, ["trainer.w_opd"]),
    ],
)
def test_bad_values_name_the_field_and_source(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    for name in names:
        assert name in str(info.value)


def test_bad_file_values_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[trainer]\nlr = -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "trainer.lr" in str(info.value) and str(path) in str(info.value)


def test_unknown_file_key_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[trainer]\nlearning_rate = 1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(path, env={})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[kafka\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, env={})


def test_unrelated_prefixed_variables_are_ignored() -> None:
    c = load_config(
        env={"TURNSTREAM_CACHE": "/tmp/x", "TURNSTREAM_KEEP_SERVICES": "1", "TURNSTREAM_FOO_BAR": "1"}
    )
    assert c.kafka.bootstrap == "127.0.0.1:9092"


def test_config_show_masks_every_secret() -> None:
    import json
    import subprocess
    import sys

    env = {
        "TURNSTREAM_PROXY_API_KEY": "proxy-sekrit",
        "SGLANG_API_KEY": "engine-sekrit",
        "TURNSTREAM_JUDGE_API_KEY": "judge-sekrit",
        "TURNSTREAM_KAFKA_SASL_PASSWORD": "kafka-sekrit",
        "TURNSTREAM_REDIS_URL": "redis://worker:redis-sekrit@cache.internal:6380/2",
        "TURNSTREAM_ENGINE_ADMIN_API_KEY": "admin-sekrit",
        "TURNSTREAM_CONSOLE_TOKEN": "console-sekrit",
    }
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "show"],
        env={"PATH": "/usr/bin:/bin", **env},
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "sekrit" not in out.stdout
    shown = json.loads(out.stdout)
    assert shown["proxy"]["api_key"] == shown["engine"]["api_key"] == shown["kafka"]["sasl_password"] == "***"
    assert shown["redis"]["url"] == "redis://worker:***@cache.internal:6380/2"
    assert (
        shown["kafka"]["seal_keys_url"] == shown["redis"]["url"]
    )  # the data keys' Redis: redis.url unless set
    assert shown["engine"]["admin_api_key"] == shown["console"]["token"] == "***"
    assert shown["teacher"]["api_key"] is None  # unset stays visible as unset


def test_a_sentinel_urls_passwords_are_masked_and_its_hosts_kept() -> None:
    """``config show`` took a Sentinel URL apart with ``urlsplit``, which fails on its host list (an exception where
    a password was set) and printed ``?sentinel_password=`` in the clear."""
    from runtime.configuration.config import redacted_url

    url = "redis+sentinel://proxy:pw-1@s1:26379,s2:26379/turnstream/0?sentinel_username=client&sentinel_password=pw-2"
    assert redacted_url(url) == (
        "redis+sentinel://proxy:***@s1:26379,s2:26379/turnstream/0?sentinel_username=client&sentinel_password=***"
    )
    assert redacted_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"


@pytest.mark.parametrize(
    ("mode", "m", "max_tokens", "eps_clip_high"),
    [("rl", 3, 4096, 0.28), ("opd", 1, 8192, 0.2), ("combine", 1, 8192, 0.28)],
)
def test_each_mode_brings_openclaws_settings(
    mode: str, m: int, max_tokens: int, eps_clip_high: float
) -> None:
    """OpenClaw-RL's scripts per mode: PRM_M, --prm-max-new-tokens and the clip range (opd: symmetric)."""
    c = load_config(env={"TURNSTREAM_DISPATCHER_MODE": mode})
    assert (c.judge.m, c.judge.max_tokens, c.trainer.eps_clip, c.trainer.eps_clip_high) == (
        m,
        max_tokens,
        0.2,
        eps_clip_high,
    )
    mine = load_config(
        env={"TURNSTREAM_DISPATCHER_MODE": mode, "PRM_M": "5", "TURNSTREAM_TRAINER_EPS_CLIP_HIGH": "0.3"}
    )
    assert (mine.judge.m, mine.trainer.eps_clip_high) == (5, 0.3), "what the user sets wins"


def test_a_mode_default_that_is_no_setting_is_refused() -> None:
    from schemas import ModeSpec

    with pytest.raises(ValueError, match=r"defaults: 'eps_clip_high' is not a 'section.field' setting"):
        ModeSpec(
            name="x",
            kinds=frozenset({"x"}),
            needs_eval=True,
            needs_hint=False,
            decide="a:b",
            advantage="a:b",
            defaults={"eps_clip_high": 0.2},
        )


def test_settings_that_cannot_work_together_are_refused_naming_the_field() -> None:
    """Without eval votes rl has no reward: refused at start, not discovered an hour later as dropped turns."""
    with pytest.raises(
        ConfigError, match=r"^judge\.eval_mode \(\$OPENCLAW_EVAL_MODE\): off, so no eval votes, and mode 'rl'"
    ):
        load_config(env={"OPENCLAW_EVAL_MODE": "0", "TURNSTREAM_DISPATCHER_MODE": "rl"})
    assert load_config(env={"OPENCLAW_EVAL_MODE": "0"}).dispatcher.mode == "combine", (
        "combine degrades to opd"
    )


def test_the_top_k_recipe_is_a_mode_with_openclaws_settings() -> None:
    """openclaw-opd/run_qwen3_4b_openclaw_opd_topk.sh: top-K distillation replaces the PPO loss, K 50, lr 1e-6,
    batches of 4, PRM_M 3."""
    c = load_config(env={"TURNSTREAM_DISPATCHER_MODE": "opd-topk"})
    assert (c.trainer.loss_terms, c.trainer.topk_coef, c.trainer.lr, c.trainer.rollout_batch_size) == (
        ["topk"],
        1.0,
        1e-6,
        4,
    )
    assert (c.teacher.top_k, c.judge.m, c.judge.max_tokens) == (50, 3, 8192)


def test_lora_settings_from_a_file_and_the_environment(tmp_path: Path) -> None:
    """``trainer.lora`` is a nested section: ``[trainer.lora]`` in TOML, ``TURNSTREAM_TRAINER_LORA_<FIELD>`` in the
    environment (later wins); unknown fields and projections are refused by name."""
    path = tmp_path / "t.toml"
    path.write_text('[trainer.lora]\nenabled = true\nrank = 8\ntarget_modules = ["q_proj", "v_proj"]\n')
    cfg = load_config(
        path, env={"TURNSTREAM_TRAINER_LORA_RANK": "32", "TURNSTREAM_TRAINER_LORA_PUBLISH": "merged"}
    )
    assert (cfg.trainer.lora.enabled, cfg.trainer.lora.rank, cfg.trainer.lora.alpha) == (True, 32, 32.0)
    assert (cfg.trainer.lora.target_modules, cfg.trainer.lora.publish) == (["q_proj", "v_proj"], "merged")
    env = {"TURNSTREAM_TRAINER_LORA_TARGET_MODULES": "q_proj, qkv_proj"}
    with pytest.raises(ConfigError, match=r"trainer.lora.*\['qkv_proj'\]"):
        load_config(env=env)
    with pytest.raises(ConfigError, match=r"TURNSTREAM_TRAINER_LORA_RANKK.*unknown field of lora"):
        load_config(env={"TURNSTREAM_TRAINER_LORA_RANKK": "8"})
    assert load_config(env={}).trainer.lora.enabled is False


def test_expiries_that_would_restart_a_session_early_are_refused() -> None:
    """A pairer state that expires before its idle sweep, or a session counter that expires while its turn ids
    are still remembered downstream, is a configuration error named at start."""
    with pytest.raises(ConfigError, match="state_ttl_s"):
        load_config(env={"TURNSTREAM_PAIRER_IDLE_TIMEOUT_S": "7200", "TURNSTREAM_PAIRER_STATE_TTL_S": "3600"})
    with pytest.raises(ConfigError, match="session_ttl_s"):
        load_config(env={"TURNSTREAM_REDIS_SESSION_TTL_S": "86400"})
    assert load_config(env={}).redis.session_ttl_s == 30 * 86400
