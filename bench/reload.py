"""Time to first token while SGLang loads a weight version: the reloader's protocol (pause with ``retract``,
``/update_weights_from_disk``, continue) against a plain ``/update_weights_from_disk``, side by side in one run.
Prints one JSON object.

    .venv/bin/python bench/reload.py [--rounds 3] [--background 2] [--background-tokens 160] [--engine-url URL]

Each round, for each protocol in turn: ``--background`` long streams are generating; a weight version is loaded
(alternately SmolLM2 and a copy with its MLP down-projections scaled, so the weights really change); 50 ms later a
short streamed request arrives and its time to first token is measured, as is the load (from the first call to
the last answer). Without any load the same short request's time to first token is the baseline. Every request
must succeed. A plain update takes SGLang's writer lock, which waits for the running generations to finish and
queues new requests behind it; pause/retract does not wait for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from runtime.engine.client import EngineClient
from runtime.engine.model_store import fetch_smollm2
from services.engine.launch import EngineProcess

SHORT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


def perturbed_copy(model: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


async def first_token_s(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first chunk with content; raises on any failure."""
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                first = time.perf_counter() - t0
            if line.startswith("data: [DONE]"):
                break
    assert first is not None, "no content arrived"
    return first


async def one_round(
    http: httpx.AsyncClient,
    engine: EngineClient,
    protocol: str,
    path: Path,
    version: int,
    args: argparse.Namespace,
) -> dict[str, float]:
    long = {**SHORT, "max_tokens": args.background_tokens, "ignore_eos": True}
    started = [asyncio.Event() for _ in range(args.background)]

    async def background(i: int) -> None:
        async with http.stream(
            "POST", engine.base_url + "/v1/chat/completions", json={**long, "stream": True}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    started[i].set()

    tasks = [asyncio.create_task(background(i)) for i in range(args.background)]
    await asyncio.gather(*(e.wait() for e in started))

    async def load() -> float:
        t0 = time.perf_counter()
        if protocol == "pause_retract":
            await engine.pause_generation("retract")
            try:
                await engine.update_weights_from_disk(str(path), str(version))
            finally:
                await engine.continue_generation()
        else:
            await engine.update_weights_from_disk(str(path), str(version))
        return time.perf_counter() - t0

    loading = asyncio.create_task(load())
    await asyncio.sleep(0.05)
    ttft = await first_token_s(http, engine.base_url, SHORT)
    load_s = await loading
    await asyncio.gather(*tasks)  # every background stream completed
    return {"ttft_s": ttft, "load_s": load_s}


async def measure(url: str, weights: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    engine = EngineClient(url, timeout_s=900, retries=0)
    results: dict[str, list[dict[str, float]]] = {"pause_retract": [], "plain": []}
    version = 100
    async with httpx.AsyncClient(timeout=900) as http:
        await first_token_s(http, url, SHORT)  # warm-up
        baseline = [await first_token_s(http, url, SHORT) for _ in range(3)]
        for r in range(args.rounds):
            for protocol in ("pause_retract", "plain") if r % 2 == 0 else ("plain", "pause_retract"):
                version += 1
                results[protocol].append(
                    await one_round(http, engine, protocol, weights[version % 2], version, args)
                )
        info = (await http.get(url + "/model_info")).json()
    assert info["weight_version"] == str(version)

    def summary(rows: list[dict[str, float]]) -> dict[str, float]:
        return {
            "ttft_p50_s": statistics.median(x["ttft_s"] for x in rows),
            "ttft_max_s": max(x["ttft_s"] for x in rows),
            "load_p50_s": statistics.median(x["load_s"] for x in rows),
        }

    out = {name: summary(rows) for name, rows in results.items()}
    return {
        "baseline_ttft_p50_s": statistics.median(baseline),
        **out,
        "ttft_ratio_plain_over_pause_retract": out["plain"]["ttft_p50_s"]
        / out["pause_retract"]["ttft_p50_s"],
        "rounds": args.rounds,
        "background_streams": args.background,
        "background_tokens": args.background_tokens,
        "all_requests_succeeded": True,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--background", type=int, default=2)
    ap.add_argument("--background-tokens", type=int, default=160)
    ap.add_argument("--engine-url", help="an SGLang server already serving SmolLM2 (default: start one)")
    args = ap.parse_args()
    model = fetch_smollm2(log=False)
    with tempfile.TemporaryDirectory(prefix="turnstream-reload-") as tmp:
        weights = [model, perturbed_copy(model, Path(tmp) / "perturbed")]
        proc = None
        if args.engine_url:
            url = args.engine_url
        else:
            log = open(Path(tmp) / "engine.log", "w")
            proc = EngineProcess(model, log=log)
            url = proc.url
        try:
            result = asyncio.run(measure(url, weights, args))
        finally:
            if proc is not None:
                proc.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
