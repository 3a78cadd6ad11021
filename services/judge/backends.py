"""Where judge votes come from: an LLM behind the engine API (SGLang or turnstream's engine), or the rules.

A backend returns the judge's raw text for one vote or raises ``VoteFailed``. The engine backend retries
transient failures until the vote's deadline (``engine_client.until_deadline``); a request the engine rejects
(4xx) fails at once, since asking again would get the same answer.
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import Counter

from schemas import PairedTurn
from services.engine_client import DeadlineExceeded, EngineClient, EngineError, until_deadline
from services.judge import rules

RETRIES = Counter(
    "turnstream_judge_engine_retries_total", "Judge engine calls retried after a transient failure"
)


class VoteFailed(Exception):
    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient
        """True when the judge engine was unavailable (not when it rejected the request)."""


class Backend(Protocol):
    model: str

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str: ...


class RulesBackend:
    model = rules.MODEL_NAME

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        return rules.answer(kind, paired)


class EngineBackend:
    def __init__(
        self,
        client: EngineClient,
        *,
        model: str,
        temperature: float,
        max_tokens: int,
        deadline_s: float,
        backoff_s: float = 0.5,
        max_backoff_s: float = 15.0,
    ) -> None:
        self.client = client
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        body: dict[str, Any] = {
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "stream": False,
        }
        if self.model:
            body["model"] = self.model
        try:
            # A vote is a sample: asking again after a timeout only draws another sample, so it is safe.
            data = await until_deadline(
                lambda: self.client.chat_raw(body, idempotent=True),
                self.deadline_s,
                backoff_s=self.backoff_s,
                max_backoff_s=self.max_backoff_s,
                on_retry=self._count_retry,
            )
        except DeadlineExceeded as exc:
            raise VoteFailed(str(exc), transient=True) from None
        except EngineError as exc:
            raise VoteFailed(str(exc), transient=False) from None
        return _content(data)

    def _count_retry(self, _: EngineError) -> None:
        RETRIES.inc()


def _content(data: Any) -> str:
    try:
        message = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise VoteFailed(f"the judge engine answered without a message: {str(data)[:200]}", False) from None
    return str(message.get("content") or "")
