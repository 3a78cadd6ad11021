"""What clients add to one request only, read as ``runtime/pipeline/envelopes.py`` says: reminders are cut only
where a client puts them, and a context pair's reply goes only with its pair."""

from __future__ import annotations

from runtime.pipeline.envelopes import REMINDERS, conversation, request_only, without_reminder
from schemas import Message

RULES = "# File editing rules:\n\nReturn edits similar to unified diffs that `diff -U0` would produce."


def test_a_reminder_is_cut_only_after_a_blank_line() -> None:
    assert without_reminder(f"Fix the bug.\n\n{RULES}") == "Fix the bug."
    assert without_reminder(f"Fix the bug.\n\n  \n{RULES}") == "Fix the bug."
    # Quoted inside a line, or without the blank line aider puts before it, it is the user's text.
    assert (
        without_reminder(f"Why does aider say '{REMINDERS[2]}'?") == f"Why does aider say '{REMINDERS[2]}'?"
    )
    assert without_reminder(f"Fix the bug.\n{RULES}") == f"Fix the bug.\n{RULES}"
    assert without_reminder("Two paragraphs.\n\nThe second.") == "Two paragraphs.\n\nThe second."
    # The ask mode's reminder is the language alone, with the newline aider ends it with; without it, the user's.
    assert without_reminder("What is X?\n\nReply in English.\n") == "What is X?"
    assert without_reminder("What is X?\n\nReply in French.") == "What is X?\n\nReply in French."


def test_only_a_system_message_that_is_a_reminder_is_request_only() -> None:
    assert request_only({"role": "system", "content": RULES})
    assert request_only({"role": "system", "content": "Reply in English.\n"})
    assert not request_only({"role": "system", "content": "Reply in English. Be brief.\n"})
    assert not request_only({"role": "system", "content": f"Act as an expert software developer.\n{RULES}"})
    assert not request_only({"role": "assistant", "content": RULES})


def test_a_context_pairs_reply_goes_with_it_and_no_other_answer_does() -> None:
    files = Message(role="user", content="I am not sharing any files that you can edit yet.")
    ok = Message(role="assistant", content="Ok.")
    asked, answer = (
        Message(role="user", content=f"Hi.\n\n{RULES}"),
        Message(role="assistant", content="Hello."),
    )
    assert conversation([files, ok, asked, answer]) == [Message(role="user", content="Hi."), answer]
    # A request-only message that opens no pair (OpenClaw's context block) leaves the answer after it alone.
    block = Message(role="user", content="<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nfacts")
    assert conversation([block, answer]) == [answer]
