"""Anthropic's Messages API (``POST /v1/messages``), as Claude Code speaks it, over the chat request.

Request: ``system`` (a string or text blocks) becomes a leading system message; each message's blocks become chat
messages: text joined, ``image`` blocks (base64 or URL) image parts, an assistant's ``tool_use`` blocks its tool
calls, a user's ``tool_result`` blocks tool messages placed before the user's own text (chat requires each tool
call answered before anything else); ``role: "system"`` messages inside ``messages`` (Claude Code's reminders) stay
system messages where they are. Left out, as the model never reads them: ``cache_control`` wherever it appears,
``thinking`` and ``redacted_thinking`` blocks sent back (the model's earlier thinking, with a signature only
Anthropic can check: chat templates drop earlier thinking too), ``context_management``, ``output_config.effort``,
``metadata`` (but for the session id Claude Code keeps in it). ``max_tokens`` is required, as Anthropic's API has
it; ``stop_sequences`` are the engine's ``stop``.

Answer: a ``Message`` whose content holds a ``thinking`` block (when the engine's reasoning parser split some off;
its ``signature`` is an opaque marker, as the field is required), a ``text`` block and one ``tool_use`` block per
tool call; streamed as the documented events, each with its ``event:`` line (Anthropic's SDKs read nothing else).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec
from pydantic_core import from_json
from starlette.responses import Response

from services.proxy import inner_json
from services.proxy.apis.base import Exchange, answer_message, cached_tokens, new_id, require
from services.proxy.validation import BadInput

_encode = msgspec.json.Encoder().encode

FIELDS = frozenset(
    """model messages system max_tokens stop_sequences stream temperature top_p top_k tools tool_choice metadata
    thinking context_management output_config service_tier container mcp_servers speed diagnostics inference_geo
    betas cache_control""".split()
)
SIGNATURE = "turnstream"
"""The ``signature`` of a thinking block the proxy returns: the field is required, and nobody checks it."""
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """Anthropic's error shape; ``x-should-retry`` as its SDKs read it (retry what a retry can fix)."""
    err_type = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    retry = status in (408, 409, 429) or status >= 500
    body = {"type": "error", "error": {"type": err_type, "message": message}}
    return Response(
        _encode(body),
        status_code=status,
        media_type="application/json",
        headers={**(headers or {}), "x-should-retry": "true" if retry else "false"},
    )


def _text(block: Mapping[str, Any], where: str) -> str:
    require(isinstance(block.get("text"), str), f"{where}.text must be a string")
    return str(block["text"])


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    require(isinstance(system, list), "'system' must be a string or an array of text blocks")
    texts = []
    for i, block in enumerate(system):
        require(
            isinstance(block, Mapping) and block.get("type") == "text", f"system[{i}] must be a text block"
        )
        texts.append(_text(block, f"system[{i}]"))
    return "\n\n".join(texts) or None


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source: Any = block.get("source")
    require(isinstance(source, Mapping), f"{where}.source must be an object")
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif source.get("type") == "url":
        url = str(source.get("url"))
    else:
        raise BadInput(400, f"{where}: only base64 and URL images can be served", "unsupported_content")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    require(isinstance(block.get("tool_use_id"), str), f"{where}.tool_use_id must be a string")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            require(isinstance(part, Mapping), f"{where}.content[{j}] must be an object")
            if part.get("type") == "text":
                texts.append(_text(part, f"{where}.content[{j}]"))
            else:
                raise BadInput(
                    400,
                    f"{where}.content[{j}] has type {part.get('type')!r}: a tool result may hold text only here",
                    "unsupported_content",
                )
        content = "\n".join(texts)
    require(isinstance(content, str), f"{where}.content must be a string or an array of blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    require(isinstance(messages, list) and bool(messages), "'messages' must be a non-empty array")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        require(isinstance(message, Mapping), f"{where} must be an object")
        role = message.get("role")
        require(role in ("user", "assistant", "system"), f"{where}.role must be user, assistant or system")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        require(isinstance(content, list), f"{where}.content must be a string or an array of blocks")
        texts: list[str] = []
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            require(isinstance(block, Mapping), f"{at} must be an object")
            kind = block.get("type")
            if kind == "text":
                texts.append(_text(block, at))
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and role == "user":
                parts.append(_image(block, at))
            elif kind == "tool_use" and role == "assistant":
                require(
                    isinstance(block.get("id"), str) and isinstance(block.get("name"), str), f"{at}: id, name"
                )
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and role == "user":
                results.append(_tool_result(block, at))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # accepted, never the engine's (module docstring)
            else:
                raise BadInput(
                    400,
                    f"{at} has type {kind!r}, which a {role} message cannot hold here",
                    "unsupported_content",
                )
        out.extend(results)
        if role == "assistant":
            text = "".join(texts)
            if text or calls:
                msg: dict[str, Any] = {"role": "assistant", "content": text or None}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        elif any(p["type"] != "text" for p in parts):
            out.append({"role": role, "content": parts})
        elif texts or not results:
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    require(tools is None or isinstance(tools, list), "'tools' must be an array")
    out = []
    for i, tool in enumerate(tools or ()):
        require(isinstance(tool, Mapping), f"tools[{i}] must be an object")
        if tool.get("type") not in (None, "custom"):
            raise BadInput(
                400,
                f"tools[{i}] has type {tool.get('type')!r}: only client tools can be served",
                "invalid_value",
            )
        require(isinstance(tool.get("name"), str), f"tools[{i}].name must be a string")
        require(isinstance(tool.get("input_schema"), Mapping), f"tools[{i}].input_schema must be an object")
        fn: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[object, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    require(isinstance(choice, Mapping), "'tool_choice' must be an object")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise BadInput(400, "'tool_choice.type' must be auto, any, tool or none", "invalid_value")


class MessagesApi:
    name = "messages"

    def credential(self, headers: Mapping[str, str]) -> str | None:
        key = headers.get("x-api-key")
        return f"Bearer {key}" if key else headers.get("authorization")

    def error(
        self,
        status: int,
        message: str,
        err_type: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        return anthropic_error(status, message, headers)

    def session_hint(self, headers: Mapping[str, str], request: Mapping[str, Any]) -> str | None:
        hint = headers.get("x-claude-code-session-id")
        if hint:
            return hint
        meta = request.get("metadata")
        user = meta.get("user_id") if isinstance(meta, Mapping) else None
        if isinstance(user, str) and user.startswith("{"):  # Claude Code: JSON holding its session id
            try:
                sid = inner_json.loads(user).get("session_id")
            except (ValueError, AttributeError):
                return None
            return sid if isinstance(sid, str) and sid else None
        return None

    def side_call(self, request: Mapping[str, Any]) -> bool:
        """Claude Code's housekeeping: a one-token probe (key and model checks) or a structured-output call (a
        session title); its conversation never asks for either."""
        config = request.get("output_config")
        return request.get("max_tokens") == 1 or (
            isinstance(config, Mapping) and config.get("format") is not None
        )

    def translate(self, request: dict[str, Any]) -> Exchange:
        require(
            isinstance(request.get("max_tokens"), int) and not isinstance(request.get("max_tokens"), bool),
            "'max_tokens' is required and must be an integer",
            "missing_required_parameter",
        )
        messages = chat_messages(request.get("messages"))
        if (system := _system(request.get("system"))) is not None:
            messages.insert(0, {"role": "system", "content": system})
        body: dict[str, Any] = {
            "model": request.get("model"),
            "messages": messages,
            "max_tokens": request["max_tokens"],
        }
        if tools := _tools(request.get("tools")):
            body["tools"] = tools
            choice, parallel = _tool_choice(request.get("tool_choice"))
            if choice is not None:
                body["tool_choice"] = choice
            if parallel is not None:
                body["parallel_tool_calls"] = parallel
        for name in ("temperature", "top_p", "top_k"):
            if request.get(name) is not None:
                body[name] = request[name]
        stops = request.get("stop_sequences")
        if stops:
            require(
                isinstance(stops, list) and all(isinstance(s, str) for s in stops),
                "'stop_sequences' must be an array of strings",
            )
            body["stop"] = stops
        thinking = request.get("thinking")
        if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        stream = request.get("stream", False)
        require(isinstance(stream, bool | None), "'stream' must be a boolean")
        body["stream"] = bool(stream)
        model = request.get("model")
        return Exchange(
            api=self.name,
            request=request,
            body=body,
            model=model if isinstance(model, str) else "",
            id=new_id("msg_"),
        )

    def render(self, exchange: Exchange, data: Mapping[str, Any]) -> bytes:
        message, finish, usage = answer_message(data)
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append(
                {"type": "thinking", "thinking": message["reasoning_content"], "signature": SIGNATURE}
            )
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_id(call),
                    "name": fn.get("name", ""),
                    "input": _input(fn.get("arguments")),
                }
            )
        stop, sequence = _stop(finish, data)
        return _encode(
            {
                "id": exchange.id,
                "type": "message",
                "role": "assistant",
                "model": exchange.model,
                "content": content,
                "stop_reason": stop,
                "stop_sequence": sequence,
                "usage": _usage(usage),
            }
        )

    def events(self, exchange: Exchange) -> MessageEvents:
        return MessageEvents(exchange)


def _tool_id(call: Mapping[str, Any]) -> str:
    return str(call.get("id") or new_id("toolu_"))


def _input(arguments: Any) -> dict[str, Any]:
    """A tool call's input as the object the API promises (arguments that are not a JSON object are kept)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = inner_json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def _stop(finish: str | None, data: Mapping[str, Any]) -> tuple[str, str | None]:
    """Anthropic's stop reason; a stop string the engine matched is a ``stop_sequence``."""
    choices = data.get("choices") or ()
    matched = choices[0].get("matched_stop") if choices and isinstance(choices[0], Mapping) else None
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP.get(finish or "stop", "end_turn"), None


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    cached = cached_tokens(usage)
    return {
        "input_tokens": max(0, int(usage.get("prompt_tokens") or 0) - cached),
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    data = {"type": kind, **data}
    return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class MessageEvents:
    """The chat stream as Messages events: blocks indexed 0, 1, ... in the order they start, one open at a time
    (thinking, then text, then each tool call), and always a ``message_delta`` with the stop reason and a
    ``message_stop`` (Claude Code retries a stream that ends without them)."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.matched: str | None = None
        self.usage: dict[str, Any] = {}

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.exchange.id,
            "type": "message",
            "role": "assistant",
            "model": self.exchange.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _sse("message_start", {"message": message})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        index = len(self.blocks) - 1
        if self.open.startswith("tool") and (call := self.calls[int(self.open[4:])]).get("held"):
            out += self._delta({"type": "input_json_delta", "partial_json": json.dumps(_input(call["raw"]))})
        if self.open == "thinking":
            out += _sse(
                "content_block_delta",
                {"index": index, "delta": {"type": "signature_delta", "signature": SIGNATURE}},
            )
        self.open = None
        return out + _sse("content_block_stop", {"index": index})

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.blocks.append(block)
        self.open = kind
        return out + _sse("content_block_start", {"index": len(self.blocks) - 1, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta})

    def chunk(self, chunk: Mapping[str, Any]) -> bytes:
        out = b""
        if isinstance(chunk.get("usage"), Mapping):
            self.usage = dict(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                if isinstance(choice.get("matched_stop"), str):
                    self.matched = choice["matched_stop"]
            delta = choice.get("delta") or {}
            if thinking := delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out += self._delta({"type": "thinking_delta", "thinking": thinking})
            if text := delta.get("content"):
                if self.open != "text":
                    out += self._begin("text", {"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or ():
                index = int(call.get("index", len(self.calls)))
                fn = call.get("function") or {}
                if index not in self.calls:
                    self.calls[index] = {"id": _tool_id(call), "name": fn.get("name") or ""}
                    block = {
                        "type": "tool_use",
                        "id": self.calls[index]["id"],
                        "name": self.calls[index]["name"],
                        "input": {},
                    }
                    out += self._begin(f"tool{index}", block)
                if (arguments := fn.get("arguments")) and self.open == f"tool{index}":
                    out += self._arguments(self.calls[index], arguments)
        return out

    def _arguments(self, call: dict[str, Any], piece: str) -> bytes:
        """Stream a call's arguments while they read as the start of a JSON object, as the SDKs' accumulators parse
        them (jiter, partial): a model's arguments that are not an object (a bare string, a list) are held and
        given at the block's end as the object a non-streamed answer gives (``_input``); arguments that stop being
        JSON after a valid start are not sent on (the client keeps the object so far; the turn records them all)."""
        call["raw"] = raw = call.get("raw", "") + piece
        if call.get("held") or call.get("cut") or not raw.strip():
            return b""
        try:
            valid = isinstance(from_json(raw, allow_partial=True), dict)
        except ValueError:
            valid = False
        if valid:
            sent, call["sent"] = call.get("sent", 0), len(raw)
            return self._delta({"type": "input_json_delta", "partial_json": raw[sent:]})
        call["cut" if call.get("sent") else "held"] = True
        return b""

    def end(self) -> bytes:
        out = self._close()
        if self.matched is not None and self.finish == "stop":
            stop, sequence = "stop_sequence", self.matched
        else:
            stop, sequence = _STOP.get(self.finish or "stop", "end_turn"), None
        usage = _usage(self.usage)
        out += _sse(
            "message_delta", {"delta": {"stop_reason": stop, "stop_sequence": sequence}, "usage": usage}
        )
        return out + _sse("message_stop", {})

    def fail(self, message: str) -> bytes:
        return self._close() + _sse("error", {"error": {"type": "api_error", "message": message}})


MESSAGES = MessagesApi()
