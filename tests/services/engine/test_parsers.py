"""Output parsing and incremental detokenization (pure functions)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from services.engine.detokenize import StopDecoder
from services.engine.parsers import StreamSplitter, parse_tool_calls, split_reasoning


def test_tool_calls_are_parsed_and_removed_from_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].to_openai()["type"] == "function"


def test_invalid_tool_blocks_stay_text() -> None:
    text = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    text = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(text) == (text, [])


def test_two_tool_calls() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "" and [c.name for c in calls] == ["a", "b"] and calls[1].arguments == "{}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>plan</think>answer", ("plan", "answer")),
        ("<think>\nplan\n</think>\n\nanswer", ("plan", "answer")),
        ("plain answer", (None, "plain answer")),
        ("<think>cut off", ("cut off", "")),
    ],
)
def test_split_reasoning(text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text) == expected


def _stream(splitter: StreamSplitter, pieces: list[str]) -> tuple[str, str]:
    r, c = "", ""
    for i, p in enumerate(pieces):
        dr, dc = splitter.feed(p, final=i == len(pieces) - 1)
        r, c = r + dr, c + dc
    return r, c


def test_stream_splitter_routes_reasoning_and_holds_back_partial_tags() -> None:
    pieces = ["<th", "ink>I should", " greet</th", "ink>Hel", "lo!"]
    assert _stream(StreamSplitter(reasoning=True, tools=False), pieces) == ("I should greet", "Hello!")
    assert _stream(StreamSplitter(reasoning=True, tools=False), ["Hi ", "there"]) == ("", "Hi there")


def test_stream_splitter_withholds_tool_blocks() -> None:
    s = StreamSplitter(reasoning=False, tools=True)
    r, c = _stream(s, ["Checking", " now <tool", '_call>{"name": "x"}', "</tool_call>"])
    assert (r, c) == ("", "Checking now ")
    assert s.in_tool and s.buffer.startswith("<tool_call>")


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(smollm2_path)


def test_stop_decoder_releases_text_incrementally_and_trims_the_stop(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("one, two, three. four").input_ids
    dec = StopDecoder(tokenizer, stop=[". f"])
    out = ""
    for t in ids:
        out += dec.add(t)
        if dec.matched:
            break
    out += dec.finish()
    assert dec.matched == ". f" and out == "one, two, three"


def test_stop_decoder_never_splits_a_multibyte_character(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("héllo wörld ✓ done").input_ids
    dec = StopDecoder(tokenizer, stop=[])
    pieces = [dec.add(t) for t in ids] + [dec.finish()]
    assert "".join(pieces) == "héllo wörld ✓ done"
    assert all("\ufffd" not in p for p in pieces)
