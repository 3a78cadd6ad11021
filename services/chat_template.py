"""Render a chat request to prompt token ids exactly as the serving engine does.

The engine, the proxy's re-tokenizer fallback and the teacher must agree token for token: a teacher that renders
the prompt one token differently scores the response under a different context. So there is one renderer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class TemplateError(ValueError):
    """The chat template rejected these messages (the request's fault, not the server's)."""


def render_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt ids for ``messages`` with the generation prompt appended: template to text, then tokenize that
    text without adding special tokens (the template already holds them)."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # templates raise anything (jinja errors, their own raise_exception)
        raise TemplateError(f"the chat template could not render these messages: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)
