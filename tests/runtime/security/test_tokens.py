"""The console's login link: where the console listens unless ``console.public_url`` says where people open it."""

from __future__ import annotations

import pytest

from runtime.configuration.config import ConfigError, load_config
from runtime.security.tokens import console_login_url


def test_the_link_names_the_listening_address_a_browser_can_open() -> None:
    config = load_config(env={"TURNSTREAM_CONSOLE_TOKEN": "T", "TURNSTREAM_CONSOLE_PORT": "9999"})
    assert console_login_url(config) == "http://127.0.0.1:9999/login?token=T"
    config = load_config(env={"TURNSTREAM_CONSOLE_TOKEN": "T", "TURNSTREAM_CONSOLE_HOST": "0.0.0.0"})
    assert console_login_url(config) == "http://127.0.0.1:8080/login?token=T"  # a wildcard is not an address
    config = load_config(env={"TURNSTREAM_CONSOLE_TOKEN": "T", "TURNSTREAM_CONSOLE_HOST": "::1"})
    assert console_login_url(config) == "http://[::1]:8080/login?token=T"


def test_public_url_wins_and_a_malformed_one_is_refused() -> None:
    env = {"TURNSTREAM_CONSOLE_TOKEN": "T", "TURNSTREAM_CONSOLE_PUBLIC_URL": "https://gpu-host:8443/"}
    assert console_login_url(load_config(env=env)) == "https://gpu-host:8443/login?token=T"
    for bad in ("gpu-host:8443", "ftp://gpu-host", "http://"):
        with pytest.raises(ConfigError, match="public_url"):
            load_config(env={"TURNSTREAM_CONSOLE_PUBLIC_URL": bad})
