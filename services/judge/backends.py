"""Where judge votes come from: an LLM behind the engine API (SGLang), the rules, or a plugin's class.

A backend returns the judge's raw text for one vote or raises ``VoteFailed``. ``judge.backend`` names one:
``engine``, ``rules`` or ``package.module:Class``, a class built with the ``Config`` that has a ``model`` (the
name recorded on judgments) and ``async vote(kind, paired, messages) -> str`` (docs/extending.md).

The engine backend retries transient failures until the vote's deadline (``engine_client.until_deadline``); a
request the engine rejects (4xx) fails at once, since asking again would get the same answer.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, cast

from prometheus_client import Counter

from runtime.configuration.config import Config
from runtime.configuration.plugins import PluginError, check_call, load_class
from runtime.engine.client import DeadlineExceeded, EngineClient, EngineError, until_deadline
from schemas import PairedTurn
from services.judge import rules

RETRIES = Counter(
    "turnstream_judge_engine_retries_total", "Judge engine calls retried after a transient failure"
)
TRUNCATED = Counter(
    "turnstream_judge_truncated_total",
    "Judge answers cut off at judge.max_tokens (finish_reason length): raise it for a reasoning judge",
    ["kind"],
)


class VoteFailed(Exception):
    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient
        """True when the judge engine was unavailable (not when it rejected the request)."""


class Backend(Protocol):
    model: str
    """The judge's model name, recorded on every judgment."""

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        """The judge's text for one vote of ``kind`` (``eval`` or ``hint``) on ``paired``; ``messages`` is the
        rendered prompt. Raises ``VoteFailed`` (transient: the engine was unavailable) when it has none."""
        ...


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
        text, finish = _content(data)
        if finish == "length":
            TRUNCATED.labels(kind).inc()
        return text

    def _count_retry(self, _: EngineError) -> None:
        RETRIES.inc()


def _content(data: Any) -> tuple[str, str | None]:
    """(the vote's text, finish reason). A reasoning judge (SGLang with a reasoning parser) may give its verdict
    only inside its reasoning, or run out of tokens before answering: when the answer holds no box, the text is
    the reasoning followed by the answer, so the parser finds the last verdict there."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise VoteFailed(f"the judge engine answered without a message: {str(data)[:200]}", False) from None
    content = str(message.get("content") or "")
    reasoning = message.get("reasoning_content")
    if reasoning and "\\boxed{" not in content:
        content = f"{reasoning}\n\n{content}" if content else str(reasoning)
    finish = choice.get("finish_reason")
    return content, finish if isinstance(finish, str) else None


def from_config(config: Config, name: str | None = None) -> Backend:
    """The backend ``name`` (default: ``judge.backend``) names, built from ``config``."""
    jc = config.judge
    name = name or jc.backend
    if name == "rules":
        return RulesBackend()
    if name == "engine":
        client = EngineClient(jc.engine_url, api_key=jc.api_key, timeout_s=jc.deadline_s, retries=0)
        return EngineBackend(
            client,
            model=jc.model,
            temperature=jc.temperature,
            max_tokens=jc.max_tokens,
            deadline_s=jc.deadline_s,
        )
    if ":" not in name:
        raise PluginError(f"judge.backend: {name!r} is not engine, rules or a 'package.module:Class' path")
    cls = load_class("judge.backend", name)
    check_call("judge.backend", name, cls, ("config",))
    backend = cls(config)
    vote = getattr(backend, "vote", None)
    if not inspect.iscoroutinefunction(vote):
        raise PluginError(f"judge.backend: {name!r} has no 'async def vote(self, kind, paired, messages)'")
    check_call("judge.backend", f"{name}.vote", vote, ("kind", "paired", "messages"))
    if not isinstance(getattr(backend, "model", None), str):
        raise PluginError(f"judge.backend: {name!r} has no 'model' string (recorded on judgments)")
    return cast(Backend, backend)
