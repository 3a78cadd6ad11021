"""What the proxy asks the engine for on its own account (ids, log-probs, meta info), and taking it out of the
response again, so that a client sees what it would have seen from SGLang itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_EXTRAS = ("response_token_ids", "prompt_token_ids", "meta_info")
_SGLEXT_HEADERS = {"input_ids": "x-sglext-return-input-ids", "output_ids": "x-sglext-return-output-ids"}


def client_wants(body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, bool]:
    """Which of the extras the client itself asked for (in the body, or SGLang's sglext headers)."""
    return {
        "logprobs": bool(body.get("logprobs")),
        "response_token_ids": bool(body.get("return_token_ids")),
        "prompt_token_ids": bool(body.get("return_prompt_token_ids") or body.get("return_token_ids")),
        "meta_info": bool(body.get("return_meta_info")),
        **{
            key: bool(body.get(f"return_{key}_in_sglext")) or headers.get(header) == "1"
            for key, header in _SGLEXT_HEADERS.items()
        },
    }


def strip_response(data: dict[str, Any], wants: dict[str, bool]) -> None:
    """Remove what the proxy asked the engine for on its own account, so clients see what they asked for."""
    for choice in data.get("choices") or ():
        if not wants["logprobs"]:
            choice["logprobs"] = None
        for extra in _EXTRAS:
            if not wants[extra]:
                choice.pop(extra, None)


def strip_stream_chunk(chunk: dict[str, Any], wants: dict[str, bool]) -> bool:
    """``strip_response`` for a stream chunk; False when nothing of it is the client's (the ``sglext`` ids chunk
    the proxy asked for on its own)."""
    if not wants["logprobs"]:
        for choice in chunk.get("choices") or ():
            choice["logprobs"] = None
    ext = chunk.get("sglext")
    if ext is not None:
        for key in ("input_ids", "output_ids"):
            if not wants[key]:
                ext.pop(key, None)
        if not ext:
            del chunk["sglext"]
            return bool(chunk.get("choices")) or chunk.get("usage") is not None
    return True
