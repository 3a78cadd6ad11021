"""Collects what a completion produced (streamed or not) and builds the ``Turn`` that records it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import Counter

from schemas import FINISH_REASONS, Message, SamplingParams, Turn

RETOKENIZED = Counter(
    "turnstream_proxy_retokenized_total", "Turns whose token ids were re-tokenized (the engine returned none)"
)
DROPPED = Counter("turnstream_proxy_turns_dropped_total", "Main turns served but not recorded", ["reason"])

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")


class UnrecordableTurn(Exception):
    """A served turn that cannot be recorded faithfully; ``reason`` labels the drop metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class Completion:
    """What the engine produced for one request."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    weight_version: str | None = None

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        meta = chunk.get("metadata")
        if meta and meta.get("weight_version") is not None:
            self.weight_version = str(meta["weight_version"])
        for choice in chunk.get("choices") or ():
            if (ids := choice.get("prompt_token_ids")) is not None:
                self.prompt_token_ids = list(ids)
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            if delta.get("reasoning_content"):
                self.reasoning.append(delta["reasoning_content"])
            for tc in delta.get("tool_calls") or ():
                slot = self.tool_calls.setdefault(
                    int(tc.get("index", len(self.tool_calls))), {"arguments": []}
                )
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["name"] = fn["name"]
                if fn.get("arguments"):
                    slot["arguments"].append(fn["arguments"])
            # Extended in place: a new list per chunk would copy the response so far once per token.
            if (ids := choice.get("token_ids")) is not None:
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(ids)
            lp = choice.get("logprobs")
            if lp and lp.get("content"):
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend([float(c["logprob"]) for c in lp["content"]])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    @classmethod
    def from_response(cls, data: dict[str, Any]) -> Completion:
        c = cls()
        choice = data["choices"][0]
        msg = choice.get("message") or {}
        c.content = [msg["content"]] if msg.get("content") else []
        c.reasoning = [msg["reasoning_content"]] if msg.get("reasoning_content") else []
        for i, tc in enumerate(msg.get("tool_calls") or ()):
            fn = tc.get("function") or {}
            c.tool_calls[i] = {
                "id": tc.get("id", f"call_{i}"),
                "name": fn.get("name", ""),
                "arguments": [fn.get("arguments", "")],
            }
        meta = choice.get("meta_info") or {}
        out = meta.get("output_token_logprobs")
        if choice.get("token_ids") is not None:
            c.token_ids = list(choice["token_ids"])
        elif out is not None:
            c.token_ids = [int(e[1]) for e in out]
        if out is not None:
            c.logprobs = [float(e[0]) for e in out]
        elif (choice.get("logprobs") or {}).get("content") is not None:
            c.logprobs = [float(e["logprob"]) for e in choice["logprobs"]["content"]]
        c.prompt_token_ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids")
        c.finish_reason = choice.get("finish_reason")
        version = (data.get("metadata") or {}).get("weight_version", meta.get("weight_version"))
        c.weight_version = None if version is None else str(version)
        return c

    def message(self) -> Message:
        calls = None
        if self.tool_calls:
            calls = [
                {
                    "id": tc.get("id") or f"call_{i}",
                    "type": "function",
                    "function": {"name": tc.get("name", ""), "arguments": "".join(tc["arguments"])},
                }
                for i, tc in sorted(self.tool_calls.items())
            ]
        return msgspec.convert(
            {
                "role": "assistant",
                "content": "".join(self.content),
                "reasoning_content": "".join(self.reasoning) or None,
                "tool_calls": calls,
            },
            Message,
        )


def weight_version_number(version: str | None, fallback: int) -> int:
    """Engines report versions as strings; turnstream numbers them. Non-numeric (SGLang's 'default') -> fallback."""
    if version is not None and version.isdigit():
        return int(version)
    return fallback


def build_turn(
    *,
    session_id: str,
    turn_index: int,
    body: dict[str, Any],
    completion: Completion,
    model: str,
    created_at: float,
    session_done: bool,
    fallback_version: int,
    retokenize: Any = None,
) -> Turn:
    """The Turn for a served request. Raises UnrecordableTurn when the engine's data cannot be made exact."""
    token_ids, logprobs, prompt_ids = completion.token_ids, completion.logprobs, completion.prompt_token_ids
    source = "engine"
    if token_ids is None or prompt_ids is None:
        if retokenize is None:
            raise UnrecordableTurn(
                "no_token_ids", "the engine returned no token ids and no tokenizer is configured"
            )
        prompt_ids, token_ids = retokenize(body, completion)
        source = "retokenized"
        RETOKENIZED.inc()
    if logprobs is None:
        raise UnrecordableTurn("no_logprobs", "the engine returned no log-probs")
    if len(logprobs) != len(token_ids):
        raise UnrecordableTurn(
            "token_mismatch", f"{len(logprobs)} log-probs for {len(token_ids)} response tokens (never padded)"
        )
    try:
        messages = msgspec.convert(body["messages"], list[Message])
    except (msgspec.ValidationError, ValueError) as exc:
        raise UnrecordableTurn("invalid_messages", str(exc)) from None
    finish = completion.finish_reason if completion.finish_reason in FINISH_REASONS else "stop"
    sampling = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    stop = body.get("stop")
    try:
        return Turn(
            turn_id=f"{session_id}:{turn_index}",
            session_id=session_id,
            turn_index=turn_index,
            messages=messages,
            response=completion.message(),
            prompt_token_ids=list(prompt_ids),
            response_token_ids=list(token_ids),
            response_logprobs=list(logprobs),
            finish_reason=finish,
            weight_version=weight_version_number(completion.weight_version, fallback_version),
            model=model,
            created_at=created_at,
            completed_at=max(time.time(), created_at),
            tools=list(body.get("tools") or []),
            sampling=msgspec.convert(
                {**sampling, "max_tokens": max_tokens, "stop": [stop] if isinstance(stop, str) else stop},
                SamplingParams,
            ),
            session_done=session_done,
            token_source=source,
        )
    except (msgspec.ValidationError, ValueError) as exc:
        raise UnrecordableTurn("invalid_turn", str(exc)) from None
