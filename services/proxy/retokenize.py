"""Fallback for engines that return no token ids: re-tokenize prompt and response with the policy's tokenizer.
The result is recorded as ``token_source='retokenized'`` and counted; it is used only when the engine's
log-prob count matches the re-tokenized response exactly (never padded)."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from runtime.engine.chat_template import render_prompt_ids


class Retokenizer:
    def __init__(self, path: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def __call__(self, body: dict[str, Any], completion: Any) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        prompt = completion.prompt_token_ids
        if prompt is None:
            prompt = render_prompt_ids(
                tok, body["messages"], body.get("tools"), body.get("chat_template_kwargs")
            )
        response = completion.token_ids
        if response is None:
            text = "".join(completion.content)
            response = list(tok(text, add_special_tokens=False).input_ids)
            if completion.finish_reason in ("stop", "tool_calls") and tok.eos_token_id is not None:
                response.append(int(tok.eos_token_id))
        return list(prompt), list(response)
