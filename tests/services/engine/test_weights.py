"""Weight updates: new weights change the outputs and the reported version; requests in flight complete on the
weights they started with; users are never refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.services.engine.conftest import EngineProcess


@pytest.fixture
def fresh_engine(smollm2_path: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(smollm2_path)
    yield proc
    proc.stop()


SCORE = {
    "text": "The capital of France is Paris.",
    "sampling_params": {"max_new_tokens": 0},
    "return_logprob": True,
    "logprob_start_len": 0,
}


async def test_reload_changes_outputs_and_version_while_in_flight_requests_complete(
    fresh_engine: EngineProcess, perturbed_weights: Path
) -> None:
    url = fresh_engine.url
    async with httpx.AsyncClient(timeout=300) as http:
        before = (await http.post(url + "/generate", json=SCORE)).json()["meta_info"]
        assert before["weight_version"] == "0"

        # A long streamed request is running when the update starts.
        chunks: list[dict[str, Any]] = []
        streaming = asyncio.Event()

        async def long_stream() -> None:
            body = {
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 120,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks) >= 5:
                            streaming.set()

        stream_task = asyncio.create_task(long_stream())
        await asyncio.wait_for(streaming.wait(), 120)
        # Requests sent during the update are answered (never refused), by whichever weights are current.
        update = asyncio.create_task(
            http.post(
                url + "/update_weights_from_disk",
                json={"model_path": str(perturbed_weights), "weight_version": "1"},
            )
        )
        during = []
        while not update.done():
            r = await http.post(
                url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}
            )
            during.append(r.status_code)
        result = (await update).json()
        assert result["success"] is True, result
        assert during and set(during) == {200}
        await stream_task

    token_ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert len(token_ids) == 120, "the in-flight request completed in full"
    assert chunks[-1]["metadata"]["weight_version"] == "0", "it finished on the weights it started with"

    async with httpx.AsyncClient(timeout=300) as http:
        info = (await http.get(url + "/get_model_info")).json()
        after = (await http.post(url + "/generate", json=SCORE)).json()["meta_info"]
    assert info["weight_version"] == "1" and info["model_path"] == str(perturbed_weights)
    assert after["weight_version"] == "1"
    diffs = [
        abs(a[0] - b[0])
        for a, b in zip(before["input_token_logprobs"][1:], after["input_token_logprobs"][1:], strict=True)
    ]
    assert max(diffs) > 0.05, "new weights give different log-probs"
