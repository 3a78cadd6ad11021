"""Collects what a completion produced (streamed or not) and builds the ``Turn`` that records it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import Counter

from runtime.engine.client import parse_chat_result
from schemas import FINISH_REASONS, Message, SamplingParams, Turn

RETOKENIZED = Counter(
    "turnstream_proxy_retokenized_total", "Turns whose token ids were re-tokenized (the engine returned none)"
)
DROPPED = Counter("turnstream_proxy_turns_dropped_total", "Main turns served but not recorded", ["reason"])
REFUSED = Counter(
    "turnstream_proxy_turns_refused_total", "Main turns refused before the engine was asked", ["reason"]
)

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "presence_penalty",
    "frequency_penalty",
)


RESCORED = Counter(
    "turnstream_proxy_turns_rescored_total",
    "Turns whose log-probs were re-scored by prefill: sampled from modified logits (grammar, bias, penalties)",
    ["reason"],
)


def modified_logits(body: dict[str, Any]) -> str | None:
    """Why the engine's sampled log-probs are not the raw model's for this request, or None.

    SGLang computes a sampled token's log-prob after a grammar's mask, ``logit_bias``, penalties and a
    ``min_tokens`` EOS mask are applied to the logits (measured: a forced tool call's tokens came back ~19 nats
    above the raw model's). The trainer compares with the raw ``log_softmax(logits)``, so such a turn's log-probs
    are re-scored by a prefill of the same ids on the same weights."""
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    for name in ("regex", "ebnf", "json_schema", "structural_tag"):
        if body.get(name):
            return name
    if body.get("logit_bias"):
        return "logit_bias"
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if body.get(name) not in (None, neutral):
            return name
    if body.get("min_tokens"):
        return "min_tokens"
    return None


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
    weight_version: int | None = None
    """The oldest version that produced the response, when the engine said (non-streamed responses)."""

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        """One SGLang stream chunk. The exact ids come last, in the ``sglext`` chunk (``input_ids``, and
        ``output_ids`` as one list per choice); log-probs ride on the content chunks."""
        ext = chunk.get("sglext")
        if ext:
            if ext.get("input_ids") is not None:
                self.prompt_token_ids = list(ext["input_ids"])
            if ext.get("output_ids"):
                self.token_ids = list(ext["output_ids"][0])
        for choice in chunk.get("choices") or ():
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
            lp = choice.get("logprobs")
            if lp and lp.get("content"):
                # Extended in place: a new list per chunk would copy the response so far once per token.
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
        parsed = parse_chat_result(data)
        c.token_ids = parsed.token_ids
        c.logprobs = parsed.logprobs
        c.prompt_token_ids = parsed.prompt_token_ids
        c.finish_reason = choice.get("finish_reason")
        c.weight_version = None if parsed.weight_version is None else int(parsed.weight_version)
        return c

    def answer(self) -> dict[str, Any]:
        """The assistant message as the client received it (what its next request repeats)."""
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
        return {
            "role": "assistant",
            "content": "".join(self.content),
            "reasoning_content": "".join(self.reasoning) or None,
            "tool_calls": calls,
        }

    def message(self) -> Message:
        return msgspec.convert(self.answer(), Message)


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
    api: str = "chat",
    replica: str = "",
) -> Turn:
    """The Turn for a served request. ``body`` is the request as sent to the engine (sampling pinned), and
    ``fallback_version`` labels a response whose engine reported no version (a stream: see ServedVersions).
    Raises UnrecordableTurn when the engine's data cannot be made exact."""
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
            weight_version=(
                completion.weight_version if completion.weight_version is not None else fallback_version
            ),
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
            chat_template_kwargs=body.get("chat_template_kwargs") or None,
            user=body["user"] if isinstance(body.get("user"), str) else "",
            api=api,
            replica=replica,
        )
    except (msgspec.ValidationError, ValueError) as exc:
        raise UnrecordableTurn("invalid_turn", str(exc)) from None
