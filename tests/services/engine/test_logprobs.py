"""The real SGLang server's log-probs are the model's: equal to a direct transformers forward pass (what the
trainer computes) and consistent between sampling and scoring. turnstream relies on all of it: the proxy records
sampled log-probs as the PPO ratio's denominator and the teacher scores by prefill."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from runtime.engine.client import EngineClient
from services.engine.launch import EngineProcess

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is"


def generate(engine: EngineProcess, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(engine.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def reference_logprobs(hf_model: Any, ids: list[int]) -> torch.Tensor:
    model, _ = hf_model
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_input_logprobs_equal_a_transformers_forward(engine: EngineProcess, hf_model: Any) -> None:
    _, tok = hf_model
    ids = tok(TEXT).input_ids
    data = generate(
        engine,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    entries = data["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(ids)
    assert entries[0][0] is None and entries[0][1] == ids[0]
    ref = reference_logprobs(hf_model, ids)
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    got = [e[0] for e in entries[1:]]
    assert [e[1] for e in entries] == ids
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4


def test_top_logprobs_are_the_models_top_k(engine: EngineProcess, hf_model: Any) -> None:
    _, tok = hf_model
    ids = tok(TEXT).input_ids
    k = 5
    data = generate(
        engine,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 3,
            "top_logprobs_num": k,
        },
    )
    rows = data["meta_info"]["input_top_logprobs"]
    assert len(rows) == len(ids) - 3 and rows[0] is None
    ref = reference_logprobs(hf_model, ids)
    for j, row in enumerate(rows[1:], start=1):
        pos = 3 + j - 1  # the distribution at this position predicts ids[3 + j]
        values, top_ids = torch.topk(ref[pos], k)
        assert [e[1] for e in row] == top_ids.tolist()
        assert max(abs(e[0] - v) for e, v in zip(row, values.tolist(), strict=True)) < 1e-4


def test_sampled_output_logprobs_equal_rescoring(engine: EngineProcess, hf_model: Any) -> None:
    _, tok = hf_model
    prompt = tok("Write a short poem about the sea.").input_ids
    data = generate(
        engine,
        {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": 24,
                "temperature": 0.9,
                "top_p": 0.95,
                "sampling_seed": 7,
                "ignore_eos": True,
            },
            "return_logprob": True,
        },
    )
    out_ids = data["output_ids"]
    out = data["meta_info"]["output_token_logprobs"]
    assert len(out_ids) == 24 and [e[1] for e in out] == out_ids
    # Re-score prompt + sampled tokens in one forward pass (and through the engine's scoring path).
    ref = reference_logprobs(hf_model, prompt + out_ids)
    expected = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(out_ids)]
    assert max(abs(e[0] - x) for e, x in zip(out, expected, strict=True)) < 1e-4
    rescored = generate(
        engine,
        {
            "input_ids": prompt + out_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
        },
    )["meta_info"]["input_token_logprobs"][1:]
    assert max(abs(a[0] - b[0]) for a, b in zip(out, rescored, strict=True)) < 1e-4


@pytest.mark.parametrize("start", [0, 1, 10, 19])
def test_scoring_returns_exactly_the_requested_number_of_logprobs(engine: EngineProcess, start: int) -> None:
    ids = list(range(100, 120))
    data = generate(
        engine,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        },
    )
    meta = data["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(ids) - start
    assert data["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}


async def test_client_score_aligns_one_logprob_per_response_token(
    engine: EngineProcess, hf_model: Any
) -> None:
    _, tok = hf_model
    prompt = tok("Question: what is two plus two?\nAnswer:").input_ids
    response = tok(" Four, of course.").input_ids
    client = EngineClient(engine.url)
    result = await client.score(prompt, response, top_k=3)
    assert result.token_ids == response and len(result.logprobs) == len(response)
    assert result.topk_token_ids is not None and all(len(r) == 3 for r in result.topk_token_ids)
    ref = reference_logprobs(hf_model, prompt + response)
    expected = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(response)]
    assert max(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)) < 1e-4


def test_greedy_generation_matches_transformers_generate(engine: EngineProcess, hf_model: Any) -> None:
    model, tok = hf_model
    ids = tok("The capital of France is").input_ids
    data = generate(
        engine,
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}},
    )
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert data["output_ids"] == ref[0, len(ids) :].tolist()
