"""Malformed or unsupported requests get a 400 with a message that says what is wrong; the engine keeps
serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.services.engine.conftest import EngineProcess

CHAT_CASES: list[tuple[Any, str]] = [
    (b"{not json", "malformed JSON"),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', "malformed JSON"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "unsupported_knob": 1}, "unsupported_knob"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000_000}, "context length"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "image_url",
    ),
]

GENERATE_CASES: list[tuple[Any, str]] = [
    ({}, "exactly one of text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    ({"input_ids": [1, 2, -3]}, "input_ids"),
    ({"input_ids": [1, 2, 10**9]}, "vocabulary"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"text": "a", "stream": True}, "stream"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"min_p": 0.1}}, "min_p"),
]


def _post(engine: EngineProcess, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            engine.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
        )
    return httpx.post(engine.url + path, json=body, timeout=60)


@pytest.mark.parametrize(("body", "needle"), CHAT_CASES)
def test_bad_chat_requests_are_400_with_a_message(engine: EngineProcess, body: Any, needle: str) -> None:
    resp = _post(engine, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["object"] == "error" and err["code"] == 400
    assert needle in err["message"]


@pytest.mark.parametrize(("body", "needle"), GENERATE_CASES)
def test_bad_generate_requests_are_400_with_a_message(engine: EngineProcess, body: Any, needle: str) -> None:
    resp = _post(engine, "/generate", body)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["message"]


def test_bad_weight_update_is_rejected_and_serving_continues(engine: EngineProcess, tmp_path: Any) -> None:
    resp = _post(
        engine, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing"), "weight_version": "9"}
    )
    assert resp.status_code == 400 and resp.json()["success"] is False
    info = httpx.get(engine.url + "/get_model_info", timeout=10).json()
    assert info["weight_version"] == "0"
    ok = _post(engine, "/generate", {"text": "still", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_info_endpoints(engine: EngineProcess) -> None:
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
    models = httpx.get(engine.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"]
    info = httpx.get(engine.url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is True and info["weight_version"] == "0"
    metrics = httpx.get(engine.url + "/metrics", timeout=10).text
    assert "turnstream_engine_generated_tokens_total" in metrics
