"""What the proxy checks of a chat request before it reaches the engine, so that bad input is a clear 400 (or
413) in OpenAI's shape, and never a request the engine refuses after a user waited, or one the contract would not
record."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request

from runtime.engine.chat_template import for_engine
from schemas import Message
from services.proxy.json_budget import json_values

_json_decoder = msgspec.json.Decoder()
_fields_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])

ENGINE_FIELDS = frozenset(
    """bootstrap_host bootstrap_port bootstrap_room cache_salt chat_template_kwargs continue_final_message
    custom_logit_processor custom_params data_parallel_rank disagg_prefill_dp_rank ebnf extra_key frequency_penalty
    ignore_eos images_config input_ids logit_bias logprobs lora_path max_completion_tokens max_dynamic_patch
    max_tokens messages min_dynamic_patch min_p min_tokens mm_processor_kwargs model n no_stop_trim
    parallel_tool_calls presence_penalty priority reasoning_effort regex repetition_penalty response_format
    return_cached_tokens_details return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64
    return_hidden_states return_input_ids_in_sglext return_meta_info return_output_ids_in_sglext
    return_prompt_token_ids return_routed_experts return_sampling_mask return_spec_tokens_details return_token_ids rid
    routed_dp_rank routed_experts_start_len sampling_logprobs_mode seed separate_reasoning session_id session_params
    skip_special_tokens stop stop_regex stop_token_ids stream stream_options stream_reasoning task temperature thinking
    tool_choice tools top_k top_logprobs top_p use_audio_in_video user video_config watermark""".split()
)
"""The fields of SGLang 0.5.23's ``ChatCompletionRequest`` (checked against its class by
tests/contract/test_sglang_contract.py). Any other field is one the engine ignores: together they may hold at most
``proxy.max_extra_bytes``."""
TURNSTREAM_FIELDS = frozenset({"turn_type", "session_done"})
"""The proxy's own (``services/proxy/session.py``; ``session_id`` is SGLang's too), taken out before the engine."""


class BodyLimits(msgspec.Struct, frozen=True):
    """What one request body may hold beyond its size (``proxy.*``)."""

    max_messages: int = 10_000
    max_values: int = 200_000
    max_extra_bytes: int = 64 * 1024
    media_url_prefixes: tuple[str, ...] = ()
    """``proxy.media_url_prefixes``: where a content part's media may come from besides ``data:`` URIs."""


PARSE_IN_THREAD_BYTES = 512 * 1024
"""Bodies larger than this are parsed off the event loop. Text-heavy chats parse at ~3 GB/s (1 ms for 3 MiB), but
a body of tiny objects is ~100 times slower; below this size and ``HEAVY_VALUES`` a parse is a few milliseconds,
and a thread hop costs more than it saves."""
HEAVY_VALUES = 20_000
"""A body holding more values than this (a few milliseconds to decode) is parsed off the event loop and takes one
of its key's large-body slots (``proxy.large_bodies_per_key``) like a body over ``proxy.large_body_bytes``: 600 KB
of tiny values decode for tens of milliseconds."""


class BadInput(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = "invalid_request",
        err_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.err_type = err_type
        self.headers = headers


def too_many_large(cap: int, large: int) -> BadInput:
    """The 429 (OpenAI's rate-limit shape) for a key at its cap of large bodies in flight."""
    return BadInput(
        429,
        f"this key is at its limit of {cap} large requests in flight (over {large} bytes, or of many values); try "
        "again when one has finished",
        "rate_limit_exceeded",
        "requests",
        {
            "Retry-After": "1",
            "Connection": "close",
        },  # the body is not wanted: the connection stops reading it
    )


async def read_body(
    request: Request, limit: int, large: int = 0, take_large: Callable[[], BadInput | None] | None = None
) -> bytes:
    """The whole body, at most ``limit`` bytes. A body past ``large`` bytes takes one of its key's large-body
    slots (``take_large()``: the refusal when none is left) before more of it is read: from the declared length
    at once, from the bytes read for a body sent in chunks."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadInput(
            413,
            f"request body of {declared} bytes exceeds the limit of {limit}",
            "request_too_large",
            headers={"Connection": "close"},
        )
    taken = take_large is None
    if take_large is not None and declared is not None and declared.isdigit() and int(declared) > large:
        if (refused := take_large()) is not None:
            raise refused
        taken = True
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadInput(413, f"request body exceeds the limit of {limit} bytes", "request_too_large")
            if not taken and take_large is not None and size > large:
                if (refused := take_large()) is not None:
                    raise refused
                taken = True
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the body deadline (runtime/transport/guard.py)
        raise BadInput(
            400, "the connection closed before the request body arrived", "incomplete_body"
        ) from None
    return b"".join(chunks)


_INT64 = 2**63 - 1
# Sampling settings the proxy checks itself (type and range), so that a bad value is a clear 400 rather than
# whatever an engine makes of it: (lowest, highest, integer?, lowest excluded?). The ranges are OpenAI's, narrowed
# to what SGLang 0.5.23 accepts (``SamplingParams.verify``: top_p in (0, 1], repetition_penalty in (0, 2], top_k
# -1 or at least 1), so a main turn is never answered by the engine's refusal.
_SAMPLING: dict[str, tuple[float, float, bool, bool]] = {
    "max_tokens": (1, 2**31 - 1, True, False),
    "max_completion_tokens": (1, 2**31 - 1, True, False),
    "n": (1, 128, True, False),
    "seed": (-_INT64 - 1, _INT64, True, False),
    "top_logprobs": (0, 20, True, False),
    "top_k": (-1, 2**31 - 1, True, False),
    "temperature": (0.0, 2.0, False, False),
    "top_p": (0.0, 1.0, False, True),
    "min_p": (0.0, 1.0, False, False),
    "presence_penalty": (-2.0, 2.0, False, False),
    "frequency_penalty": (-2.0, 2.0, False, False),
    "repetition_penalty": (0.0, 2.0, False, True),
}


def _check_sampling(name: str, value: object) -> None:
    low, high, integer, open_low = _SAMPLING[name]
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        kind = "an integer" if integer else "a number"
        raise BadInput(400, f"'{name}' must be {kind}", "invalid_value")
    if not low <= value <= high or (open_low and value == low):  # NaN fails this too
        interval = f"{'(' if open_low else '['}{low}, {high}]"
        raise BadInput(400, f"'{name}' must be in {interval}, got {value}", "invalid_value")
    if name == "top_k" and value == 0:
        raise BadInput(400, "'top_k' must be -1 (the whole vocabulary) or at least 1, got 0", "invalid_value")


def _decoded(raw: bytes, decoder: msgspec.json.Decoder[Any]) -> Any:
    try:
        return decoder.decode(raw)
    except (
        msgspec.ValidationError
    ) as exc:  # the fields' decoder: not an object (the other: a number too large)
        if decoder is _fields_decoder:
            raise BadInput(400, "the body must be a JSON object") from None
        raise BadInput(400, f"the body is not valid JSON: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise BadInput(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadInput(400, "the body is not valid JSON: nested too deeply") from None


def count_values(raw: bytes, limits: BodyLimits) -> int:
    """The body's values and keys (``json_values``), counted before anything is decoded; a body holding more than
    any chat needs is refused: work for the proxy that serves nobody."""
    values = json_values(raw, limits.max_values)
    if values > limits.max_values:
        raise BadInput(
            400,
            f"the body holds more than {limits.max_values} JSON values and keys ({values} counted): no chat "
            "request needs that many",
            "too_many_values",
        )
    return values


CHAT_FIELDS = ENGINE_FIELDS | TURNSTREAM_FIELDS


def _check_extras(raw: bytes, limits: BodyLimits, known: frozenset[str] = CHAT_FIELDS) -> None:
    """Refuse a body holding more bytes in fields nobody reads (not ``known``) than ``max_extra_bytes``."""
    if len(raw) <= limits.max_extra_bytes:
        return
    fields = _decoded(raw, _fields_decoder)  # each value skipped as bytes, nothing built
    extra = {k: len(v) for k, v in fields.items() if k not in known}
    if sum(extra.values()) > limits.max_extra_bytes:
        largest = ", ".join(repr(k) for k in sorted(extra, key=extra.__getitem__, reverse=True)[:3])
        raise BadInput(
            413,
            f"fields the model engine does not read ({largest}) hold {sum(extra.values())} bytes, more than the "
            f"limit of {limits.max_extra_bytes}",
            "extra_fields_too_large",
        )


DEFAULT_LIMITS = BodyLimits()


def parse_object(
    raw: bytes,
    limits: BodyLimits = DEFAULT_LIMITS,
    counted: bool = False,
    known: frozenset[str] = CHAT_FIELDS,
) -> dict[str, Any]:
    """The body as a JSON object, within the limits; ``counted``: ``count_values`` has passed it already."""
    if not counted:
        count_values(raw, limits)
    _check_extras(raw, limits, known)
    body = _decoded(raw, _json_decoder)
    if not isinstance(body, dict):
        raise BadInput(400, "the body must be a JSON object")
    return body


def parse_chat(raw: bytes, limits: BodyLimits = DEFAULT_LIMITS, counted: bool = False) -> dict[str, Any]:
    """The body, checked; ``counted``: ``count_values`` has passed it already."""
    return check_chat(parse_object(raw, limits, counted), limits)


_MEDIA = ("image_url", "video_url", "audio_url")
"""SGLang's content parts that name their media by URL: ``{"type": kind, kind: {"url": ...}}``."""


def _check_media(parts: list[Any], at: int, prefixes: tuple[str, ...]) -> None:
    """Media only inline or from ``prefixes`` (``proxy.media_url_prefixes``: why, there)."""
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or (kind := part.get("type")) not in _MEDIA:
            continue
        ref = part.get(kind)
        url = ref.get("url") if isinstance(ref, dict) else None
        if not isinstance(url, str):
            raise BadInput(400, f"messages[{at}].content[{j}].{kind}.url must be a string")
        if url.startswith("data:") or url.startswith(prefixes):
            continue
        allowed = ", ".join(prefixes) if prefixes else "none configured (proxy.media_url_prefixes)"
        raise BadInput(
            400,
            f"messages[{at}].content[{j}]: media must be inline (a data: URI) or come from an allowed place "
            f"({allowed}); {url[:80]!r} is neither",
            "media_url_not_allowed",
        )


def check_chat(body: dict[str, Any], limits: BodyLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """A chat request the engine will take and the contract will record, or ``BadInput`` saying why not."""
    max_messages = limits.max_messages
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadInput(400, "'messages' must be a non-empty array of messages")
    if len(messages) > max_messages:
        raise BadInput(
            400,
            f"'messages' holds {len(messages)} messages, more than the limit of {max_messages}",
            "too_many_messages",
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadInput(400, f"messages[{i}] must be an object with a string 'role'")
        if isinstance(content := m.get("content"), list):
            _check_media(content, i, limits.media_url_prefixes)
    try:  # the contract's own check (~2 us): a request it refuses would be served and never recorded
        msgspec.convert(messages, list[Message])
    except (msgspec.ValidationError, ValueError) as exc:
        raise BadInput(400, f"'messages' is not a valid chat: {exc}".replace("`$", "`messages")) from None
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadInput(400, "'stream' must be a boolean")
    if not isinstance(body.get("model"), str | None):
        raise BadInput(400, "'model' must be a string")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadInput(400, "'tools' must be an array of objects")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise BadInput(400, "'stop' must be a string or an array of strings")
    for name in _SAMPLING.keys() & body.keys():
        if body[name] is not None:
            _check_sampling(name, body[name])
    body["messages"] = for_engine(messages)  # a developer message is a system message to the model
    return body
