"""OpenAI's Responses API (``POST /v1/responses``), as Codex CLI and openai-agents speak it, over the chat request.

Request: ``instructions`` becomes a leading system message and ``input`` items become chat messages (a message's
text parts joined, its images as ``image_url`` parts; ``function_call`` items the assistant's tool calls;
``function_call_output`` tool messages). What clients send back of earlier answers and the model never reads is
accepted and left out: item ids, ``status``, ``annotations``, ``logprobs``, ``phase``, and ``reasoning`` items (the
model's earlier thinking: chat templates drop it from history too, and an ``encrypted_content`` is a vendor's
opaque blob). Function tools go to the engine (a ``namespace``'s functions flattened, the namespace put back on the
calls); hosted tools (web search and the like) are tools only OpenAI runs: left out, so the model is never offered
what nobody can execute.

Answer: a ``Response`` whose output holds, in order, a ``reasoning`` item (when the engine's reasoning parser split
some off), the ``message`` and one ``function_call`` per tool call; streamed as the documented events
(``response.created`` ... ``response.completed``), each with its ``sequence_number``, checked against the
``openai`` SDK's own types by tests/services/proxy/test_apis.py.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.responses import Response

from services.proxy import inner_json
from services.proxy.apis.base import Exchange, answer_message, cached_tokens, new_id, require, tool_arguments
from services.proxy.asgi import openai_error
from services.proxy.validation import BadInput

_encode = msgspec.json.Encoder().encode

NOT_SERVED = ("background", "conversation", "prompt")
"""Request fields naming what only OpenAI's platform keeps (background jobs, its conversations, stored prompts)."""
HOSTED_TOOLS = frozenset(
    """web_search web_search_preview web_search_2025_08_26 web_search_preview_2025_03_11 file_search
    code_interpreter image_generation computer computer_use computer_use_preview mcp local_shell shell
    apply_patch custom tool_search""".split()
)
FIELDS = frozenset(
    """model input instructions tools tool_choice parallel_tool_calls max_output_tokens temperature top_p
    top_logprobs text reasoning store previous_response_id include metadata user stream stream_options truncation
    prompt_cache_key prompt_cache_retention safety_identifier service_tier client_metadata max_tool_calls
    context_management moderation prompt_cache_options background conversation prompt""".split()
)
"""What the API defines; other fields are an extra the proxy's size cap applies to."""


def _text_of(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content as chat content: the text, or text and image parts when there are images."""
    if isinstance(content, str):
        return content
    require(isinstance(content, list), f"{where}.content must be a string or an array of content parts")
    parts: list[dict[str, Any]] = []
    has_image = False
    for i, part in enumerate(content):
        require(isinstance(part, Mapping), f"{where}.content[{i}] must be an object")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            require(isinstance(part.get("text"), str), f"{where}.content[{i}].text must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image" and images:
            url = part.get("image_url")
            require(
                isinstance(url, str),
                f"{where}.content[{i}]: only images given by 'image_url' can be served (no file ids)",
            )
            parts.append({"type": "image_url", "image_url": {"url": url}})
            has_image = True
        else:
            raise BadInput(
                400,
                f"{where}.content[{i}] has type {kind!r}, which this model cannot take (text and images only)",
                "unsupported_content",
            )
    if has_image:
        return parts
    return "".join(p["text"] for p in parts)


def _tools(tools: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    require(tools is None or isinstance(tools, list), "'tools' must be an array")
    out: list[dict[str, Any]] = []

    def function(tool: Mapping[str, Any], where: str, namespace: str | None) -> None:
        require(isinstance(tool.get("name"), str) and tool["name"] != "", f"{where}.name must be a string")
        fn: dict[str, Any] = {
            "name": tool["name"],
            "parameters": tool.get("parameters") or {"type": "object"},
        }
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if tool.get("strict") is not None:
            fn["strict"] = bool(tool["strict"])
        out.append({"type": "function", "function": fn})
        if namespace is not None:
            names[tool["name"]] = namespace

    for i, tool in enumerate(tools or ()):
        require(isinstance(tool, Mapping), f"tools[{i}] must be an object")
        kind = tool.get("type")
        if kind == "function":
            function(tool, f"tools[{i}]", None)
        elif kind == "namespace":
            for j, inner in enumerate(tool.get("tools") or ()):
                if isinstance(inner, Mapping) and inner.get("type", "function") == "function":
                    function(inner, f"tools[{i}].tools[{j}]", str(tool.get("name", "")))
        elif kind not in HOSTED_TOOLS:
            raise BadInput(
                400, f"tools[{i}] has type {kind!r}, which this server does not know", "invalid_value"
            )
    return out


def _tool_choice(choice: Any) -> object:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if (
        isinstance(choice, Mapping)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadInput(
        400,
        "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...} (the model has no "
        "hosted tools)",
        "invalid_value",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    require(isinstance(text, Mapping), "'text' must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    require(isinstance(fmt, Mapping), "'text.format' must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        require(isinstance(fmt.get("schema"), Mapping), "'text.format.schema' must be an object")
        schema = {"name": str(fmt.get("name") or "response"), "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = bool(fmt["strict"])
        return {"type": "json_schema", "json_schema": schema}
    raise BadInput(
        400, f"'text.format.type' {kind!r} is not one of text, json_object, json_schema", "invalid_value"
    )


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages (see the module docstring for what is left out)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    require(isinstance(items, list), "'input' must be a string or an array of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        require(isinstance(item, Mapping), f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            require(
                role in ("user", "assistant", "system", "developer"),
                f"{where}.role must be user, assistant, system or developer",
            )
            content = _text_of(item.get("content"), where, images=role == "user")
            if (
                role == "assistant"
                and messages
                and messages[-1]["role"] == "assistant"
                and not messages[-1].get("tool_calls")
            ):  # an answer in several message items (phases): one assistant message
                messages[-1]["content"] = f"{messages[-1]['content'] or ''}{content}"
                continue
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                require(isinstance(item.get(name), str), f"{where}.{name} must be a string")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            require(isinstance(item.get("call_id"), str), f"{where}.call_id must be a string")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where, images=False)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # accepted, never the engine's (module docstring)
        elif kind == "item_reference":
            raise BadInput(
                400,
                f"{where}: item references are not served; send the items, or continue by previous_response_id",
                "unsupported_item",
            )
        else:
            raise BadInput(
                400, f"{where} has type {kind!r}, which this server does not serve", "unsupported_item"
            )
    return messages


class ResponsesApi:
    name = "responses"

    def credential(self, headers: Mapping[str, str]) -> str | None:
        return headers.get("authorization")

    def error(
        self,
        status: int,
        message: str,
        err_type: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        return openai_error(status, message, err_type, code, headers)

    def session_hint(self, headers: Mapping[str, str], request: Mapping[str, Any]) -> str | None:
        # Codex: ``session-id`` (also ``thread-id``, and the same id as ``prompt_cache_key``), stable on resume.
        hint = headers.get("session-id") or headers.get("thread-id")
        key = request.get("prompt_cache_key")
        return hint or (key if isinstance(key, str) and key else None)

    def side_call(self, request: Mapping[str, Any]) -> bool:
        """Codex labels its requests: anything but a turn (a compaction's summary) is housekeeping."""
        meta = request.get("client_metadata")
        if not isinstance(meta, Mapping) or not isinstance(meta.get("x-codex-turn-metadata"), str):
            return False
        try:
            kind = inner_json.loads(meta["x-codex-turn-metadata"]).get("request_kind")
        except (ValueError, AttributeError):
            return False
        return isinstance(kind, str) and kind != "turn"

    def translate(self, request: dict[str, Any]) -> Exchange:
        for name in NOT_SERVED:
            if request.get(name):
                raise BadInput(400, f"'{name}' is not served by this server", "unsupported_parameter")
        require("input" in request, "'input' is required", "missing_required_parameter")
        instructions = request.get("instructions")
        require(instructions is None or isinstance(instructions, str), "'instructions' must be a string")
        messages = input_messages(request["input"])
        if instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        _check_metadata(request.get("metadata"))
        previous = request.get("previous_response_id")
        require(previous is None or isinstance(previous, str), "'previous_response_id' must be a string")
        store = request.get("store", True)
        require(isinstance(store, bool), "'store' must be a boolean")
        names: dict[str, str] = {}
        body: dict[str, Any] = {"model": request.get("model"), "messages": messages}
        if tools := _tools(request.get("tools"), names):
            body["tools"] = tools
            if request.get("tool_choice") is not None:
                body["tool_choice"] = _tool_choice(request["tool_choice"])
            if request.get("parallel_tool_calls") is not None:
                body["parallel_tool_calls"] = request["parallel_tool_calls"]
        elif request.get("tool_choice") not in (None, "auto", "none"):
            raise BadInput(
                400, "'tool_choice' names a tool but 'tools' holds no function tools", "invalid_value"
            )
        for ours, theirs in (
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
        ):
            if request.get(ours) is not None:
                body[theirs] = request[ours]
        if isinstance(request.get("user"), str):
            body["user"] = request["user"]
        if (fmt := _response_format(request.get("text"))) is not None:
            body["response_format"] = fmt
        stream = request.get("stream", False)
        require(isinstance(stream, bool | None), "'stream' must be a boolean")
        body["stream"] = bool(stream)
        model = request.get("model")
        return Exchange(
            api=self.name,
            request=request,
            body=body,
            model=model if isinstance(model, str) else "",
            id=new_id("resp_"),
            previous_id=previous,
            store=store,
            names=names,
        )

    def render(self, exchange: Exchange, data: Mapping[str, Any]) -> bytes:
        message, finish, usage = answer_message(data)
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning(new_id("rs_"), message["reasoning_content"], "completed"))
        calls = [c for c in message.get("tool_calls") or () if isinstance(c, Mapping)]
        if message.get("content") or not calls:
            output.append(_message(new_id("msg_"), message.get("content") or "", "completed"))
        for call in calls:
            fn = call.get("function") or {}
            output.append(
                _call(
                    exchange,
                    new_id("fc_"),
                    str(call.get("id") or new_id("call_")),
                    fn.get("name"),
                    tool_arguments(fn.get("arguments", "")),
                    "completed",
                )
            )
        return _encode(
            _response(exchange, "incomplete" if finish == "length" else "completed", output, usage)
        )

    def events(self, exchange: Exchange) -> ResponseEvents:
        return ResponseEvents(exchange)


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status != "added"
        else []
    )
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": "in_progress" if status == "added" else status,
        "content": content,
    }


def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    item: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": []}
    if status != "added":
        item["content"] = [{"type": "reasoning_text", "text": text}]
    item["status"] = "in_progress" if status == "added" else status
    return item


def _call(
    exchange: Exchange, item_id: str, call_id: str, name: Any, arguments: str, status: str
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "id": item_id,
        "type": "function_call",
        "status": "in_progress" if status == "added" else status,
        "call_id": call_id,
        "name": name if isinstance(name, str) else "",
        "arguments": arguments,
    }
    if isinstance(name, str) and name in exchange.names:
        item["namespace"] = exchange.names[name]
    return item


def _usage(usage: Mapping[str, Any]) -> dict[str, Any] | None:
    if not usage:
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    details = usage.get("completion_tokens_details")
    reasoning = details.get("reasoning_tokens") if isinstance(details, Mapping) else None
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached_tokens(usage), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning or usage.get("reasoning_tokens") or 0)},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def _check_metadata(metadata: object) -> None:
    """OpenAI's rule for ``metadata`` (the SDK's ``ResponseCreateParams``): at most 16 pairs, string keys of at most
    64 characters, string values of at most 512. It is echoed in each of a stream's three response objects, so an
    unbounded one was tripled (1 MiB in, 3 MiB streamed out: issue 55)."""
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise BadInput(400, "'metadata' must be an object", "invalid_value")
    require(len(metadata) <= 16, f"'metadata' may hold at most 16 pairs, not {len(metadata)}")
    for key, value in metadata.items():
        require(len(key) <= 64, f"'metadata' keys may be at most 64 characters ({key[:20]!r}... is longer)")
        require(
            isinstance(value, str) and len(value) <= 512,
            f"'metadata.{key}' must be a string of at most 512 characters",
        )


def _response(
    exchange: Exchange,
    status: str,
    output: list[dict[str, Any]],
    usage: Mapping[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    request = exchange.request
    done = status in ("completed", "incomplete", "failed")
    return {
        "id": exchange.id,
        "object": "response",
        "created_at": int(exchange.created),
        "status": status,
        "completed_at": int(time.time()) if done else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata") if isinstance(request.get("metadata"), dict) else {},
        "model": exchange.model,
        "output": output,
        "parallel_tool_calls": bool(request.get("parallel_tool_calls", True)),
        "previous_response_id": exchange.previous_id,
        "reasoning": {"effort": None, "summary": None},
        "store": exchange.store,
        "temperature": exchange.body.get("temperature"),
        "text": {"format": {"type": "text"}} if request.get("text") is None else request["text"],
        "tool_choice": request.get("tool_choice") if request.get("tool_choice") is not None else "auto",
        "tools": request.get("tools") or [],
        "top_p": exchange.body.get("top_p"),
        "truncation": "disabled",
        "usage": _usage(usage) if usage is not None else None,
        "user": request.get("user"),
    }


class ResponseEvents:
    """The chat stream as Responses events. One item is open at a time (reasoning, then the message, then each
    function call), as the SDK's accumulator expects: an item is added before its deltas and done before the next
    is added; everything shares the response's id, and ``sequence_number`` counts from 0."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.open_id = ""
        """The item being streamed: its final form, filled in as deltas arrive."""
        self.texts: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        fields["type"] = kind
        fields["sequence_number"] = self.seq
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(fields) + b"\n\n"

    def start(self) -> bytes:
        created = _response(self.exchange, "in_progress", [], None)
        return self._event("response.created", response=created) + self._event(
            "response.in_progress", response=created
        )

    def _close(self) -> bytes:
        item = self.open
        if item is None:
            return b""
        self.open = None
        index = len(self.output) - 1
        text = "".join(self.texts)
        self.texts = []
        out = b""
        if item["type"] in ("message", "reasoning"):
            message = item["type"] == "message"
            kind = "output_text" if message else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": []} if message else {}
            part = {"type": kind, "text": text, **({"annotations": []} if message else {}), **extra}
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out += self._event(f"response.{kind}.done", **at, text=text, **extra)
            out += self._event("response.content_part.done", **at, part=part)
            item.update((_message if message else _reasoning)(item["id"], text, "completed"))
        else:
            out += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
            item["status"] = "completed"
        self.output[index] = item
        return out + self._event("response.output_item.done", item=item, output_index=index)

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> bytes:
        out = self._close()
        self.open, self.open_id = item, item["id"]
        self.output.append(item)
        index = len(self.output) - 1
        out += self._event("response.output_item.added", item=dict(item), output_index=index)
        if part is not None:
            out += self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        return out

    def chunk(self, chunk: Mapping[str, Any]) -> bytes:
        out = b""
        if isinstance(chunk.get("usage"), Mapping):
            self.usage = dict(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if reasoning := delta.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open(
                        _reasoning(new_id("rs_"), "", "added"), {"type": "reasoning_text", "text": ""}
                    )
                self.texts.append(reasoning)
                out += self._event(
                    "response.reasoning_text.delta",
                    item_id=self.open_id,
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=reasoning,
                )
            if content := delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open(
                        _message(new_id("msg_"), "", "added"),
                        {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                self.texts.append(content)
                out += self._event(
                    "response.output_text.delta",
                    item_id=self.open_id,
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
            for call in delta.get("tool_calls") or ():
                index = int(call.get("index", len(self.calls)))
                fn = call.get("function") or {}
                item = self.calls.get(index)
                if item is None:
                    item = self.calls[index] = _call(
                        self.exchange,
                        new_id("fc_"),
                        str(call.get("id") or new_id("call_")),
                        fn.get("name"),
                        "",
                        "added",
                    )
                    out += self._open(item, None)
                elif fn.get("name") and not item["name"]:
                    item["name"] = fn["name"]
                if arguments := fn.get("arguments"):
                    item["arguments"] += arguments
                    if self.open is item:
                        out += self._event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=len(self.output) - 1,
                            delta=arguments,
                        )
        return out

    def end(self) -> bytes:
        out = self._close()
        if not self.output:  # an empty answer is still a message
            out += self._open(
                _message(new_id("msg_"), "", "added"),
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
            out += self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        final = _response(self.exchange, status, self.output, self.usage)
        return out + self._event(f"response.{status}", response=final)

    def fail(self, message: str) -> bytes:
        out = self._close()
        final = _response(
            self.exchange,
            "failed",
            self.output,
            self.usage or None,
            error={"code": "server_error", "message": message},
        )
        return out + self._event("response.failed", response=final)

    def answer(self) -> dict[str, Any]:
        """The chat answer these events carried (what a stored response keeps)."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(
                c["text"] for item in self.output if item["type"] == "message" for c in item["content"]
            ),
        }
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.output
            if item["type"] == "function_call"
        ]
        if calls:
            message["tool_calls"] = calls
        return message


RESPONSES = ResponsesApi()
