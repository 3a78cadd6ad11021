"""Preparing messages for a chat template as SGLang does (content-part lists, developer and tool messages), so
that every renderer of turnstream's agrees with the engine; the engine itself is compared in
tests/services/engine/test_sglang.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.engine.chat_template import (
    TemplateError,
    content_format,
    for_engine,
    prepare_messages,
    render_prompt_ids,
)

LOOPS_OVER_CONTENT = (
    "{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endfor %}"
)
STRING_ONLY = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


def test_the_content_format_is_detected_as_sglang_detects_it() -> None:
    assert content_format(STRING_ONLY) == "string"
    assert content_format(LOOPS_OVER_CONTENT) == "openai"
    assert (
        content_format("{% for m in messages %}{% for c in m.content | list %}{% endfor %}{% endfor %}")
        == "openai"
    )
    assert content_format("{{ 'an image placeholder' }}") == "openai", (
        "templates mentioning media are multimodal"
    )
    assert content_format("{% for %}") == "string", "a template jinja cannot parse"


def test_string_templates_get_text_parts_joined_and_media_left_out() -> None:
    tok = SimpleNamespace(chat_template=STRING_ONLY)
    out = prepare_messages(
        tok,
        [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c1"},
        ],
    )
    assert out == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a b"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


def test_openai_templates_keep_the_parts_with_media_as_bare_types() -> None:
    tok = SimpleNamespace(chat_template=LOOPS_OVER_CONTENT)
    parts = [
        {"type": "input_text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "audio_url", "audio_url": {"url": "y"}},
    ]
    assert prepare_messages(tok, [{"role": "user", "content": parts}]) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "audio"}]}
    ]
    tool = prepare_messages(
        tok, [{"role": "tool", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}]}]
    )
    assert tool == [{"role": "tool", "content": "4 2"}], (
        "SGLang flattens a tool result made only of text parts"
    )


def test_for_engine_maps_developer_to_system_and_leaves_other_chats_alone() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert for_engine(chat) is chat
    assert for_engine([{"role": "developer", "content": "x"}, *chat]) == [
        {"role": "system", "content": "x"},
        *chat,
    ]


def test_smollm2_renders_content_parts_like_plain_text(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}
    ]
    assert render_prompt_ids(tok, parts) == render_prompt_ids(
        tok, [{"role": "user", "content": "Hello there"}]
    )
    with pytest.raises(TemplateError):
        render_prompt_ids(
            SimpleNamespace(chat_template="{{ raise_exception('no') }}", apply_chat_template=_raise), parts
        )


def _raise(*args: object, **kwargs: object) -> str:
    raise ValueError("the template refused")
