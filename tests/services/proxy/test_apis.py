"""The Responses and Messages APIs end to end: each vendor's own SDK through the proxy to the real SGLang server,
turns recorded with the engine's exact ids and log-probs, sessions found from what each API's clients send, stored
responses continued by ``previous_response_id`` and private to their key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from runtime.configuration.config import KafkaConfig
from services.engine.launch import EngineProcess
from tests.services.proxy.conftest import ProxyProcess, wait_for_turns
from tests.services.proxy.test_proxy import rescore, sdk

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}


def claude(proxy: ProxyProcess, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)


async def assert_exact(engine: EngineProcess, turn: Any) -> None:
    """The recorded log-probs are the model's own for exactly the recorded ids."""
    assert len(turn.response_token_ids) == len(turn.response_logprobs) > 0
    scored = await rescore(engine, turn.prompt_token_ids, turn.response_token_ids)
    assert max(abs(a - b) for a, b in zip(scored, turn.response_logprobs, strict=True)) < 1e-4


async def test_responses_streamed_and_not_are_recorded_exactly_and_continue_their_session(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    client = sdk(proxy)
    first = client.responses.create(
        model="policy",
        instructions="Be brief.",
        input="Name a fruit.",
        max_output_tokens=12,
        temperature=0,
        store=False,
        extra_headers={"session-id": "codex-thread-1"},  # as Codex CLI sends it
    )
    assert first.status in ("completed", "incomplete") and first.output_text and first.id.startswith("resp_")
    # Codex sends the answer back, ids, status, annotations and all, and streams the next turn.
    history: list[Any] = [
        {"role": "user", "content": "Name a fruit."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And a vegetable?"},
    ]
    with client.responses.stream(
        model="policy",
        instructions="Be brief.",
        input=history,
        max_output_tokens=10,
        temperature=0,
        store=False,
        extra_headers={"session-id": "codex-thread-1"},
    ) as stream:  # the SDK's own accumulator: strict about event order and ids
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # Cut at max_output_tokens it is incomplete, as OpenAI's is (the helper's get_final_response wants completed).
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    assert "".join(deltas) == final.output_text and final.usage is not None and final.usage.output_tokens > 0

    one, two = sorted(await wait_for_turns(kafka, 2), key=lambda t: t.turn_index)
    assert (one.api, two.api) == ("responses", "responses")
    assert one.session_id == "codex-thread-1" and one.turn_index == 1
    assert two.session_id == "codex-thread-1" and two.turn_index == 2
    assert [m.role for m in one.messages] == ["system", "user"] and one.response.content == first.output_text
    assert [m.content for m in two.messages] == [
        "Be brief.",
        "Name a fruit.",
        first.output_text,
        "And a vegetable?",
    ]
    assert two.response.content == final.output_text
    assert len(one.prompt_token_ids) == first.usage.input_tokens  # type: ignore[union-attr]
    await assert_exact(engine, one)
    await assert_exact(engine, two)


async def test_a_stored_response_continues_by_previous_response_id(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    """As openai-agents does: only the new input is sent, the proxy knows the rest."""
    client = sdk(proxy)
    first = client.responses.create(
        model="policy", input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model="policy",
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    one, two = sorted(await wait_for_turns(kafka, 2), key=lambda t: t.turn_index)
    assert two.session_id == one.session_id and two.turn_index == 2
    assert [m.content for m in two.messages] == ["My name is Ada.", first.output_text, "What is my name?"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model="policy", previous_response_id="resp_" + "0" * 32, input="x", max_output_tokens=2
        )


async def test_responses_tool_calls_and_sessions_found_by_continuity(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    """A named tool's call streams as a function_call item and is recorded exactly; a conversation without any
    session id is found by continuity from the items sent back (ids, status, annotations and all); a function's
    output reaches the engine as a tool message."""
    client = sdk(proxy)
    ask = [{"role": "user", "content": "What's the weather in Oslo? Use the tool."}]
    with client.responses.stream(  # streamed: the call's name arrives even when its arguments run long
        model="policy",
        input=ask,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
        store=False,
    ) as stream:
        called = list(stream)[-1].response  # type: ignore[union-attr]
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", called.model_dump_json()

    first = client.responses.create(
        model="policy", input="Name a fruit.", max_output_tokens=8, temperature=0, store=False
    )
    again = [
        {"role": "user", "content": "Name a fruit."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "Another?"},
    ]
    client.responses.create(model="policy", input=again, max_output_tokens=4, temperature=0, store=False)  # type: ignore[arg-type]
    # SmolLM2 seldom writes its arguments as a JSON object (SGLang refuses other history): this one is made by hand.
    answered = [
        *ask,
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "12C, rain"},
    ]
    client.responses.create(model="policy", input=answered, tools=[WEATHER], max_output_tokens=4, store=False)  # type: ignore[arg-type]

    turns = await wait_for_turns(kafka, 4)
    (tool_turn,) = [t for t in turns if t.response.tool_calls]
    assert tool_turn.api == "responses" and tool_turn.response.tool_calls[0].function.name == "get_weather"  # type: ignore[index]
    assert tool_turn.response.tool_calls[0].function.arguments == calls[0].arguments  # type: ignore[index]
    await assert_exact(engine, tool_turn)
    (two,) = [t for t in turns if t.turn_index == 2]
    (one,) = [t for t in turns if t.session_id == two.session_id and t.turn_index == 1]
    assert one.response.content == first.output_text and [m.content for m in two.messages][-1] == "Another?"
    (result,) = [t for t in turns if t.messages[-1].role == "tool"]
    assert [m.role for m in result.messages] == ["user", "assistant", "tool"]
    assert result.messages[-1].content == "12C, rain" and result.messages[-1].tool_call_id == "call_1"


async def test_messages_streamed_and_not_are_recorded_exactly_in_claude_codes_session(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    client = claude(proxy)
    metadata = {
        "user_id": '{"device_id":"d1","account_uuid":"","session_id":"cc-42"}'
    }  # as Claude Code sends it
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(
        model="policy",
        max_tokens=12,
        system=system,
        extra_body={"temperature": 0},  # SDK 2.x has no sampling fields; the API takes them
        metadata=metadata,  # type: ignore[arg-type]
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Name a fruit.", "cache_control": {"type": "ephemeral"}}
                ],
            }
        ],
    )
    text = "".join(b.text for b in first.content if b.type == "text")
    assert first.id.startswith("msg_") and first.stop_reason in ("end_turn", "max_tokens") and text
    # count_tokens (Claude Code sizes its context with it): the prompt the engine would see, never a turn.
    counted = client.messages.count_tokens(
        model="policy",
        system=system,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Name a fruit."}],
    )
    # Anthropic's input_tokens leave out the prompt tokens read from the cache (the engine reports them: an earlier
    # test may have sent this prefix).
    seen = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == seen > 0
    with client.messages.stream(
        model="policy",
        max_tokens=10,
        system=system,
        extra_body={"temperature": 0},  # SDK 2.x has no sampling fields; the API takes them
        metadata=metadata,  # type: ignore[arg-type]
        messages=[
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": first.content},  # type: ignore[typeddict-item]
            {"role": "user", "content": "And a vegetable?"},
        ],
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert (
        streamed == "".join(b.text for b in final.content if b.type == "text")
        and final.usage.output_tokens > 0
    )
    one, two = sorted(await wait_for_turns(kafka, 2), key=lambda t: t.turn_index)  # count_tokens made none
    assert (one.api, two.api) == ("messages", "messages")
    assert (one.session_id, one.turn_index, two.session_id, two.turn_index) == ("cc-42", 1, "cc-42", 2)
    assert [m.content for m in two.messages] == ["Be brief.", "Name a fruit.", text, "And a vegetable?"]
    assert two.response.content == streamed
    await assert_exact(engine, one)
    await assert_exact(engine, two)


async def test_messages_tool_use_and_results(
    proxy: ProxyProcess, engine: EngineProcess, kafka: KafkaConfig
) -> None:
    client = claude(proxy)
    tool = {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER["parameters"]}
    ask = {"role": "user", "content": "What's the weather in Oslo? Use the tool."}
    with client.messages.stream(
        model="policy",
        max_tokens=64,
        extra_body={"temperature": 0},  # SDK 2.x has no sampling fields; the API takes them
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[ask],  # type: ignore[list-item]
    ) as stream:  # the SDK's accumulator parses the streamed input as JSON as it grows
        deltas = [e for e in stream if e.type == "content_block_delta"]
        called = stream.get_final_message()
    uses = [b for b in called.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input, dict)
    assert any(d.delta.type == "input_json_delta" for d in deltas) or called.stop_reason == "max_tokens"
    client.messages.create(
        model="policy",
        max_tokens=4,
        tools=[tool],  # type: ignore[list-item]
        messages=[
            ask,  # type: ignore[list-item]
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12C"},
                    {"type": "text", "text": "So?"},
                ],
            },
        ],
    )
    turns = await wait_for_turns(kafka, 2)
    (tool_turn,) = [t for t in turns if t.response.tool_calls]
    assert tool_turn.api == "messages" and tool_turn.response.tool_calls[0].function.name == "get_weather"  # type: ignore[index]
    await assert_exact(engine, tool_turn)
    (result,) = [t for t in turns if not t.response.tool_calls]
    assert [m.role for m in result.messages] == ["user", "assistant", "tool", "user"]
    assert result.messages[1].tool_calls[0].function.arguments == '{"city": "Oslo"}'  # type: ignore[index]


def test_each_api_refuses_in_its_own_shape_and_answers_its_probes(
    proxy_env: dict[str, str], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice sk-alice-0123456789abcdef\nbob sk-bob-0123456789abcdefgh\n")
    keys.chmod(0o600)
    secured = ProxyProcess({**proxy_env, "TURNSTREAM_PROXY_KEYS_FILE": str(keys)})
    try:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            claude(secured, "sk-wrong").messages.create(
                model="p", max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
        assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        ok = claude(secured, "sk-alice-0123456789abcdef").messages.create(
            model="p", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
        assert ok.type == "message"
        with pytest.raises(anthropic.BadRequestError) as bad:
            claude(secured, "sk-alice-0123456789abcdef").messages.create(
                model="p",
                max_tokens=2,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                            }
                        ],
                    }
                ],  # type: ignore[list-item]
            )
        assert "cannot hold" in str(bad.value)
        with pytest.raises(openai.AuthenticationError):
            sdk(secured, api_key="sk-wrong").responses.create(model="p", input="x", max_output_tokens=2)
        # A stored response is its key's alone: to another key it does not exist.
        alice, bob = (
            sdk(secured, api_key="sk-alice-0123456789abcdef"),
            sdk(secured, api_key="sk-bob-0123456789abcdefgh"),
        )
        made = alice.responses.create(model="p", input="secret", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="p", previous_response_id=made.id, input="x", max_output_tokens=2)
        assert alice.responses.create(
            model="p", previous_response_id=made.id, input="x", max_output_tokens=2
        ).id
        with pytest.raises(openai.BadRequestError) as unserved:
            alice.responses.create(
                model="p", input=[{"type": "item_reference", "id": "msg_1"}], max_output_tokens=2
            )  # type: ignore[list-item]
        assert "previous_response_id" in str(unserved.value)
        hello = httpx.head(secured.url + "/api/hello", timeout=10)
        websocket = httpx.get(secured.url + "/v1/responses", headers={"Upgrade": "websocket"}, timeout=10)
        assert hello.status_code == 200 and websocket.status_code == 426
    finally:
        secured.stop()


def test_one_key_can_neither_lock_itself_out_nor_grow_a_stored_conversation(
    proxy_env: dict[str, str], engine: EngineProcess
) -> None:
    """Issue 55, rows 1 and 2. Claude Code calls ``count_tokens`` in normal use; each call took one of its key's
    in-flight slots and never gave it back, so past ``proxy.max_requests_per_key`` every request of that key was
    a 429 until the proxy restarted (compose and the chart run with one shared key: every user). And a chain of
    stored responses, each continuing the last, grew without bound (22.5 MiB under one id where a request may
    carry 8 MiB): continuing one is refused when the conversation and the request are more than one request may
    carry. Here the caps are 2 requests and 6,000 bytes."""
    proxy = ProxyProcess(
        {
            **proxy_env,
            "TURNSTREAM_PROXY_MAX_REQUESTS_PER_KEY": "2",
            "TURNSTREAM_PROXY_MAX_BODY_BYTES": "6000",
        }
    )
    try:
        client = claude(proxy)
        asked = [{"role": "user", "content": "Name a fruit."}]
        for _ in range(3):
            assert client.messages.count_tokens(model="policy", messages=asked).input_tokens > 0  # type: ignore[arg-type]
        answer = client.messages.create(model="policy", max_tokens=2, messages=asked)  # type: ignore[arg-type]
        assert answer.usage.output_tokens > 0

        responses = sdk(proxy)
        text = "Words to keep. " * 250  # 3,750 bytes: one request carries it, two do not
        first = responses.responses.create(model="policy", input=text, max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as refused:
            responses.responses.create(
                model="policy", previous_response_id=first.id, input=text, max_output_tokens=2
            )
        assert refused.value.code == "conversation_too_large" and "6000 bytes" in str(refused.value)
        short = responses.responses.create(
            model="policy", previous_response_id=first.id, input="And?", max_output_tokens=2
        )
        assert short.previous_response_id == first.id
    finally:
        proxy.stop()
