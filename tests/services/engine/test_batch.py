"""Batched decoding computes, row by row, exactly what each request computes alone."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import torch

from services.engine.batch import DecodeBatch
from tests.services.engine.conftest import EngineProcess

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]
STEPS = 6


def _alone(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, logits = out.past_key_values, out.logits[0, -1]
    toks, lps = [], []
    for _ in range(STEPS):
        t = int(logits.argmax())
        toks.append(t)
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
    return toks, lps


def test_rows_joining_and_leaving_match_single_sequence_decoding(hf_model: Any) -> None:
    model, _ = hf_model
    with torch.inference_mode():
        reference = [_alone(model, p) for p in PROMPTS]
        batch = DecodeBatch(model)
        state: dict[int, dict[str, Any]] = {}

        def admit(i: int) -> None:
            out = model(torch.tensor([PROMPTS[i]]), use_cache=True)
            state[i] = {"logits": out.logits[0, -1], "toks": [], "lps": []}
            batch.add(i, out.past_key_values)

        admit(0)
        for rnd in range(STEPS + len(PROMPTS)):
            if 1 <= rnd < len(PROMPTS):
                admit(rnd)  # requests join a batch that is already decoding
            if not batch.jobs:
                break
            last, done = [], []
            for i in batch.jobs:
                logits = state[i]["logits"]
                t = int(logits.argmax())
                state[i]["toks"].append(t)
                state[i]["lps"].append(float(torch.log_softmax(logits, -1)[t]))
                last.append(t)
                if len(state[i]["toks"]) == STEPS:
                    done.append(i)
            logits = batch.step(last)
            for row, i in enumerate(batch.jobs):
                state[i]["logits"] = logits[row]
            batch.remove(done)  # rows leave as they finish; the padding prefix is trimmed
    for i, (toks, lps) in enumerate(reference):
        assert state[i]["toks"] == toks
        assert max(abs(a - b) for a, b in zip(state[i]["lps"], lps, strict=True)) < 1e-4


async def test_concurrent_requests_get_the_same_answers_as_alone(engine: EngineProcess) -> None:
    prompts = [
        "Name three fruits.",
        "What is the tallest mountain on Earth? Explain briefly.",
        "Hi",
        "Count to five.",
    ]

    def body(text: str) -> dict[str, Any]:
        return {
            "text": text,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        }

    async with httpx.AsyncClient(timeout=300) as http:
        alone = [(await http.post(engine.url + "/generate", json=body(p))).json() for p in prompts]
        together = [
            r.json()
            for r in await asyncio.gather(
                *(http.post(engine.url + "/generate", json=body(p)) for p in prompts)
            )
        ]
    for a, b in zip(alone, together, strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
        lb = [e[0] for e in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4
