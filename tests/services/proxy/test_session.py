"""OpenClaw's session fields: headers win over the body's copies, which are stripped; an untagged request is
``proxy.default_turn_type`` (main by default, side as OpenClaw-RL does)."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from runtime.configuration.config import load_config
from services.proxy.session import SessionError, session_info


def test_an_untagged_request_takes_the_configured_turn_type() -> None:
    assert session_info(Headers({}), {}).turn_type == "main"
    assert session_info(Headers({}), {}, "side").turn_type == "side"
    assert session_info(Headers({"x-turn-type": "main"}), {}, "side").turn_type == "main"
    body = {"turn_type": "main", "session_id": "s", "messages": []}
    info = session_info(Headers({}), body, "side")
    assert (info.turn_type, info.session_id, body) == ("main", "s", {"messages": []})
    with pytest.raises(SessionError, match="X-Turn-Type must be 'main' or 'side'"):
        session_info(Headers({"x-turn-type": "other"}), {})
    assert load_config(env={"TURNSTREAM_PROXY_DEFAULT_TURN_TYPE": "side"}).proxy.default_turn_type == "side"
