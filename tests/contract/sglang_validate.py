"""Check JSON payloads against SGLang 0.5.23's own classes and request checks, offline (no server, no GPU).

Run with the SGLang environment's Python (sglang is importable only there), e.g.::

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=services/engine/standin .venv-sglang/bin/python \\
        tests/contract/sglang_validate.py < payloads.jsonl

Each stdin line is ``{"class": NAME, "payload": {...}}``; each stdout line is the result for the line read, in
order: ``{"class", "ok", "error", "refused", "extra", "mismatch"}``.

- ``ok``/``error``: the payload parses as SGLang parses it (pydantic ``model_validate`` for the OpenAI protocol
  models; FastAPI's pydantic ``TypeAdapter`` for io_struct's request classes; ``from_json_value`` for the generated
  ``sglang.api.v1`` contract types).
- ``refused``: a request that parses but that SGLang would still answer with a 400, from SGLang's own request-level
  checks run offline (see ``_chat_refusal`` and ``_generate_refusal``), else None.
- ``extra``: keys SGLang's class does not know, which it silently ignores (a flag we send that does nothing; a field
  a stub adds that the real engine never writes).
- ``mismatch``: for responses, where the payload differs from what SGLang itself writes for the object it parsed
  (the serializer its route uses), else None. A stub that adds, drops or nulls a key differently is caught here.

NAME is a class of ``sglang.srt.entrypoints.openai.protocol`` (``ChatCompletionRequest``,
``ChatCompletionResponse``, ``ChatCompletionStreamResponse``, ``ErrorResponse``, ``ModelList``, ...), of
``sglang.srt.managers.io_struct`` (``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``,
``UpdateWeightFromDiskReqOutput``, ``PauseGenerationReqInput``, ``ContinueGenerationReqInput``, ...), of
``sglang.api.v1.api_types`` (``GenerateResponse``, ...), or ``route:FUNCTION`` for an answer that
``http_server.py`` builds as a dict literal with no class (``route:model_info``, ``route:pause_generation``,
``route:continue_generation``, ``route:update_weights_from_disk``): the payload must have that literal's keys (and
its values, where they are constants). ``lora:adapter`` checks which LoRA adapter the chat route would pick:
``{"model", "lora_path", "served", "want"}`` (``_check_adapter``).

The import time goes to stderr as ``{"import_s": ...}``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import sys
import time
import traceback
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

_t0 = time.monotonic()
import msgspec  # noqa: E402
import pydantic  # noqa: E402
from sglang.api.v1 import api_types  # noqa: E402
from sglang.srt.entrypoints.api_contract import generate_contract_error  # noqa: E402
from sglang.srt.entrypoints.openai import protocol, serving_chat  # noqa: E402
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat  # noqa: E402
from sglang.srt.entrypoints.openai.sse_utils import StreamChunk  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

IMPORT_S = time.monotonic() - _t0

VOCAB_SIZE = 49152
"""SmolLM2's vocabulary (what SamplingParams.verify checks logit_bias keys against)."""
CONTEXT_LEN = 8192
"""SmolLM2's context length (what _validate_request checks max_tokens against)."""

_ADAPTERS: dict[type, pydantic.TypeAdapter[Any]] = {}


class _ReachedEngine(Exception):
    """The request passed every check SGLang makes before it needs a tokenizer or a model."""


class _Boundary:
    """Stands for SGLang's tokenizer manager: the first use means the offline checks are over."""

    def __getattr__(self, name: str) -> Any:
        raise _ReachedEngine(name)


class _Settings(types.SimpleNamespace):
    """Server settings for the offline checks (a server started with defaults); any other setting SGLang reads
    is an error here, so that a new check that depends on one is noticed rather than passed."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the offline check has no value for server setting {name!r}")


@contextmanager
def _server_settings() -> Iterator[None]:
    """``get_model()``/``get_serving()`` read the published server config, which only a running server has."""
    model = _Settings(context_length=CONTEXT_LEN)
    serving = _Settings(trust_request_chat_template=False, allow_auto_truncate=False)
    with (
        mock.patch.object(serving_chat, "get_model", lambda: model),
        mock.patch.object(serving_chat, "get_serving", lambda: serving),
    ):
        yield


def _chat_refusal(request: protocol.ChatCompletionRequest) -> str | None:
    """SGLang's 400s for a parsed chat request, by its own code, in its order (serving_base.handle_request):
    ``OpenAIServingChat._validate_request``, then ``_convert_to_internal_request`` up to its first use of the
    tokenizer manager (the streaming refusals of return_prompt_token_ids/return_token_ids/return_meta_info live
    there, serving_chat.py:1309-1326), then the sampling parameters as the tokenizer manager checks them
    (``SamplingParams(**...).verify(vocab_size)``, tokenizer_manager.py:1565-1567; ``normalize``, which needs the
    tokenizer, only handles stop strings). Both methods run on a bare instance holding just what they read."""
    validator = OpenAIServingChat.__new__(OpenAIServingChat)
    validator.is_minimax_m3 = False
    validator.tokenizer_manager = types.SimpleNamespace(
        model_config=types.SimpleNamespace(is_multimodal=False)
    )
    with _server_settings():
        message = OpenAIServingChat._validate_request(validator, request)
    if message:
        return message
    converter = OpenAIServingChat.__new__(OpenAIServingChat)
    converter.reasoning_parser = None
    converter.template_manager = types.SimpleNamespace(reasoning_config=None)
    converter.is_gpt_oss = False
    converter.tokenizer_manager = _Boundary()
    try:
        OpenAIServingChat._convert_to_internal_request(converter, request.model_copy(deep=True), None)
    except ValueError as exc:
        return str(exc)
    except _ReachedEngine:
        pass
    else:
        raise AssertionError("_convert_to_internal_request finished without a tokenizer manager")
    try:
        params = request.to_sampling_params(stop=[], model_generation_config={})
        SamplingParams(**params).verify(VOCAB_SIZE)
    except ValueError as exc:
        return str(exc)
    return None


def _generate_refusal(payload: dict[str, Any], obj: io_struct.GenerateReqInput) -> str | None:
    """SGLang's 400s for a parsed /generate body: the schema gate (http_server.py generate_request, api_contract),
    ``normalize_batch_and_arguments`` (tokenizer_manager.generate_request) and the sampling parameters' checks."""
    error = generate_contract_error(payload)
    if error is not None:
        return error
    try:
        obj.normalize_batch_and_arguments()
        batches = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        for params in batches:
            SamplingParams(**(params or {})).verify(VOCAB_SIZE)
    except ValueError as exc:
        return str(exc)
    return None


def _pydantic_extras(value: Any, data: Any, path: str) -> list[str]:
    """Keys in ``data`` that the parsed ``value`` has no field for, at any depth."""
    out: list[str] = []
    if isinstance(value, pydantic.BaseModel) and isinstance(data, dict):
        fields = type(value).model_fields
        by_key = {(f.alias or name): name for name, f in fields.items()} | {name: name for name in fields}
        for key, item in data.items():
            name = by_key.get(key)
            if name is None:
                out.append(f"{path}.{key}")
            else:
                out += _pydantic_extras(getattr(value, name), item, f"{path}.{key}")
    elif isinstance(value, list | tuple) and isinstance(data, list):
        for i, (v, d) in enumerate(zip(value, data, strict=False)):
            out += _pydantic_extras(v, d, f"{path}[{i}]")
    elif isinstance(value, dict) and isinstance(data, dict):
        for key, item in data.items():
            if key in value:
                out += _pydantic_extras(value[key], item, f"{path}.{key}")
    return out


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {f.name for f in msgspec.structs.fields(cls)}


def _diff(want: Any, got: Any, path: str = "$") -> str | None:
    """The first place where ``got`` (the payload) differs from ``want`` (what SGLang writes), or None."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in want.keys() | got.keys():
            if key not in got:
                return (
                    f"{path}.{key}: SGLang writes {json.dumps(want[key])[:120]}, the payload has no such key"
                )
            if key not in want:
                return f"{path}.{key}: not written by SGLang"
            found = _diff(want[key], got[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{path}: {len(got)} items, SGLang writes {len(want)}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            found = _diff(w, g, f"{path}[{i}]")
            if found:
                return found
        return None
    if want != got or (type(want) is not type(got) and not (_number(want) and _number(got))):
        return f"{path}: SGLang writes {json.dumps(want)[:120]}, the payload has {json.dumps(got)[:120]}"
    return None


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _as_written(name: str, model: pydantic.BaseModel, payload: dict[str, Any]) -> Any:
    """What SGLang's route writes for the parsed object: choice chunks go through sse_utils' msgspec StreamChunk
    (``build_sse_content``, their logprobs as ``ChoiceLogprobs.model_dump()``); other chunks through
    ``model_dump_json()``; chat responses through ``model_dump_json(by_alias=True)`` (model_json_response); errors
    through ``model_dump()`` (create_error_response); the model list through FastAPI's encoder (by alias)."""
    if name == "ChatCompletionStreamResponse" and payload.get("choices"):
        chunk = msgspec.to_builtins(msgspec.convert(payload, StreamChunk))
        for choice in chunk["choices"]:
            if choice.get("logprobs") is not None:
                choice["logprobs"] = protocol.ChoiceLogprobs.model_validate(choice["logprobs"]).model_dump()
        return chunk
    if name in ("ChatCompletionResponse", "ModelList"):
        return json.loads(model.model_dump_json(by_alias=True))
    return json.loads(model.model_dump_json())


def _http_server_literal(function: str) -> tuple[dict[str, Any], set[str]]:
    """The dict literal a route of http_server.py answers with (read from its source, not imported: importing
    the server module starts nothing but pulls in everything), and the keys it adds with ``name["key"] = ...``.
    Values that are not constants are given as ``...``."""
    spec = importlib.util.find_spec("sglang.srt.entrypoints.http_server")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(open(spec.origin).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and node.name == function:
            break
    else:
        raise LookupError(f"http_server.py has no function {function!r}")
    literal: dict[str, Any] | None = None
    added: set[str] = set()
    for sub in ast.walk(node):
        if literal is None and isinstance(sub, ast.Dict) and sub.keys:
            if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in sub.keys):
                literal = {
                    k.value: (v.value if isinstance(v, ast.Constant) else ...)  # type: ignore[union-attr]
                    for k, v in zip(sub.keys, sub.values, strict=True)
                }
        if isinstance(sub, ast.Assign):
            for target in sub.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
                    added.add(str(target.slice.value))
    if literal is None:
        raise LookupError(f"http_server.py's {function} builds no dict literal")
    return literal, added


def _check_route(function: str, payload: Any) -> dict[str, Any]:
    literal, optional = _http_server_literal(function)
    if not isinstance(payload, dict):
        return {"ok": False, "error": "not a JSON object"}
    missing = sorted(literal.keys() - payload.keys())
    extra = sorted(payload.keys() - literal.keys() - optional)
    wrong = {
        k: (payload[k], v) for k, v in literal.items() if v is not ... and k in payload and payload[k] != v
    }
    if missing or wrong:
        return {
            "ok": False,
            "error": f"missing {missing}; differing (ours, SGLang's) {wrong}",
            "extra": extra,
        }
    return {"ok": True, "extra": extra}


def _check_adapter(payload: dict[str, Any]) -> dict[str, Any]:
    """The adapter SGLang's chat route resolves for a request (``_resolve_lora_path``: ``model`` first, then
    ``lora_path``) on a server of the given served name; ``mismatch`` unless it is ``want``."""
    server = OpenAIServingChat.__new__(OpenAIServingChat)
    server.tokenizer_manager = types.SimpleNamespace(served_model_name=payload["served"])
    got = server._resolve_lora_path(payload["model"], payload["lora_path"])
    return {
        "ok": True,
        "mismatch": None if got == payload["want"] else f"SGLang resolves the adapter {got!r}",
    }


def check(name: str, payload: Any) -> dict[str, Any]:
    """One payload against one class: see the module docstring for what the result says."""
    if name.startswith("route:"):
        return _check_route(name.removeprefix("route:"), payload)
    if name == "lora:adapter":
        return _check_adapter(payload)
    cls = getattr(protocol, name, None)
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        try:
            model = cls.model_validate(payload)
        except pydantic.ValidationError as exc:
            return {"ok": False, "error": str(exc)}
        result: dict[str, Any] = {"ok": True, "extra": _pydantic_extras(model, payload, "$")}
        if name == "ChatCompletionRequest":
            result["refused"] = _chat_refusal(model)  # type: ignore[arg-type]
        elif not name.endswith("Request"):
            try:
                result["mismatch"] = _diff(_as_written(name, model, payload), payload)
            except msgspec.ValidationError as exc:  # SGLang's chunk struct cannot even hold it
                result["mismatch"] = f"not a chunk SGLang writes: {exc}"
        return result
    cls = getattr(io_struct, name, None)
    if isinstance(cls, type):
        adapter = _ADAPTERS.get(cls)
        if adapter is None:
            adapter = _ADAPTERS[cls] = pydantic.TypeAdapter(cls)
        try:
            obj = adapter.validate_python(payload)
        except pydantic.ValidationError as exc:
            return {"ok": False, "error": str(exc)}
        extra = sorted(payload.keys() - _field_names(cls)) if isinstance(payload, dict) else []
        result = {"ok": True, "extra": [f"$.{k}" for k in extra]}
        if name == "GenerateReqInput":
            result["refused"] = _generate_refusal(payload, obj)
        return result
    cls = getattr(api_types, name, None)
    if isinstance(cls, type) and hasattr(cls, "from_json_value"):
        try:
            cls.from_json_value(payload)
        except api_types.JsonContractError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True}
    return {"ok": False, "error": f"no SGLang class {name!r} in protocol, io_struct or api.v1.api_types"}


def main() -> None:
    print(json.dumps({"import_s": round(IMPORT_S, 2)}), file=sys.stderr, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        item = json.loads(line)
        name = str(item.get("class"))
        try:
            result = check(name, item.get("payload"))
        except Exception:  # a check that cannot run is a failure to look at, not a pass
            result = {"ok": False, "error": "the check itself failed:\n" + traceback.format_exc()}
        result = {
            "class": name,
            "ok": False,
            "error": None,
            "refused": None,
            "extra": [],
            "mismatch": None,
            **result,
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
