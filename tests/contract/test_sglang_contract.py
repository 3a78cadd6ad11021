"""The SGLang 0.5.23 contract, checked by SGLang's own classes: every kind of answer the stub engines give
(bench/stub_engine.py, bench/stub_judge.py) and every request our services build for the engine.

sglang is importable only in .venv-sglang, so the checks run there, in one subprocess per test session
(tests/contract/sglang_validate.py; importing SGLang takes tens of seconds). The requests are captured on the wire
from ``runtime.engine.client.EngineClient`` (and the judge's ``EngineBackend``) talking to the stubs, so what is
checked is what the services send and what the stubs answer, not a copy of either. Real SGLang 0.5.23 answers
(captured from a server) go through the same checks, so a check that is wrong about SGLang fails here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.engine.client import EXACT_NON_STREAMED, EXACT_STREAMED, EngineClient, EngineError
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from services.judge.backends import EngineBackend
from services.proxy.adapters import without_adapter
from services.proxy.sampling import OPENAI_SAMPLING

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang/bin/python"
VALIDATOR = REPO / "tests/contract/sglang_validate.py"
STANDIN = REPO / "services/engine/standin"

# Fixture setup imports SGLang in a subprocess (about a minute on a small CPU machine) before the first test runs.
pytestmark = pytest.mark.timeout(900)

MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
MAIN_TURN = {"model": "policy", "messages": MESSAGES, "max_tokens": 16, **OPENAI_SAMPLING}
"""A main turn as services/proxy/app.py forwards it: the client's body with the sampling values made explicit
(``OPENAI_SAMPLING``: what the proxy fills in when the model sets none), then the ``EXACT_*`` flags."""


# ---- capture ---------------------------------------------------------------------------------------------


@dataclass
class Exchange:
    path: str
    request: Any
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The ``data:`` payloads of an SSE body, in order (``[DONE]`` included)."""
        out = []
        for block in self.body.decode().split("\n\n"):
            for line in block.splitlines():
                if line.startswith("data: "):
                    out.append(line[6:])
        return out


class Recorder(httpx.AsyncBaseTransport):
    """A real HTTP transport that keeps every request body and response it carries."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[Exchange] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        await response.aclose()
        sent = json.loads(request.content) if request.content else None
        self.exchanges.append(Exchange(request.url.path, sent, response.status_code, body))
        headers = {"content-type": response.headers.get("content-type", "application/json")}
        return httpx.Response(response.status_code, headers=headers, content=body)

    def last(self) -> Exchange:
        return self.exchanges[-1]


def stub(script: str, *args: str) -> ServiceProcess:
    port = free_port()
    return ServiceProcess(
        ["--port", str(port), "--latency-ms", "0", *args],
        port=port,
        ready_path="/health",
        startup_timeout_s=30,
        program=[sys.executable, str(REPO / "bench" / script)],
    )


@dataclass
class Item:
    """One payload for the validator; ``expect`` is the outcome SGLang's classes must give it."""

    group: str
    label: str
    cls: str
    payload: Any
    expect: str = "valid"


@dataclass
class Collected:
    items: list[Item] = field(default_factory=list)
    exchanges: dict[str, Exchange] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, group: str, label: str, cls: str, payload: Any, expect: str = "valid") -> None:
        self.items.append(Item(group, label, cls, payload, expect))


def flag_sets(flags: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every combination of the given request flags, none of them to all of them."""
    names = list(flags)
    for on in itertools.product([False, True], repeat=len(names)):
        yield {name: flags[name] for name, chosen in zip(names, on, strict=True) if chosen}


def label_of(flags: dict[str, Any]) -> str:
    return "+".join(flags) or "plain"


async def exercise_engine(url: str, finish: str, out: Collected) -> None:
    """Every kind of answer a stub engine gives, through the client the services use."""
    rec = Recorder()
    client = EngineClient(url, client=httpx.AsyncClient(transport=rec), retries=0)
    group = f"engine-{finish}"
    non_streamed = {
        "logprobs": True,
        "top_logprobs": 2,
        "return_prompt_token_ids": True,
        "return_token_ids": True,
        "return_meta_info": True,
    }
    for flags in flag_sets(non_streamed):
        body = {**MAIN_TURN, "stream": False, **flags}
        await client.chat_raw(body)
        out.add(group, f"chat {label_of(flags)}", "ChatCompletionResponse", rec.last().json())
        out.add("requests", f"{group} chat {label_of(flags)}", "ChatCompletionRequest", body)
    streamed = {
        "logprobs": True,
        "top_logprobs": 2,
        "return_input_ids_in_sglext": True,
        "return_output_ids_in_sglext": True,
        "stream_options": {"include_usage": True},
    }
    for flags in flag_sets(streamed):
        body = {**MAIN_TURN, **flags}
        _ = [chunk async for chunk in client.chat_stream(body)]
        exchange = rec.last()
        out.exchanges[f"{group} stream {label_of(flags)}"] = exchange
        events = exchange.events()
        for i, event in enumerate(events[:-1]):
            out.add(
                group,
                f"stream {label_of(flags)} event {i}",
                "ChatCompletionStreamResponse",
                json.loads(event),
            )
        out.add("requests", f"{group} stream {label_of(flags)}", "ChatCompletionRequest", exchange.request)
    # Side turns may ask for several samples.
    await client.chat_raw({**MAIN_TURN, "n": 2, **non_streamed})
    out.add(group, "chat n=2", "ChatCompletionResponse", rec.last().json())
    _ = [c async for c in client.chat_stream({**MAIN_TURN, "n": 2, **streamed})]
    for i, event in enumerate(rec.last().events()[:-1]):
        out.add(group, f"stream n=2 event {i}", "ChatCompletionStreamResponse", json.loads(event))
    out.exchanges[f"{group} stream n=2"] = rec.last()
    # What the services send: the EXACT flags through the client's own chat(); streamed as the proxy does.
    result = await client.chat(MAIN_TURN)
    out.facts[f"{group} chat"] = result
    out.add("requests", f"{group} main turn non-streamed", "ChatCompletionRequest", rec.last().request)
    out.add(group, "main turn non-streamed", "ChatCompletionResponse", rec.last().json())
    _ = [c async for c in client.chat_stream({**MAIN_TURN, **EXACT_STREAMED})]
    out.add("requests", f"{group} main turn streamed", "ChatCompletionRequest", rec.last().request)
    out.exchanges[f"{group} main turn streamed"] = rec.last()
    # Refusals: what SGLang cannot stream.
    for flag in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
        body = {**MAIN_TURN, "stream": True, flag: True}
        with pytest.raises(EngineError):
            await client.chat_raw(body)
        out.exchanges[f"{group} refusal {flag}"] = rec.last()
        out.add(group, f"refusal {flag}", "ErrorResponse", rec.last().json())
        out.add("refusals", f"{group} refusal {flag}", "ChatCompletionRequest", body, expect="refused")
    # /generate: the teacher's scoring, with and without top-k, and plain generation.
    prompt, response = [1000 + i for i in range(12)], [2000 + i for i in range(5)]
    for k in (0, 2):
        scored = await client.score(prompt, response, top_k=k)
        out.facts[f"{group} score top{k}"] = scored
        out.add("requests", f"{group} score top{k}", "GenerateReqInput", rec.last().request)
        out.add(group, f"score top{k}", "GenerateResponse", rec.last().json())
    await client.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4}, return_logprob=True)
    out.add("requests", f"{group} generate", "GenerateReqInput", rec.last().request)
    out.add(group, "generate", "GenerateResponse", rec.last().json())
    # Admin: info, models, and a weight update the way the reloader does it (pause, update, continue).
    await client.model_info()
    out.add(group, "model_info before", "route:model_info", rec.last().json())
    await client.models()
    out.add(group, "models before", "ModelList", rec.last().json())
    await client.pause_generation("retract")
    out.add("requests", f"{group} pause", "PauseGenerationReqInput", rec.last().request)
    out.add(group, "pause", "route:pause_generation", rec.last().json())
    path = f"/tmp/turnstream-weights/{finish}/1"
    await client.update_weights_from_disk(path, 1)
    out.exchanges[f"{group} update"] = rec.last()
    out.add("requests", f"{group} update", "UpdateWeightFromDiskReqInput", rec.last().request)
    out.add(group, "update", "route:update_weights_from_disk", rec.last().json())
    out.add(group, "update (as the scheduler's output)", "UpdateWeightFromDiskReqOutput", rec.last().json())
    await client.continue_generation()
    out.add("requests", f"{group} continue", "ContinueGenerationReqInput", rec.last().request)
    out.add(group, "continue", "route:continue_generation", rec.last().json())
    out.facts[f"{group} info after"] = await client.model_info()
    out.add(group, "model_info after", "route:model_info", rec.last().json())
    out.facts[f"{group} models after"] = await client.models()
    out.add(group, "models after", "ModelList", rec.last().json())
    out.facts[f"{group} chat after"] = await client.chat(MAIN_TURN)
    out.add(group, "chat after update", "ChatCompletionResponse", rec.last().json())
    out.facts[f"{group} score after"] = await client.score(prompt, response)
    # LoRA (the reloader and the proxy with trainer.lora on): the stub serves no adapters, so only the requests are
    # checked here; tests/services/proxy/test_lora_serving.py runs them against the real server.
    with contextlib.suppress(EngineError):
        await client.load_lora_adapter("turnstream-v1", "/tmp/turnstream-weights/v1")
    out.add("requests", f"{group} load adapter", "LoadLoRAAdapterReqInput", rec.last().request)
    with contextlib.suppress(EngineError):
        await client.unload_lora_adapter("turnstream-v1")
    out.add("requests", f"{group} unload adapter", "UnloadLoRAAdapterReqInput", rec.last().request)
    with contextlib.suppress(EngineError):
        await client.score(prompt, response, lora_path="turnstream-v1")
    out.add("requests", f"{group} score on an adapter", "GenerateReqInput", rec.last().request)
    routed = {**MAIN_TURN, **EXACT_NON_STREAMED, "lora_path": "turnstream-v1"}  # as ChatProxy.route sends it
    out.add("requests", f"{group} main turn to an adapter", "ChatCompletionRequest", routed)
    await client._client.aclose()  # type: ignore[union-attr]


async def exercise_failure(url: str, out: Collected) -> None:
    rec = Recorder()
    client = EngineClient(url, client=httpx.AsyncClient(transport=rec), retries=0)
    with pytest.raises(EngineError):
        await client.chat_raw({**MAIN_TURN})
    out.exchanges["engine failure"] = rec.last()
    out.add("engine-length", "failure 500", "ErrorResponse", rec.last().json())
    await client._client.aclose()  # type: ignore[union-attr]


async def exercise_judge(url: str, out: Collected) -> None:
    rec = Recorder()
    client = EngineClient(url, client=httpx.AsyncClient(transport=rec), retries=0)
    backend = EngineBackend(client, model="stub-judge", temperature=0.7, max_tokens=256, deadline_s=10)
    prompt = [
        {"role": "user", "content": "## Next state (role: user)\nNo, that's wrong.\n\nDid the step work?"}
    ]
    out.facts["judge vote"] = await backend.vote("eval", None, prompt)  # type: ignore[arg-type]
    out.add("requests", "judge vote", "ChatCompletionRequest", rec.last().request)
    out.add("judge", "vote", "ChatCompletionResponse", rec.last().json())
    vote_body = rec.last().request
    for flags in flag_sets({"logprobs": True, "return_token_ids": True, "return_meta_info": True}):
        await client.chat_raw({**vote_body, **flags})
        out.add("judge", f"chat {label_of(flags)}", "ChatCompletionResponse", rec.last().json())
    short = {**vote_body, "max_tokens": 2, "logprobs": True}
    await client.chat_raw(short)
    out.add("judge", "chat cut at max_tokens", "ChatCompletionResponse", rec.last().json())
    out.facts["judge cut"] = rec.last().json()
    _ = [c async for c in client.chat_stream({**vote_body, **EXACT_STREAMED})]
    for i, event in enumerate(rec.last().events()[:-1]):
        out.add("judge", f"stream event {i}", "ChatCompletionStreamResponse", json.loads(event))
    with pytest.raises(EngineError):
        await client.chat_raw({**vote_body, "stream": True, "return_token_ids": True})
    out.add("judge", "refusal", "ErrorResponse", rec.last().json())
    await client.model_info()
    out.add("judge", "model_info", "route:model_info", rec.last().json())
    out.facts["judge models"] = await client.models()
    out.add("judge", "models", "ModelList", rec.last().json())
    await client._client.aclose()  # type: ignore[union-attr]


SERVED_NAMES = ["policy", "qwen3:4b", "s3://bucket/Qwen3-4B"]
"""Served model names, some with colons: SGLang never splits its exact served name into base and adapter."""


def adapter_cases(out: Collected) -> None:
    """A main turn's ``model`` as the proxy forwards it under LoRA (``without_adapter``): whatever the client
    named, SGLang serves the adapter the proxy chose in ``lora_path``. Also when the proxy could not read the
    served name (None)."""
    for served in SERVED_NAMES:
        for client in (served, f"{served}:turnstream-v1", "other:turnstream-v1", "plain"):
            for known in (served, None):
                forwarded = without_adapter(client, known)
                out.add("adapters", f"{client} on {served} (proxy knows {known})", "lora:adapter",
                        {"model": forwarded, "lora_path": "turnstream-v3", "served": served,
                         "want": "turnstream-v3"})  # fmt: skip


def negative_cases(out: Collected) -> None:
    """Payloads SGLang's classes must turn down: proof that the checks can fail."""
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": []}
    out.add("negative", "sglext output_ids not a list of lists", "ChatCompletionStreamResponse",
            {**chunk, "usage": None, "sglext": {"output_ids": [1, 2]}}, expect="invalid")  # fmt: skip
    out.add("negative", "streamed request with return_token_ids", "ChatCompletionRequest",
            {**MAIN_TURN, "stream": True, "return_token_ids": True}, expect="refused")  # fmt: skip
    out.add("negative", "streamed request with return_meta_info", "ChatCompletionRequest",
            {**MAIN_TURN, "stream": True, **EXACT_NON_STREAMED}, expect="refused")  # fmt: skip
    out.add("negative", "top_p 0 (SamplingParams.verify)", "ChatCompletionRequest",
            {**MAIN_TURN, "top_p": 0.0}, expect="refused")  # fmt: skip
    out.add("negative", "a flag SGLang does not know", "ChatCompletionRequest",
            {**MAIN_TURN, "return_ids": True}, expect="extra")  # fmt: skip
    content_chunk = {**chunk, "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None,
                                           "finish_reason": None, "matched_stop": None}]}  # fmt: skip
    out.add("negative", "chunk delta without reasoning_content", "ChatCompletionStreamResponse",
            content_chunk, expect="mismatch")  # fmt: skip
    with_ids = json.loads(json.dumps(REAL["chat"]))
    with_ids["choices"][0]["token_ids"] = [1, 2]
    out.add("negative", "choice with token_ids", "ChatCompletionResponse", with_ids, expect="extra")
    no_usage = {k: v for k, v in REAL["chat"].items() if k != "usage"}
    out.add("negative", "response without usage", "ChatCompletionResponse", no_usage, expect="invalid")
    out.add("negative", "generate without input", "GenerateReqInput",
            {"sampling_params": {"max_new_tokens": 1}}, expect="refused")  # fmt: skip
    out.add("negative", "generate with an unknown sampling key", "GenerateReqInput",
            {"input_ids": [1], "sampling_params": {"max_tokens": 1}}, expect="refused")  # fmt: skip
    out.add("negative", "a client's adapter in model, forwarded as is", "lora:adapter",
            {"model": "policy:turnstream-v1", "lora_path": "turnstream-v3", "served": "policy",
             "want": "turnstream-v3"}, expect="mismatch")  # fmt: skip
    out.add("negative", "update without model_path", "UpdateWeightFromDiskReqInput",
            {"weight_version": "1"}, expect="invalid")  # fmt: skip
    out.add("negative", "model_info without weight_version", "route:model_info",
            {k: v for k, v in REAL["model_info"].items() if k != "weight_version"}, expect="invalid")  # fmt: skip
    out.add("negative", "pause answered with other words", "route:pause_generation",
            {"message": "Paused.", "status": "ok"}, expect="invalid")  # fmt: skip
    bad_triple = json.loads(json.dumps(REAL["score"]))
    bad_triple["meta_info"]["input_token_logprobs"][1] = {"logprob": -0.7, "id": 359}
    out.add("negative", "generate answer with an object for a triple", "GenerateResponse", bad_triple,
            expect="invalid")  # fmt: skip


# ---- real SGLang 0.5.23 answers (SmolLM2-135M-Instruct, --tool-call-parser qwen --weight-version 0) ----------

_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
           8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]  # fmt: skip
_RID = "15edfb98d22d48f8803259646330d446"
REAL: dict[str, Any] = {
    "chat": {
        "id": _RID, "object": "chat.completion", "created": 1796102596, "model": "x",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "Hey there!", "reasoning_content": None},
            "logprobs": {"content": [
                {"token": "Hey", "bytes": [72, 101, 121], "logprob": -3.9691150188446045, "top_logprobs": []},
                {"token": " there", "bytes": [32, 116, 104, 101, 114, 101], "logprob": -0.08679906278848648,
                 "top_logprobs": []},
                {"token": "!", "bytes": [33], "logprob": -0.7434419393539429, "top_logprobs": []},
            ]},
            "finish_reason": "length", "matched_stop": None,
            "prompt_token_ids": _PROMPT, "response_token_ids": [22234, 665, 17],
            "meta_info": {
                "id": _RID, "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 31,
                "weight_version": "0", "num_retractions": 0, "storage_prefetch_wait": 0.0,
                "storage_staging_wait": 0.0, "forward_entry_time": 1796102595.7223346,
                "prefill_finished_time": 1796102595.9126616, "queue_time": 0.0013057799999387498,
                "input_token_logprobs": [],
                "output_token_logprobs": [[-3.9691150188446045, 22234, "Hey"],
                                          [-0.08679906278848648, 665, " there"], [-0.7434419393539429, 17, "!"]],
                "output_token_logprobs_length": 3, "reasoning_tokens": 0, "completion_tokens": 3,
                "cached_tokens": 30, "weight_versions": [{"version": "0", "start": 0, "end": 3}],
                "cached_tokens_details": {"device": 30, "host": 0}, "dp_rank": None,
                "e2e_latency": 0.7392893830000276, "request_received_ts": 1796102595.712684,
            },
        }],
        "usage": {"prompt_tokens": 31, "total_tokens": 34, "completion_tokens": 3, "prompt_tokens_details": None,
                  "reasoning_tokens": 0, "completion_tokens_details": None},
        "metadata": {"weight_version": "0", "weight_versions": [{"version": "0", "start": 0, "end": 3}]},
    },
    "chunks": [
        {"id": "30898750644e488088c257e86d2b84a3", "object": "chat.completion.chunk", "created": 1796102800,
         "model": "x", "choices": [{"index": 0, "delta": {"reasoning_content": None, "role": "assistant",
                                                          "content": ""},
                                    "logprobs": None, "finish_reason": None, "matched_stop": None}]},
        {"id": "30898750644e488088c257e86d2b84a3", "object": "chat.completion.chunk", "created": 1796102800,
         "model": "x", "choices": [{"index": 0, "delta": {"reasoning_content": None, "content": "?"},
                                    "logprobs": {"content": [{"token": "?", "bytes": [63],
                                                              "logprob": -0.0005820487276650965,
                                                              "top_logprobs": []}]},
                                    "finish_reason": None, "matched_stop": None}]},
        {"id": "30898750644e488088c257e86d2b84a3", "object": "chat.completion.chunk", "created": 1796102800,
         "model": "x", "choices": [{"index": 0, "delta": {"reasoning_content": None},
                                    "logprobs": {"content": [{"token": "<|im_end|>",
                                                              "bytes": [60, 124, 105, 109, 95, 101, 110, 100,
                                                                        124, 62],
                                                              "logprob": -0.1742425262928009,
                                                              "top_logprobs": []}]},
                                    "finish_reason": None, "matched_stop": None}]},
        {"id": "30898750644e488088c257e86d2b84a3", "object": "chat.completion.chunk", "created": 1796102800,
         "model": "x", "choices": [{"index": 0, "delta": {"reasoning_content": None}, "logprobs": None,
                                    "finish_reason": "stop", "matched_stop": 2}]},
        {"id": "30898750644e488088c257e86d2b84a3", "object": "chat.completion.chunk", "created": 1796102800,
         "model": "x", "choices": [], "usage": None,
         "sglext": {"input_ids": _PROMPT, "output_ids": [[19556, 17, 1073, 416, 339, 4237, 346, 1834, 47, 2]]}},
        {"id": "30898750644e488088c257e86d2b84a3", "object": "chat.completion.chunk", "created": 1796102800,
         "model": "x", "choices": [],
         "usage": {"prompt_tokens": 31, "total_tokens": 41, "completion_tokens": 10, "prompt_tokens_details": None,
                   "reasoning_tokens": 0, "completion_tokens_details": None}},
    ],
    "refusal": {"object": "error", "message": "return_token_ids is not supported with streaming on "
                "/v1/chat/completions. Please set stream=false when using return_token_ids=true.",
                "type": "BadRequest", "param": None, "code": 400},
    "score": {
        "text": "", "output_ids": [],
        "meta_info": {
            "id": "4698926f316540b3810f14226b37897c", "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": 6, "weight_version": "0", "num_retractions": 0,
            "input_token_logprobs": [[None, 2683, None], [-0.7261549830436707, 359, None],
                                     [-1.699194073677063, 253, None]],
            "output_token_logprobs": [], "output_token_logprobs_length": 0,
            "input_top_logprobs": [None, [[-0.7261549830436707, 359, None], [-0.9777094721794128, 2316, None]],
                                   [[-0.5328255891799927, 354, None], [-1.699194073677063, 253, None]]],
            "output_top_logprobs": [[[-2.614625930786133, 7952, None], [-2.759481430053711, 33011, None]]],
            "reasoning_tokens": 0, "completion_tokens": 0, "cached_tokens": 3,
            "weight_versions": [{"version": "0", "start": 0, "end": 0}],
            "cached_tokens_details": {"device": 3, "host": 0}, "dp_rank": None,
        },
    },
    "model_info": {
        "model_path": "/root/.cache/turnstream/models/smollm2-135m-instruct",
        "served_model_name": "smollm2-135m-instruct",
        "tokenizer_path": "/root/.cache/turnstream/models/smollm2-135m-instruct",
        "is_generation": True, "preferred_sampling_params": None, "weight_version": "0", "load_format": "auto",
        "reasoning_parser": None, "tool_call_parser": "qwen", "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False, "model_type": "llama",
        "architectures": ["LlamaForCausalLM"], "embedding": {"family": "none", "enabled": False},
    },
    "models": {"object": "list", "data": [{"id": "smollm2-135m-instruct", "object": "model", "created": 1796102590,
                                           "owned_by": "sglang", "root": "smollm2-135m-instruct", "parent": None,
                                           "max_model_len": 8192}]},
}  # fmt: skip


def real_cases(out: Collected) -> None:
    out.add("real", "chat", "ChatCompletionResponse", REAL["chat"])
    for i, chunk in enumerate(REAL["chunks"]):
        out.add("real", f"chunk {i}", "ChatCompletionStreamResponse", chunk)
    out.add("real", "refusal", "ErrorResponse", REAL["refusal"])
    out.add("real", "score", "GenerateResponse", REAL["score"])
    out.add("real", "model_info", "route:model_info", REAL["model_info"])
    out.add("real", "models", "ModelList", REAL["models"])


# ---- the one validator run --------------------------------------------------------------------------------


def run_validator(items: list[Item]) -> tuple[list[dict[str, Any]], float]:
    """All payloads through tests/contract/sglang_validate.py in .venv-sglang; the results and the import time."""
    if not SGLANG_PYTHON.exists():
        pytest.fail(
            f"{SGLANG_PYTHON} does not exist: the contract tests check against SGLang's own classes, which are "
            "importable only in the SGLang environment. Create it with `bash scripts/setup-sglang.sh` "
            "(CI installs it)."
        )
    lines = "".join(json.dumps({"class": it.cls, "payload": it.payload}) + "\n" for it in items)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(STANDIN), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(VALIDATOR)],
        input=lines,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or len(results) != len(items):
        pytest.fail(
            f"the validator exited with {proc.returncode} after {len(results)} of {len(items)} results:\n"
            f"{proc.stderr[-4000:]}"
        )
    timing = [json.loads(ln) for ln in proc.stderr.splitlines() if ln.startswith('{"import_s"')]
    return results, float(timing[0]["import_s"]) if timing else float("nan")


@dataclass
class Checked:
    collected: Collected
    results: list[dict[str, Any]]
    import_s: float

    def group(self, name: str) -> list[tuple[Item, dict[str, Any]]]:
        pairs = zip(self.collected.items, self.results, strict=True)
        found = [(it, r) for it, r in pairs if it.group == name]
        assert found, f"nothing collected for {name}"
        return found


def outcome(result: dict[str, Any]) -> str:
    if not result["ok"]:
        return "invalid"
    if result.get("refused"):
        return "refused"
    if result.get("extra"):
        return "extra"
    if result.get("mismatch"):
        return "mismatch"
    return "valid"


def assert_outcomes(checked: Checked, group: str) -> None:
    wrong = [
        f"{it.label} ({it.cls}): expected {it.expect}, got {outcome(r)}: "
        f"{r.get('error') or r.get('refused') or r.get('extra') or r.get('mismatch')}"
        for it, r in checked.group(group)
        if outcome(r) != it.expect
    ]
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def checked() -> Iterator[Checked]:
    out = Collected()
    processes: list[ServiceProcess] = []
    try:
        engines = {}
        for finish in ("length", "stop"):
            engines[finish] = stub("stub_engine.py", "--tokens", "3", "--finish", finish)
            processes.append(engines[finish])
        failing = stub("stub_engine.py", "--fail-every", "1")
        processes.append(failing)
        judge = stub("stub_judge.py")
        processes.append(judge)

        async def exercise() -> None:
            for finish, engine in engines.items():
                await exercise_engine(engine.url, finish, out)
            await exercise_failure(failing.url, out)
            await exercise_judge(judge.url, out)

        asyncio.run(exercise())
    finally:
        for process in processes:
            process.stop()
    real_cases(out)
    adapter_cases(out)
    negative_cases(out)
    labels = [(it.group, it.label) for it in out.items]
    assert len(labels) == len(set(labels)), "labels must be unique within a group"
    results, import_s = run_validator(out.items)
    yield Checked(out, results, import_s)


# ---- tests ------------------------------------------------------------------------------------------------


def test_the_validator_accepts_real_sglang_answers(checked: Checked) -> None:
    """Calibration: what a real SGLang 0.5.23 server wrote passes every check, with nothing extra or different."""
    assert_outcomes(checked, "real")
    print(f"SGLang import in the validator: {checked.import_s:.1f} s")


def test_the_validator_turns_down_what_sglang_would(checked: Checked) -> None:
    """The checks can fail: wrong types, SGLang's refusals, unknown keys, shapes SGLang does not write."""
    assert_outcomes(checked, "negative")


def test_our_requests_are_accepted_by_sglang(checked: Checked) -> None:
    """The main turns (EXACT flags, explicit sampling), the teacher's scoring, the reloader's pause/update/
    continue and the judge's vote parse, pass SGLang's request checks, and carry no key SGLang would ignore."""
    assert_outcomes(checked, "requests")
    requests = {it.label: it.payload for it, _ in checked.group("requests")}
    non_streamed = requests["engine-length main turn non-streamed"]
    assert {k: non_streamed[k] for k in EXACT_NON_STREAMED} == EXACT_NON_STREAMED
    streamed = requests["engine-length main turn streamed"]
    assert streamed["stream"] is True and {k: streamed[k] for k in EXACT_STREAMED} == EXACT_STREAMED
    assert requests["engine-length update"] == {
        "model_path": "/tmp/turnstream-weights/length/1",
        "weight_version": "1",
    }
    assert requests["engine-length pause"] == {"mode": "retract"}


def test_the_proxys_adapter_is_the_one_sglang_serves(checked: Checked) -> None:
    """Under LoRA the proxy routes by ``lora_path``; SGLang would prefer an adapter named in ``model``, so the
    proxy takes it out, keeping a served name with colons whole (the client's model name is kept where it can be:
    what SGLang echoes in the response)."""
    assert_outcomes(checked, "adapters")
    assert len(checked.group("adapters")) == 24
    assert without_adapter("qwen3:4b", "qwen3:4b") == "qwen3:4b"
    assert without_adapter("qwen3:4b:turnstream-v1", "qwen3:4b") == "qwen3:4b"
    assert without_adapter("policy", None) == "policy"


def test_stub_refusals_are_sglangs(checked: Checked) -> None:
    """A stream SGLang refuses is refused by the stub with SGLang's status, body and exact words."""
    assert_outcomes(checked, "refusals")
    for it, result in checked.group("refusals"):
        exchange = checked.collected.exchanges[it.label]
        assert exchange.status == 400
        assert exchange.json() == {
            "object": "error",
            "message": result["refused"],
            "type": "BadRequest",
            "param": None,
            "code": 400,
        }


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_stub_engine_answers_are_sglangs(checked: Checked, finish: str) -> None:
    """Every chat (each flag combination), stream event, refusal, /generate and admin answer of the stub engine
    is what SGLang's classes parse and what SGLang itself would write for it."""
    assert_outcomes(checked, f"engine-{finish}")


def test_stub_engine_streams_in_sglangs_order(checked: Checked) -> None:
    """Role chunk first, one chunk per token, the finish chunk, then sglext, then usage, then [DONE]; no token
    ids or metadata on the content chunks; EOS's log-probs alone in a chunk without content."""
    ex = checked.collected.exchanges
    events = ex[
        "engine-stop stream logprobs+return_input_ids_in_sglext+return_output_ids_in_sglext+stream_options"
    ]
    data = [json.loads(e) for e in events.events()[:-1]]
    assert events.events()[-1] == "[DONE]"
    assert data[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    content = [d["choices"][0] for d in data[1:4]]
    assert [c["delta"]["content"] for c in content] == [" w0", " w1", " w2"]
    assert all(len(c["logprobs"]["content"]) == 1 and set(c) == {
        "index", "delta", "logprobs", "finish_reason", "matched_stop"} for c in content)  # fmt: skip
    eos = data[4]["choices"][0]
    assert (
        eos["delta"] == {"reasoning_content": None} and eos["logprobs"]["content"][0]["token"] == "<|im_end|>"
    )
    assert data[5]["choices"][0]["finish_reason"] == "stop" and data[5]["choices"][0]["matched_stop"] == 2
    assert data[6]["choices"] == [] and data[6]["usage"] is None
    assert data[6]["sglext"] == {"input_ids": list(range(1000, 1030)), "output_ids": [[2000, 2001, 2002, 2]]}
    assert data[7]["choices"] == [] and data[7]["usage"]["completion_tokens"] == 4 and "sglext" not in data[7]
    assert all("metadata" not in d and "weight_version" not in json.dumps(d) for d in data)
    plain = [json.loads(e) for e in ex["engine-length stream plain"].events()[:-1]]
    assert [d["choices"][0]["finish_reason"] for d in plain] == [None, None, None, None, "length"]
    assert all(d["choices"][0]["logprobs"] is None for d in plain)
    two = [json.loads(e) for e in ex["engine-length stream n=2"].events()[:-1]]
    assert [c["index"] for d in two for c in d["choices"]] == [0, 0, 1, 1, 0, 1, 0, 1, 0, 1]
    assert two[-2]["sglext"]["output_ids"] == [[2000, 2001, 2002]] * 2
    assert two[-1]["usage"]["completion_tokens"] == 6 and two[-1]["usage"]["prompt_tokens"] == 30
    main = ex["engine-length main turn streamed"]
    assert {len(e.get("sglext", {})) for e in map(json.loads, main.events()[:-1])} == {0, 2}


def test_stub_engine_weight_update_is_reported_everywhere(checked: Checked) -> None:
    """After /update_weights_from_disk with a version: /model_info, /v1/models, responses' metadata and spans,
    /generate's meta_info all say the new version and path, as SGLang does."""
    facts = checked.collected.facts
    update = checked.collected.exchanges["engine-length update"].json()
    assert update == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 1.",
        "num_paused_requests": 0,
    }
    assert facts["engine-length chat"].weight_version == "0"
    info = facts["engine-length info after"]
    assert info["weight_version"] == "1" and info["model_path"] == "/tmp/turnstream-weights/length/1"
    assert info["served_model_name"] == info["model_path"]
    assert [m["id"] for m in facts["engine-length models after"]] == [info["model_path"]]
    chat = facts["engine-length chat after"]
    assert chat.weight_version == "1"
    assert chat.raw["metadata"] == {
        "weight_version": "1",
        "weight_versions": [{"version": "1", "start": 0, "end": 3}],
    }
    assert facts["engine-length score after"].weight_version == "1"


def test_stub_engine_answers_work_with_our_client(checked: Checked) -> None:
    """The client's own parsing of the stub's answers: exact ids and log-probs (EOS included when it stopped),
    the teacher's scoring aligned token by token."""
    facts = checked.collected.facts
    length, stop = facts["engine-length chat"], facts["engine-stop chat"]
    assert length.prompt_token_ids == list(range(1000, 1030))
    assert length.token_ids == [2000, 2001, 2002] and length.finish_reason == "length"
    assert stop.token_ids == [2000, 2001, 2002, 2] and stop.finish_reason == "stop"
    assert stop.message["content"] == " w0 w1 w2" and len(stop.logprobs or []) == 4
    scored = facts["engine-length score top2"]
    assert scored.token_ids == [2000 + i for i in range(5)] and len(scored.logprobs) == 5
    assert scored.topk_token_ids is not None and all(row[0] == t for row, t in zip(
        scored.topk_token_ids, scored.token_ids, strict=True))  # fmt: skip


def test_stub_judge_answers_are_sglangs(checked: Checked) -> None:
    """The judge stub answers as SGLang: the verdict text, the flags SGLang takes, its refusal, its info."""
    assert_outcomes(checked, "judge")
    facts = checked.collected.facts
    assert facts["judge vote"].endswith("\\boxed{-1}")
    assert [m["id"] for m in facts["judge models"]] == ["stub-judge"]
    cut = facts["judge cut"]["choices"][0]
    assert cut["finish_reason"] == "length" and len(cut["logprobs"]["content"]) == 2


def test_the_fields_the_proxy_counts_as_the_engines_are_sglangs() -> None:
    """``proxy.max_extra_bytes`` bounds the fields SGLang's chat API does not read: the proxy's list of the fields
    it does read (``ENGINE_FIELDS``) is exactly its ``ChatCompletionRequest``'s, so no field SGLang uses is ever
    refused as extra, and the list is updated with the pinned version."""
    from services.proxy.validation import ENGINE_FIELDS

    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} does not exist: create it with `bash scripts/setup-sglang.sh`")
    read = (
        "import json; from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest as R; "
        "print(json.dumps(sorted(R.model_fields)))"
    )
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(STANDIN), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [str(SGLANG_PYTHON), "-c", read], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(json.loads(out.stdout.splitlines()[-1])) == ENGINE_FIELDS
