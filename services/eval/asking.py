"""How the evaluation asks the policy engine and reads its answer, in one place for the held-out questions
(``worker.py``) and the evaluation sets (``set_runner.py``).

A reasoning model served with a reasoning parser (SGLang's ``--reasoning-parser qwen3``) puts everything before
``</think>`` in ``reasoning_content``, and a Qwen3 template thinks unless told not to: asked for 64 tokens, every
answer of every version would be thinking cut short and ``content`` empty, and the gate would compare empty
strings. So the evaluation states the template's ``enable_thinking`` (``eval.thinking``, off by default: the
answer comes at once, in ``content``; a template without the switch ignores it) and scores ``content``, the final
answer, never the reasoning. With ``eval.thinking`` on, give ``eval.max_tokens`` room for the thinking: an answer
still inside it when the tokens run out scores as empty, which is what that version gave.
"""

from __future__ import annotations

from typing import Any


def request(model: str, messages: list[dict[str, Any]], max_tokens: int, thinking: bool) -> dict[str, Any]:
    """The greedy chat request of one evaluation question."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": thinking},
    }


def answer_text(data: dict[str, Any]) -> str:
    """The final answer of an engine's chat response (``content``; the reasoning is not the answer)."""
    return str(data["choices"][0]["message"].get("content") or "").strip()
