"""The teacher's enhanced context: the hint goes to the last user message, exactly once, nothing else changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas import FunctionCall, Message, ToolCall
from services.teacher.enhance import HINT_PREFIX, as_request_messages, enhanced_messages
from tests.strategies import example_turn

HINT = "Answer in one word."


def test_hint_appended_to_last_user_message_only() -> None:
    call = ToolCall(id="c1", function=FunctionCall(name="f", arguments="{}"))
    msgs = [
        Message(role="system", content="Be brief."),
        Message(role="user", content="first"),
        Message(role="assistant", content=None, tool_calls=[call]),
        Message(role="user", content="second"),
        Message(role="tool", content="result", tool_call_id="c1"),
    ]
    out = enhanced_messages(msgs, HINT)
    assert out[3].content == "second\n\n[user's hint / instruction]\nAnswer in one word."
    assert [m for i, m in enumerate(out) if i != 3] == [m for i, m in enumerate(msgs) if i != 3]
    assert msgs[3].content == "second", "the turn's own messages are not modified"


def test_without_user_message_the_last_message_gets_it() -> None:
    msgs = [Message(role="system", content="sys"), Message(role="tool", content="out", tool_call_id="x")]
    assert enhanced_messages(msgs, HINT)[-1].content == "out" + HINT_PREFIX + HINT


def test_content_parts_get_the_hint_in_their_last_text_part() -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]
    out = enhanced_messages([Message(role="user", content=parts)], HINT)
    assert out[0].content == [{"type": "text", "text": "look" + HINT_PREFIX + HINT}, parts[1]]
    only_image = [{"type": "image_url", "image_url": {"url": "u"}}]
    out = enhanced_messages([Message(role="user", content=only_image)], HINT)
    assert out[0].content == [*only_image, {"type": "text", "text": "[user's hint / instruction]\n" + HINT}]


def test_empty_content_and_no_messages() -> None:
    assert enhanced_messages([Message(role="user", content=None)], HINT)[0].content == HINT_PREFIX + HINT
    with pytest.raises(ValueError):
        enhanced_messages([], HINT)


def test_request_messages_leave_unset_fields_out() -> None:
    assert as_request_messages([Message(role="user", content="hi")]) == [{"role": "user", "content": "hi"}]


# The end of Qwen3's chat template: ChatML, and an empty think block in the generation prompt when the request
# said enable_thinking=False (Qwen/Qwen3-*'s tokenizer_config.json).
QWEN3_LIKE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_the_teacher_renders_with_the_template_options_the_policy_was_served_with(smollm2_path: Path) -> None:
    """A turn served with enable_thinking=False had an empty think block in its prompt; the teacher's prompt has it
    too, else the first response tokens are scored after another prompt (large spurious OPD gaps)."""
    from transformers import AutoTokenizer

    from runtime.engine.chat_template import render_prompt_ids
    from services.teacher.worker import Teacher
    from tests.services.teacher.test_teacher import hint_judgment

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = QWEN3_LIKE
    messages = [Message(role="user", content="Hi")]
    served = {"enable_thinking": False}
    prompt = render_prompt_ids(tok, as_request_messages(messages), None, served)
    assert "<think>" in tok.decode(prompt)
    turn = example_turn("q", 1, messages=messages, prompt_token_ids=prompt, chat_template_kwargs=served)
    teacher = Teacher(None, tok, None, None, model="t")  # type: ignore[arg-type]
    ids = teacher.prompt_ids(hint_judgment(turn, "Answer in one word."))
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "Answer in one word." in text
