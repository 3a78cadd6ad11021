"""The engine client's retry policy, against a scripted HTTP transport: idempotent calls are retried with
backoff, sampled generations only when the request never reached the engine."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.engine.client import ADMIN_PATHS, EngineClient, EngineError, parse_chat_result
from services.engine.launch import sglang_python


def scripted(
    responses: list[Callable[[httpx.Request], httpx.Response]],
) -> tuple[httpx.AsyncClient, list[str]]:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return responses[min(len(seen) - 1, len(responses) - 1)](request)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler)), seen


def ok_score(request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "text": "",
            "output_ids": [],
            "meta_info": {
                "input_token_logprobs": [[None, 3, None], [-0.5, 4, None], [-0.25, 5, None]],
                "weight_version": "2",
                "finish_reason": {"type": "length", "length": 0},
            },
        },
    )


def fail(status: int) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json={"object": "error", "message": f"boom {status}"})


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def test_idempotent_scoring_is_retried_after_server_errors() -> None:
    http, seen = scripted([fail(503), fail(500), ok_score])
    client = EngineClient("http://engine", client=http, backoff_s=0.001)
    result = await client.score([1, 2, 3], [4, 5])
    assert result.logprobs == [-0.5, -0.25] and result.weight_version == "2"
    assert len(seen) == 3


async def test_retries_are_bounded() -> None:
    http, seen = scripted([fail(503)])
    client = EngineClient("http://engine", client=http, retries=2, backoff_s=0.001)
    with pytest.raises(EngineError) as info:
        await client.score([1, 2, 3], [4, 5])
    assert info.value.status == 503 and "boom 503" in str(info.value)
    assert len(seen) == 3


async def test_client_errors_are_not_retried() -> None:
    http, seen = scripted([fail(400)])
    client = EngineClient("http://engine", client=http, backoff_s=0.001)
    with pytest.raises(EngineError) as info:
        await client.score([1, 2, 3], [4, 5])
    assert info.value.status == 400 and len(seen) == 1


async def test_sampled_generation_is_not_retried_after_it_reached_the_engine() -> None:
    http, seen = scripted([fail(503), ok_score])
    client = EngineClient("http://engine", client=http, backoff_s=0.001)
    with pytest.raises(EngineError):
        await client.generate(text="hi", sampling_params={"temperature": 0.8})
    assert len(seen) == 1


async def test_any_call_is_retried_when_the_engine_was_not_reached() -> None:
    http, seen = scripted([refuse, ok_score])
    client = EngineClient("http://engine", client=http, backoff_s=0.001)
    result = await client.generate(text="hi", sampling_params={"temperature": 0.8}, return_logprob=True)
    assert len(seen) == 2 and result.input_logprobs == [None, -0.5, -0.25]


async def test_misaligned_scores_are_an_error_not_a_shift() -> None:
    http, _ = scripted([ok_score])
    client = EngineClient("http://engine", client=http)
    with pytest.raises(EngineError, match="misaligned"):
        await client.score([1, 2, 3], [4, 6])
    with pytest.raises(EngineError, match="scored 2 tokens"):
        await client.score([1, 2, 3], [4, 5, 6])


def test_chat_results_parse_sglangs_ids_and_label_a_straddling_response_with_its_oldest_version() -> None:
    """SGLang 0.5.23's non-streamed shape: ids in ``prompt_token_ids``/``response_token_ids``, ``[logprob, id,
    text]`` in ``meta_info``, and ``metadata.weight_versions`` spans when a reload landed mid-generation."""
    data = {
        "choices": [
            {
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
                "prompt_token_ids": [1, 2],
                "response_token_ids": [7, 8],
                "meta_info": {"output_token_logprobs": [[-0.1, 7, "h"], [-0.2, 8, "i"]]},
            }
        ],
        "metadata": {
            "weight_version": "4",
            "weight_versions": [
                {"version": "3", "start": 0, "end": 1},
                {"version": "4", "start": 1, "end": 2},
            ],
        },
    }
    r = parse_chat_result(data)
    assert r.token_ids == [7, 8] and r.logprobs == [-0.1, -0.2] and r.prompt_token_ids == [1, 2]
    assert r.weight_version == "3", "never labelled newer than its oldest token"
    data["metadata"] = {"weight_version": "default"}
    assert parse_chat_result(data).weight_version == "0", "SGLang's 'default' is the starting weights"
    del data["metadata"]
    assert parse_chat_result(data).weight_version is None


def sglang_file(relative: str) -> Path:
    """A source file of the SGLang the engines run (``scripts/setup-sglang.sh``), found without importing it."""
    code = "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"
    out = subprocess.run([sglang_python(), "-c", code], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()) / relative


def sglang_auth() -> tuple[Any, dict[str, str]]:
    """SGLang 0.5.23's own auth decision (``sglang/srt/utils/auth.py``, which imports nothing heavy) and each
    route's auth level as ``http_server.py`` declares it."""
    spec = importlib.util.spec_from_file_location("sglang_auth", sglang_file("srt/utils/auth.py"))
    assert spec is not None and spec.loader is not None
    auth = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sglang_auth", auth)  # its dataclasses look their module up
    spec.loader.exec_module(auth)
    server = sglang_file("srt/entrypoints/http_server.py").read_text()
    routes = re.findall(r'@app\.\w+\(\s*"([^"]+)"[^\n]*\n@auth_level\(AuthLevel\.(\w+)\)', server)
    return auth, dict(routes)


async def test_each_route_gets_the_key_sglang_asks_for() -> None:
    """Issue 32, item 3: with ``--api-key`` and ``--admin-api-key`` both set, SGLang's admin routes take only the
    admin key and every other route only the API key. Each call the client makes is judged by SGLang's own
    ``decide_request_auth``; a client holding the API key alone is refused every admin route."""
    auth, levels = sglang_auth()
    assert levels["/update_weights_from_disk"] == "ADMIN_OPTIONAL"
    refused: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        decision = auth.decide_request_auth(
            method=request.method,
            path=path,
            authorization_header=request.headers.get("authorization"),
            api_key="api-key-0123456789",
            admin_api_key="admin-key-0123456789",
            auth_level=auth.AuthLevel[levels.get(path, "NORMAL")],
        )
        if not decision.allowed:
            refused.append(path)
            return httpx.Response(decision.error_status_code, json={"error": "Unauthorized"})
        if path == "/generate":
            return ok_score(request)
        return httpx.Response(200, json={"success": True, "data": [], "weight_version": "0"})

    async def every_call(client: EngineClient) -> None:
        await client.model_info()
        await client.server_info()
        await client.models()
        await client.score([1, 2, 3], [4, 5])
        await client.chat_raw({"messages": []})
        await client.pause_generation()
        await client.update_weights_from_disk("/w/v1", 1)
        await client.continue_generation()
        await client.load_lora_adapter("a", "/w/v1")
        await client.unload_lora_adapter("a")

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    keyed = EngineClient(
        "http://engine", api_key="api-key-0123456789", admin_api_key="admin-key-0123456789", client=http
    )
    await every_call(keyed)
    assert refused == []
    called_admin = {p for p, level in levels.items() if level != "NORMAL"} & ADMIN_PATHS
    assert called_admin == ADMIN_PATHS, "every path the client treats as admin is one in SGLang"
    api_only = EngineClient("http://engine", api_key="api-key-0123456789", client=http, retries=0)
    with pytest.raises(EngineError) as info:
        await api_only.pause_generation()
    assert info.value.status == 401 and refused == ["/pause_generation"]
