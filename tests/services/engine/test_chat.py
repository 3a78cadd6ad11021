"""The chat endpoint: chat templates exactly as transformers renders them (SmolLM2 and the real Qwen3 template
with tools), the official openai SDK streaming and not, stop strings, and exact token data."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from services.engine_client import EngineClient
from tests.services.engine.conftest import EngineProcess

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
]


def prompt_ids(engine: EngineProcess, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "return_prompt_token_ids": True}
    if tools:
        body["tools"] = tools
    resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["prompt_token_ids"]  # type: ignore[no-any-return]


def transformers_ids(path: Path, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    tok = AutoTokenizer.from_pretrained(path)
    return list(
        tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


def test_smollm2_template_renders_as_transformers_does(engine: EngineProcess, smollm2_path: Path) -> None:
    simple = [{"role": "user", "content": "hi"}]
    assert prompt_ids(engine, simple) == transformers_ids(smollm2_path, simple)
    convo = [{**m, "content": m["content"] or "(tool call)"} for m in CONVERSATION]
    assert prompt_ids(engine, convo, TOOLS) == transformers_ids(smollm2_path, convo, TOOLS)


@pytest.fixture(scope="module")
def qwen3_engine(tiny_qwen3_path: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(tiny_qwen3_path, "--reasoning-parser", "qwen3")
    yield proc
    proc.stop()


def test_qwen3_template_with_tools_renders_as_transformers_does(
    qwen3_engine: EngineProcess, tiny_qwen3_path: Path
) -> None:
    ids = prompt_ids(qwen3_engine, CONVERSATION, TOOLS)
    assert ids == transformers_ids(tiny_qwen3_path, CONVERSATION, TOOLS)
    text = AutoTokenizer.from_pretrained(tiny_qwen3_path).decode(ids)
    assert "<tools>" in text and "get_weather" in text and "<tool_response>" in text
    # Content given as OpenAI text parts renders like the plain string.
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What's the weather"},
                {"type": "text", "text": " in Paris?"},
            ],
        }
    ]
    assert prompt_ids(qwen3_engine, parts, TOOLS) == transformers_ids(
        tiny_qwen3_path, [{"role": "user", "content": "What's the weather in Paris?"}], TOOLS
    )


def test_openai_sdk_non_streaming(engine: EngineProcess) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "return_prompt_token_ids": True},
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is not None and len(choice.logprobs.content) == resp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    extra = choice.model_extra or {}
    assert len(extra["token_ids"]) == resp.usage.completion_tokens
    assert len(extra["prompt_token_ids"]) == resp.usage.prompt_tokens


def test_openai_sdk_streaming_delivers_tokens_as_they_are_produced(engine: EngineProcess) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused")
    t0 = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    finish = None
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Count from one to twenty."}],
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text.append(c.delta.content)
                arrivals.append(time.perf_counter() - t0)
            finish = c.finish_reason or finish
    assert finish == "length" and usage is not None and usage.completion_tokens == 40
    assert len(arrivals) >= 20
    # Real streaming: the first text arrived well before the last (not one burst at the end).
    assert arrivals[-1] - arrivals[0] > 0.25 * arrivals[-1]
    # The same request non-streamed yields the same text (greedy).
    full = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Count from one to twenty."}],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert "".join(text) == full.choices[0].message.content


def test_stop_strings_trim_the_text_and_report_the_match(engine: EngineProcess) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count from one to ten."}],
        "max_tokens": 60,
        "temperature": 0,
    }
    free = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120).json()
    text = free["choices"][0]["message"]["content"]
    assert len(text) > 12
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string from the middle of what the model says
    data = httpx.post(
        engine.url + "/v1/chat/completions",
        json={**body, "stop": [stop], "return_token_ids": True},
        timeout=120,
    ).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == stop
    assert choice["message"]["content"] == text[: text.index(stop)]
    assert stop not in choice["message"]["content"]


async def test_engine_client_chat_returns_aligned_tokens(engine: EngineProcess) -> None:
    client = EngineClient(engine.url)
    result = await client.chat({"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 8})
    assert result.token_ids is not None and result.logprobs is not None and result.prompt_token_ids
    assert len(result.token_ids) == len(result.logprobs) == result.raw["usage"]["completion_tokens"]
    assert result.weight_version == "0"


async def test_concurrent_requests_are_served_fairly(engine: EngineProcess) -> None:
    """A short request sent while a long one runs finishes first: the engine interleaves, it does not queue."""
    async with httpx.AsyncClient(timeout=120) as http:

        def body(n: int) -> dict[str, Any]:
            return {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}

        done: list[str] = []

        async def run(name: str, n: int, delay: float) -> None:
            await asyncio.sleep(delay)
            resp = await http.post(engine.url + "/generate", json=body(n))
            assert resp.status_code == 200
            done.append(name)

        await asyncio.gather(run("long", 80, 0), run("short", 5, 0.5))
    assert done == ["short", "long"]
