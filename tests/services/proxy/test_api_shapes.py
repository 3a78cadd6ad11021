"""The Responses and Messages translations on their own: requests into the chat request, the engine's chat answers
(streamed and not) into each API's objects and events, every one checked against the vendor SDK's own types and
stream accumulators (openai 3.51.0, anthropic 2.17.0)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from services.proxy.apis.messages import MESSAGES
from services.proxy.apis.responses import RESPONSES
from services.proxy.continuity import links
from services.proxy.validation import BadInput, BodyLimits, check_chat

RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(RawMessageStreamEvent)

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
}


def chat_answer(
    content: str = "", reasoning: str = "", calls: list[dict[str, Any]] | None = None, finish: str = "stop"
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37},
    }


def chat_chunks(
    content: str = "", reasoning: str = "", calls: int = 0, finish: str = "stop"
) -> list[dict[str, Any]]:
    """A stream as SGLang sends it with its parsers: reasoning, content, tool calls by index (name first, then
    argument pieces), the finish, the sglext ids, the usage."""

    def delta(**fields: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    out = [delta(role="assistant", content="")]
    out += [delta(reasoning_content=piece) for piece in reasoning.split(" ") if reasoning]
    out += [delta(content=piece + " ") for piece in content.split(" ") if content]
    for i in range(calls):
        out.append(
            delta(
                tool_calls=[
                    {
                        "index": i,
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "weather", "arguments": ""},
                    }
                ]
            )
        )
        for piece in ('{"city": ', f'"Oslo{i}"', "}"):
            out.append(delta(tool_calls=[{"index": i, "function": {"arguments": piece}}]))
    out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    out.append({"sglext": {"input_ids": [1, 2], "output_ids": [[3, 4]]}, "choices": []})
    out.append({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37}})
    return out


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for record in raw.decode().split("\n\n"):
        if not record.strip():
            continue
        lines = dict(line.split(": ", 1) for line in record.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def run_stream(
    api: Any, request: dict[str, Any], chunks: list[dict[str, Any]]
) -> list[tuple[str, dict[str, Any]]]:
    exchange = api.translate(request)
    events = api.events(exchange)
    raw = events.start() + b"".join(events.chunk(c) for c in chunks) + events.end()
    return sse_events(raw)


# --- Responses ------------------------------------------------------------------------------------------------


def test_responses_input_items_become_the_chat_the_model_reads() -> None:
    request = {
        "model": "policy",
        "instructions": "Be brief.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Use tools."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in Oslo?"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city":"Oslo"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "12C"},
        ],
        "tools": [
            {"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": False},
            {
                "type": "namespace",
                "name": "agents",
                "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
            },
            {"type": "web_search"},
        ],
        "max_output_tokens": 50,
        "store": False,
        "stream": True,
    }
    exchange = RESPONSES.translate(request)
    body = check_chat(exchange.body)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},  # a developer message is a system message to the model
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12C"},
    ]
    assert [t["function"]["name"] for t in body["tools"]] == ["weather", "spawn"]  # the hosted tool left out
    assert exchange.names == {"spawn": "agents"} and body["max_tokens"] == 50 and body["stream"] is True
    assert exchange.store is False and exchange.id.startswith("resp_") and len(exchange.id) == 37


def test_responses_resent_answer_continues_the_conversation_hash() -> None:
    """What the client sends back of an answer hashes like the answer the engine gave (ids, status, annotations,
    logprobs and reasoning items notwithstanding)."""
    answer = chat_answer("It is 12C.", reasoning="think", calls=[TOOL_CALL])
    first = RESPONSES.translate({"input": "Weather?"})
    rendered = json.loads(RESPONSES.render(first, answer))
    second = RESPONSES.translate(
        {
            "input": [
                {"role": "user", "content": "Weather?"},
                *rendered["output"],
                {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
            ]
        }
    )
    from services.proxy.continuity import answered

    state = links({}, check_chat(first.body)).state
    assert links({}, check_chat(second.body)).continues == answered(state, answer["choices"][0]["message"])


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_non_streamed_response_is_the_sdks_response(finish: str) -> None:
    exchange = RESPONSES.translate(
        {
            "model": "policy",
            "input": "hi",
            "tools": [{"type": "function", "name": "weather", "parameters": {}}],
        }
    )
    data = json.loads(
        RESPONSES.render(exchange, chat_answer("Hello.", reasoning="hmm", calls=[TOOL_CALL], finish=finish))
    )
    response = OpenAIResponse.model_validate(data, strict=False)
    assert response.output_text == "Hello." and response.id == exchange.id
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    call = response.output[2]
    assert (
        call.type == "function_call"
        and call.call_id == "call_1"
        and json.loads(call.arguments) == {"city": "Oslo"}
    )
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (
        30,
        7,
    )
    assert response.status == ("completed" if finish == "stop" else "incomplete")


@pytest.mark.parametrize(
    ("content", "reasoning", "calls"),
    [("Hello there.", "", 0), ("", "", 2), ("Sure.", "let me see", 1), ("", "", 0)],
)
def test_a_streamed_response_is_what_the_sdks_accumulator_takes(
    content: str, reasoning: str, calls: int
) -> None:
    request = {
        "model": "policy",
        "input": "hi",
        "stream": True,
        "tools": [{"type": "function", "name": "weather", "parameters": {}}],
    }
    events = run_stream(RESPONSES, request, chat_chunks(content, reasoning, calls))
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for name, data in events:
        assert name == data["type"]
        event = RESPONSE_EVENT.validate_python(data)
        state.handle_event(event)  # raises on events out of order, unknown items, ids that change
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.completed"
    response = OpenAIResponse.model_validate(final)
    assert response.output_text == "".join(piece + " " for piece in content.split(" ") if content)
    got_calls = [item for item in response.output if item.type == "function_call"]
    assert [json.loads(c.arguments) for c in got_calls] == [{"city": f"Oslo{i}"} for i in range(calls)]
    assert response.usage is not None and response.usage.total_tokens == 37
    if reasoning:
        assert response.output[0].type == "reasoning"


def test_a_stream_that_breaks_off_ends_with_response_failed() -> None:
    exchange = RESPONSES.translate({"input": "hi", "stream": True})
    events = RESPONSES.events(exchange)
    raw = events.start() + events.chunk(chat_chunks("Half an")[1]) + events.fail("the engine went away")
    (*_, (name, data)) = sse_events(raw)
    event = RESPONSE_EVENT.validate_python(data)
    assert name == "response.failed" and event.response.error.code == "server_error"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        ({"input": [{"type": "input_file", "file_id": "f"}]}, "does not serve"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "cannot take"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "tools": [{"type": "nonsense"}]}, "does not know"),
        ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({}, "'input' is required"),
        ({"input": 3}, "'input' must be"),
        # OpenAI's metadata rule: it is echoed in each of a stream's three response objects (issue 55, row 6).
        ({"input": "hi", "metadata": {"k": "x" * 513}}, "at most 512"),
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16 pairs"),
        ({"input": "hi", "metadata": {"k" * 65: "v"}}, "at most 64"),
        ({"input": "hi", "metadata": ["x"]}, "'metadata' must be an object"),
    ],
)
def test_responses_refuses_what_it_cannot_serve_clearly(request_: dict[str, Any], needle: str) -> None:
    with pytest.raises(BadInput) as refused:
        RESPONSES.translate(request_)
    assert refused.value.status == 400 and needle in str(refused.value)


def test_codex_labels_its_housekeeping() -> None:
    meta = lambda kind: {"client_metadata": {"x-codex-turn-metadata": json.dumps({"request_kind": kind})}}  # noqa: E731
    assert not RESPONSES.side_call(meta("turn")) and RESPONSES.side_call(meta("compact"))
    assert RESPONSES.session_hint({"session-id": "abc"}, {}) == "abc"
    assert RESPONSES.session_hint({}, {"prompt_cache_key": "k"}) == "k"


# --- Messages -------------------------------------------------------------------------------------------------


def test_messages_blocks_become_the_chat_the_model_reads() -> None:
    request = {
        "model": "policy",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "List files.", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "ls it", "signature": "sig"},
                    {"type": "text", "text": "Running ls."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Then count them."},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "a b"}],
                    },
                ],
            },
            {"role": "system", "content": "<system-reminder>be careful</system-reminder>"},
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run.",
                "input_schema": {"type": "object"},
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "thinking": {"type": "disabled"},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "cc-session"})},
        "stream": True,
    }
    exchange = MESSAGES.translate(request)
    body = check_chat(exchange.body)
    assert body["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "content": "Running ls.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a b"},  # before the user's own text
        {"role": "user", "content": "Then count them."},
        {"role": "system", "content": "<system-reminder>be careful</system-reminder>"},
    ]
    assert (
        body["tool_choice"] == "required" and body["parallel_tool_calls"] is False and body["stop"] == ["END"]
    )
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["max_tokens"] == 64
    assert MESSAGES.session_hint({}, request) == "cc-session"
    assert MESSAGES.session_hint({"x-claude-code-session-id": "h"}, request) == "h"
    assert MESSAGES.credential({"x-api-key": "k"}) == "Bearer k"


def test_a_non_streamed_message_is_the_sdks_message() -> None:
    exchange = MESSAGES.translate(
        {"model": "policy", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    )
    message = AnthropicMessage.model_validate(
        json.loads(
            MESSAGES.render(
                exchange, chat_answer("Hi.", reasoning="hm", calls=[TOOL_CALL], finish="tool_calls")
            )
        )
    )
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Oslo"} and message.stop_reason == "tool_use"  # type: ignore[union-attr]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (30, 7)


@pytest.mark.parametrize(
    ("content", "reasoning", "calls", "finish"),
    [
        ("Hello there.", "", 0, "stop"),
        ("", "", 2, "tool_calls"),
        ("Sure.", "let me see", 1, "tool_calls"),
        ("", "", 0, "length"),
    ],
)
def test_a_streamed_message_is_what_the_sdks_accumulator_takes(
    content: str, reasoning: str, calls: int, finish: str
) -> None:
    request = {
        "model": "policy",
        "max_tokens": 10,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    events = run_stream(MESSAGES, request, chat_chunks(content, reasoning, calls, finish))
    snapshot = None
    buffers: dict[int, bytes] = {}
    for name, data in events:
        assert name == data["type"]
        snapshot = accumulate_event(
            event=MESSAGE_EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=buffers
        )
    assert events[-1][0] == "message_stop" and events[-2][0] == "message_delta"
    assert snapshot is not None
    kinds = [b.type for b in snapshot.content]
    assert kinds == ["thinking"] * bool(reasoning) + ["text"] * bool(content) + ["tool_use"] * calls
    assert [b.input for b in snapshot.content if b.type == "tool_use"] == [
        {"city": f"Oslo{i}"} for i in range(calls)
    ]
    assert (
        snapshot.stop_reason == {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}[finish]
    )
    assert snapshot.usage.output_tokens == 7 and snapshot.usage.input_tokens == 30


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (['{"city": ', '"Oslo"', "}"], {"city": "Oslo"}),
        (
            [" ", '{"city": "Oslo", "days": 3'],
            {"city": "Oslo", "days": 3},
        ),  # cut at max_tokens: the object so far
        (
            ['"gab', "enet", "_gab"],
            {"arguments": '"gabenet_gab'},
        ),  # SmolLM2's greedy arguments: not an object
        (['[{"', 'city": 1}]'], {"arguments": [{"city": 1}]}),
        (['{"city": "Oslo"}', "} tail"], {"city": "Oslo"}),  # no longer JSON after a valid start: not sent on
    ],
)
def test_streamed_tool_input_is_always_an_object(pieces: list[str], expected: dict[str, Any]) -> None:
    """Whatever the model wrote as arguments, the SDK's accumulator (which parses every input_json_delta as it
    arrives) gets an object, the same one a non-streamed answer gives where the arguments are not an object."""
    request = {
        "model": "p",
        "max_tokens": 10,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }

    def delta(**fields: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    start = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "weather", "arguments": ""}}
    chunks = [delta(tool_calls=[start])]
    chunks += [delta(tool_calls=[{"index": 0, "function": {"arguments": piece}}]) for piece in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    snapshot = None
    buffers: dict[int, bytes] = {}
    for _, data in run_stream(MESSAGES, request, chunks):
        snapshot = accumulate_event(
            event=MESSAGE_EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=buffers
        )
    assert snapshot is not None and [b.input for b in snapshot.content if b.type == "tool_use"] == [expected]


def test_anthropic_errors_have_anthropics_shape() -> None:
    response = MESSAGES.error(401, "no key", "authentication_error")
    assert response.status_code == 401 and response.headers["x-should-retry"] == "false"
    assert msgspec.json.decode(response.body) == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "no key"},
    }
    assert MESSAGES.error(429, "slow down", "requests").headers["x-should-retry"] == "true"


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "non-empty"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            },
            "cannot hold",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            "client tools",
        ),
    ],
)
def test_messages_refuses_what_it_cannot_serve_clearly(request_: dict[str, Any], needle: str) -> None:
    with pytest.raises(BadInput) as refused:
        MESSAGES.translate(request_)
    assert refused.value.status == 400 and needle in str(refused.value)


def test_claude_codes_housekeeping_is_a_side_call() -> None:
    assert MESSAGES.side_call({"max_tokens": 1})
    assert MESSAGES.side_call({"max_tokens": 200, "output_config": {"format": {"type": "json_schema"}}})
    assert not MESSAGES.side_call({"max_tokens": 32000, "output_config": {"effort": "high"}})


def test_opencodes_title_request_is_housekeeping() -> None:
    from services.proxy.side_calls import chat_side_call

    title = [{"role": "system", "content": "You are a title generator. You output ONLY a thread title."}]
    assert chat_side_call({"messages": [*title, {"role": "user", "content": "Generate a title"}]})
    assert not chat_side_call({"messages": [{"role": "system", "content": "You are opencode."}]})
    assert not chat_side_call({"messages": [{"role": "user", "content": "You are a title generator."}]})


def media_requests(url: str) -> list[dict[str, Any]]:
    """The chat body each API's request with an image at ``url`` becomes (and chat's video and audio parts)."""
    part = {"type": "image_url", "image_url": {"url": url}}
    chat = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]},
        {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": url}}]}]},
    ]
    responses = RESPONSES.translate(
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}
    )
    messages = MESSAGES.translate(
        {
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}]}
            ],
        }
    )
    return [*chat, responses.body, messages.body]


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "https://elsewhere.example.org/a.png",
        "file:///etc/passwd",
        "/root/.ssh/id.png",
        "https://images.example.com.evil.org/a.png",
    ],
)
def test_media_is_taken_only_inline_or_from_the_places_allowed(url: str) -> None:
    """Issue 55, row 6: SGLang fetches an ``http(s)`` media URL itself and reads ``file://`` and paths ending in an
    image extension from its own disk, so every API's image (chat's video and audio too) is refused unless inline
    or under ``proxy.media_url_prefixes``."""
    allowed = BodyLimits(media_url_prefixes=("https://images.example.com/",))
    for body in media_requests(url):
        with pytest.raises(BadInput) as refused:
            check_chat(body, allowed)
        assert refused.value.status == 400 and refused.value.code == "media_url_not_allowed", body
    for ok in ("data:image/png;base64,iVBORw0KGgo=", "https://images.example.com/cat.png"):
        for body in media_requests(ok):
            assert check_chat(body, allowed)["messages"]
