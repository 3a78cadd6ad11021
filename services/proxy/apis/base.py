"""What an API served by translation provides to the proxy's one serving path (``services/proxy/app.py``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import Response

from services.proxy.validation import BadInput


def new_id(prefix: str) -> str:
    """An id in the vendor's style (``resp_...``, ``msg_...``, ``toolu_...``): 128 random bits, never guessable
    (a stored response is found by its id alone)."""
    return f"{prefix}{secrets.token_hex(16)}"


@dataclass
class Exchange:
    """One request of a translated API: what the client sent, the chat request made of it, and what its answer
    needs to be shaped like the API's own."""

    api: str
    """Its API's name (``Turn.api``)."""
    request: dict[str, Any]
    """The client's body, as decoded."""
    body: dict[str, Any]
    """The chat request the engine gets (``messages``, ``tools``, sampling), checked like any chat request."""
    model: str
    id: str
    created: float = field(default_factory=time.time)
    previous_id: str | None = None
    """A stored response this one continues (Responses' ``previous_response_id``)."""
    store: bool = False
    """Keep this conversation under ``id`` for a later ``previous_response_id`` (Responses' ``store``)."""
    carried: int = 0
    """How many of ``body['messages']`` came from the stored response (after the instructions)."""
    carried_session: str | None = None
    """The session the stored response it continues was kept under: a side answer continuing it is kept (sealed,
    erased) with that session, since it copies its conversation."""
    names: dict[str, str] = field(default_factory=dict)
    """Tool name -> namespace, for function tools the client sent inside a namespace (Codex)."""


class Events(Protocol):
    """A streamed answer in the API's own events, fed the engine's chat chunks as they arrive."""

    def start(self) -> bytes: ...

    def chunk(self, chunk: Mapping[str, Any]) -> bytes: ...

    def end(self) -> bytes:
        """After the engine's last chunk: the closing events (usage included)."""
        ...

    def fail(self, message: str) -> bytes:
        """The engine broke off: the API's in-stream error, ending the stream."""
        ...


class Api(Protocol):
    name: str
    """Recorded in ``Turn.api``."""

    def credential(self, headers: Mapping[str, str]) -> str | None:
        """The ``Authorization`` value the proxy's keys check (``Bearer <key>``)."""
        ...

    def error(
        self,
        status: int,
        message: str,
        err_type: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """An error in the API's own shape; ``err_type``/``code`` are the proxy's OpenAI-style names."""
        ...

    def session_hint(self, headers: Mapping[str, str], request: Mapping[str, Any]) -> str | None:
        """The session id this API's clients send on their own (Codex's ``session-id``, Claude Code's
        ``X-Claude-Code-Session-Id``), when the proxy's headers name none."""
        ...

    def side_call(self, request: Mapping[str, Any]) -> bool:
        """A call that is not the conversation (a client's housekeeping): served, never recorded."""
        ...

    def translate(self, request: dict[str, Any]) -> Exchange:
        """The chat request; ``BadInput`` for what the API or the model cannot take."""
        ...

    def render(self, exchange: Exchange, data: Mapping[str, Any]) -> bytes:
        """A non-streamed answer: the engine's chat completion as the API's object."""
        ...

    def events(self, exchange: Exchange) -> Events: ...


def require(condition: bool, message: str, code: str = "invalid_value") -> None:
    if not condition:
        raise BadInput(400, message, code)


def answer_message(data: Mapping[str, Any]) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """The engine's first choice: (message, finish_reason, usage)."""
    choices = data.get("choices") or ()
    choice = choices[0] if choices and isinstance(choices[0], Mapping) else {}
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else {}
    usage = data.get("usage") if isinstance(data.get("usage"), Mapping) else {}
    return dict(message or {}), choice.get("finish_reason"), dict(usage or {})


def cached_tokens(usage: Mapping[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return int(cached or 0)


def tool_arguments(raw: object) -> str:
    """A tool call's arguments as the JSON text chat carries."""
    if isinstance(raw, str):
        return raw
    import json

    return json.dumps(raw, ensure_ascii=False)
