"""The checks of scripts/gpu-smoke.sh, run inside the turnstream image on the compose network.

    python smoke_check.py turns        # main turns recorded exactly; log-probs equal prefill; samples published
    python smoke_check.py served N     # after the trainer step: SGLang serves version N (with LoRA: its adapter)
                                       # and the next turn has it

Every check prints ``PASS <what>`` or ``FAIL <what>: <why>`` and a failure exits 1. Settings come from the
environment compose gives the turnstream services (TURNSTREAM_KAFKA_*), plus SMOKE_PROXY_URL, SMOKE_ENGINE_URL
and SMOKE_LOGPROB_TOL (SGLang runs the smoke model in float32, so prefill and decode agree to ~1e-5).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import httpx

from runtime.configuration.config import load_config
from runtime.engine.client import adapter_name
from runtime.messaging.bus import EventProducer, read_topic
from schemas import Sample, Turn
from schemas.topics import SAMPLES, TURNS

PROXY = os.environ.get("SMOKE_PROXY_URL", "http://proxy:8000")
ENGINE = os.environ.get("SMOKE_ENGINE_URL", "http://sglang-policy:30000")
TOL = float(os.environ.get("SMOKE_LOGPROB_TOL", "1e-3"))
# The keys compose gives the proxy's container, where this runs: the proxy's, and the engine's API key (never its
# admin key: only the reloader updates weights).
PROXY_AUTH = {"Authorization": f"Bearer {os.environ.get('TURNSTREAM_PROXY_API_KEY', '')}"}
ENGINE_AUTH = {"Authorization": f"Bearer {os.environ.get('TURNSTREAM_ENGINE_API_KEY', '')}"}
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
failed = False


def check(ok: bool, what: str, why: str = "") -> None:
    global failed
    print(f"{'PASS' if ok else 'FAIL'} {what}" + ("" if ok else f": {why}"), flush=True)
    failed |= not ok


async def turns_of(count: int, within_s: float = 120) -> list[Turn]:
    config = load_config()
    deadline = time.monotonic() + within_s
    while True:
        turns = [r.event async for r in read_topic(config.kafka, TURNS)]
        if len(turns) >= count or time.monotonic() > deadline:
            return turns
        await asyncio.sleep(1)


async def prefill(http: httpx.AsyncClient, prompt: list[int], response: list[int]) -> list[float]:
    body = {
        "input_ids": prompt + response,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
    }
    data = (await http.post(ENGINE + "/generate", json=body, headers=ENGINE_AUTH)).json()
    return [e[0] for e in data["meta_info"]["input_token_logprobs"][1:]]


async def chat(http: httpx.AsyncClient, session: str, body: dict[str, Any]) -> str:
    headers = {**PROXY_AUTH, "X-Session-Id": session, "X-Turn-Type": "main"}
    if not body.get("stream"):
        r = await http.post(PROXY + "/v1/chat/completions", json=body, headers=headers)
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"])
    text = []
    async with http.stream("POST", PROXY + "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text.append((c.get("delta") or {}).get("content") or "")
    return "".join(text)


async def turns_check() -> None:
    async with httpx.AsyncClient(timeout=300) as http:
        plain = {"messages": QUESTION, "max_tokens": 24, "temperature": 0}
        await chat(http, "smoke-plain", plain)
        await chat(http, "smoke-stream", {**plain, "temperature": 0.6, "stream": True})
        turns = {t.session_id: t for t in await turns_of(2)}
        check(set(turns) >= {"smoke-plain", "smoke-stream"}, "both main turns recorded", str(sorted(turns)))
        if failed:
            return
        direct = (
            await http.post(
                ENGINE + "/v1/chat/completions", json={**plain, "return_token_ids": True}, headers=ENGINE_AUTH
            )
        ).json()["choices"][0]
        t = turns["smoke-plain"]
        check(
            t.prompt_token_ids == direct["prompt_token_ids"]
            and t.response_token_ids == direct["response_token_ids"],
            "non-streamed turn has SGLang's exact prompt and response ids",
        )
        for name, turn in turns.items():
            scored = await prefill(http, turn.prompt_token_ids, turn.response_token_ids)
            gap = max(abs(a - b) for a, b in zip(scored, turn.response_logprobs, strict=True))
            check(
                gap < TOL, f"{name}: recorded log-probs equal prefill scoring (max gap {gap:.2e})", f"> {TOL}"
            )
        stream = turns["smoke-stream"]
        check(stream.sampling.temperature == 0.6, "streamed turn records its temperature")
        check(
            len(stream.response_token_ids) == len(stream.response_logprobs) > 0, "streamed ids and log-probs"
        )
        async with EventProducer(load_config().kafka) as producer:
            for turn in turns.values():
                n = len(turn.response_token_ids)
                sample = Sample(
                    sample_id=turn.turn_id,
                    session_id=turn.session_id,
                    mode="rl",
                    kind="rl",
                    tokens=turn.prompt_token_ids + turn.response_token_ids,
                    response_length=n,
                    loss_mask=[1] * n,
                    rollout_logprobs=turn.response_logprobs,
                    reward=1.0 if turn.session_id == "smoke-plain" else -1.0,
                    weight_version=turn.weight_version,
                    created_at=time.time(),
                )
                await producer.send(SAMPLES, sample, turn.session_id)
        print("published 2 samples for the trainer step", flush=True)


async def served_check(version: int) -> None:
    lora = load_config().lora_adapters  # compose.one-gpu.yaml: the version is an adapter beside the base
    async with httpx.AsyncClient(timeout=300) as http:
        deadline = time.monotonic() + 180
        info: Any = {}
        while time.monotonic() < deadline:
            if lora:
                info = [
                    m["id"]
                    for m in (await http.get(ENGINE + "/v1/models", headers=ENGINE_AUTH)).json()["data"]
                ]
                if adapter_name(version) in info:
                    break
            else:
                info = (await http.get(ENGINE + "/model_info", headers=ENGINE_AUTH)).json()
                if str(info.get("weight_version")) == str(version):
                    break
            await asyncio.sleep(1)
        served = adapter_name(version) in info if lora else str(info.get("weight_version")) == str(version)
        check(served, f"SGLang serves version {version}{' as a LoRA adapter' if lora else ''}", str(info))
        await chat(
            http, "smoke-after", {"messages": QUESTION, "max_tokens": 8, "temperature": 0, "stream": True}
        )
        after = [t for t in await turns_of(3) if t.session_id == "smoke-after"]
        check(bool(after) and after[0].weight_version == version, f"the next turn carries version {version}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["turns"]:
        asyncio.run(turns_check())
    elif sys.argv[1:2] == ["served"]:
        asyncio.run(served_check(int(sys.argv[2])))
    else:
        sys.exit(__doc__)
    sys.exit(1 if failed else 0)
