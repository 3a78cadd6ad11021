"""The one loader (runtime/configuration/plugins.py) and the configuration around it: a path that fits loads; one that
does not is refused at start-up with a message naming the field, the path and the mismatch."""

from __future__ import annotations

import pytest

from runtime.configuration.config import ConfigError, load_config
from runtime.configuration.plugins import PluginError, load_class, load_function

FIX = "tests.plugin_contracts.fixtures"


def test_a_function_that_fits_loads() -> None:
    fn = load_function("trainer.advantages", f"{FIX}:constant_advantages", ("samples", "settings"))
    assert fn.__name__ == "constant_advantages"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon.here", r"trainer\.advantages: 'no_colon\.here' is not a 'package\.module:attribute' path"),
        (
            "tests.nowhere:f",
            r"trainer\.advantages: 'tests\.nowhere:f' does not load: module 'tests\.nowhere'",
        ),
        (f"{FIX}:missing", rf"trainer\.advantages: '{FIX}:missing' does not load: '{FIX}' has no 'missing'"),
        (f"{FIX}:NOT_A_FUNCTION", r"is a int, not a function"),
        (
            f"{FIX}:samples_only",
            r"has the signature \(samples: 'Sequence\[Sample\]'\).*calls it with \(samples, settings\)",
        ),
    ],
)
def test_a_path_that_does_not_fit_is_refused_with_field_path_and_mismatch(path: str, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        load_function("trainer.advantages", path, ("samples", "settings"))


def test_a_class_seam_refuses_a_function() -> None:
    with pytest.raises(
        PluginError, match=r"judge\.backend: .*constant_advantages' is a function, not a class"
    ):
        load_class("judge.backend", f"{FIX}:constant_advantages")


def test_plugin_modules_load_with_the_config_and_a_broken_one_is_named() -> None:
    load_config(env={"TURNSTREAM_PLUGINS_MODULES": FIX})
    with pytest.raises(
        ConfigError, match=r"plugins\.modules: module 'tests\.absent' does not load.*TURNSTREAM_PLUGINS"
    ):
        load_config(env={"TURNSTREAM_PLUGINS_MODULES": "tests.absent"})


def test_an_unknown_mode_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        ConfigError,
        match=r"dispatcher\.mode.*'grpo-x' is not one of combine, opd, opd-topk, rl.*plugins\.modules",
    ):
        load_config(env={"TURNSTREAM_DISPATCHER_MODE": "grpo-x"})


def test_a_plugin_mode_is_a_valid_choice_and_brings_its_defaults() -> None:
    c = load_config(env={"TURNSTREAM_PLUGINS_MODULES": FIX, "TURNSTREAM_DISPATCHER_MODE": "rl-strict"})
    assert c.dispatcher.mode == "rl-strict" and c.trainer.eps_clip_high == 0.2
    c = load_config(
        env={
            "TURNSTREAM_PLUGINS_MODULES": FIX,
            "TURNSTREAM_DISPATCHER_MODE": "rl-strict",
            "TURNSTREAM_TRAINER_EPS_CLIP_HIGH": "0.3",
        }
    )
    assert c.trainer.eps_clip_high == 0.3, "a value the user set wins over the mode's default"
    assert load_config(env={}).trainer.eps_clip_high == 0.28


def test_a_missing_hint_template_file_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"teacher\.hint_template.*/nowhere/hint\.txt is not a file"):
        load_config(env={"TURNSTREAM_TEACHER_HINT_TEMPLATE": "/nowhere/hint.txt"})
