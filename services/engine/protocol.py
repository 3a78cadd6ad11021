"""Request shapes of the endpoints the engine serves, as SGLang names them.

Unknown fields are rejected (``forbid_unknown_fields``): a request that relies on something this engine does not
implement gets a 400 naming the field instead of a silently different answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class _Req(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class ContentPart(_Req):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """Validates a message; the chat template receives the message exactly as the client sent it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Req):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatCompletionRequest(_Req):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: int | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: float | None = None
    """Only 0 (penalties are not implemented; a non-zero value is rejected)."""
    frequency_penalty: float | None = None
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    separate_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False
    """Extension (vLLM's name): each choice carries ``token_ids``, the exact generated ids; in streaming, each
    chunk carries its delta ids."""
    return_prompt_token_ids: bool = False
    """SGLang: each choice carries ``prompt_token_ids``; in streaming, the first chunk does."""
    return_meta_info: bool = False
    """SGLang: each choice carries the engine's ``meta_info`` (finish reason, token log-probs with ids)."""


class GenerateSamplingParams(_Req):
    max_new_tokens: Annotated[int, Meta(ge=0)] = 128
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: Literal[False] = False
    sampling_seed: int | None = None
    n: Literal[1] = 1


class GenerateRequest(_Req):
    text: str | None = None
    input_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    sampling_params: GenerateSamplingParams | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: Annotated[int, Meta(ge=0, le=100)] = 0
    return_text_in_logprobs: bool = False
    stream: Literal[False] = False
    rid: str | None = None


class UpdateWeightsRequest(_Req):
    model_path: str
    load_format: str | None = None
    weight_version: str | int | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True
