"""SGLang's throughput (the real SGLang 0.5.23 server that ``turnstream engine`` starts) against a plain
transformers baseline, in one process run (report the ratios: this machine is noisy). Prints one JSON object.

    .venv/bin/python bench/engine.py [--new-tokens 64] [--concurrency 8] [--levels 1,8] [--score-len 512]
                                     [--engine-url http://127.0.0.1:30000]

Without ``--engine-url`` it starts SGLang itself (``EngineProcess``: SmolLM2-135M-Instruct, fp32, one thread;
70-100 s of start-up on a 2-core machine, its log in a temporary file) and stops it at the end; with it, it
measures the server already running there (the baseline then loads that server's ``model_path`` when it is a
folder on this machine, else SmolLM2).

- generate_single: one greedy generation of N tokens (EOS ignored, ``/generate``): SGLang over HTTP vs
  ``model.generate``.
- generate_concurrent[C], for each level C (``--levels``, default 1 and ``--concurrency``): C such generations
  sent at once to SGLang (aggregate tokens/s) vs the same C run one after another with ``model.generate`` (what a
  server without concurrent batching would do); ``sglang_per_request_tokens_per_s`` is what each of the C
  requests saw (N over its own latency, averaged).
- score: log-probs of every token of a sequence (``max_new_tokens`` 0, ``logprob_start_len`` 0) vs one
  forward pass + log_softmax + gather.
Both sides use one torch thread (a server given with ``--engine-url`` runs with whatever it was started with)
and run one after the other, never at the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.engine.model_store import fetch_smollm2
from services.engine.launch import SGLANG_VERSION, EngineProcess

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."

Figures = dict[str, Any]
"""``generate_single`` and ``score`` (tokens/s), ``generate_concurrent`` ({level: tokens/s})."""


def baseline(model_path: Path, new_tokens: int, levels: list[int], score_len: int) -> Figures:
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([tok(PROMPT).input_ids])
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    concurrent: dict[str, float] = {}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        single = new_tokens / (time.perf_counter() - t0)
        for c in levels:
            t0 = time.perf_counter()
            for _ in range(c):
                model.generate(ids, **kw)
            concurrent[str(c)] = c * new_tokens / (time.perf_counter() - t0)
        seq = torch.tensor([[(i * 7919) % 40000 + 100 for i in range(score_len)]])
        t0 = time.perf_counter()
        reps = 4
        for _ in range(reps):
            lps = torch.log_softmax(model(seq).logits[0, :-1].float(), dim=-1)
            lps.gather(1, seq[0, 1:, None])
        score = reps * score_len / (time.perf_counter() - t0)
    return {"generate_single": single, "generate_concurrent": concurrent, "score": score}


async def engine_side(
    url: str, new_tokens: int, levels: list[int], score_len: int
) -> tuple[Figures, Figures]:
    """SGLang's figures, and each level's per-request tokens/s."""
    gen = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }

    async def generate(http: httpx.AsyncClient) -> float:
        """One generation; its latency in seconds."""
        t0 = time.perf_counter()
        r = await http.post(url + "/generate", json=gen)
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == new_tokens, r.text
        return took

    concurrent: dict[str, float] = {}
    per_request: dict[str, float] = {}
    # One connection per request in flight, so that C requests really reach the server at once.
    clients = [httpx.AsyncClient(timeout=600) for _ in range(max(levels, default=1))]
    try:
        http = clients[0]
        warm = {**gen, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = await http.post(url + "/generate", json=warm)  # warm-up
        assert r.status_code == 200, r.text
        single = new_tokens / await generate(http)
        for c in levels:
            t0 = time.perf_counter()
            took = await asyncio.gather(*(generate(clients[i]) for i in range(c)))
            concurrent[str(c)] = c * new_tokens / (time.perf_counter() - t0)
            per_request[str(c)] = sum(new_tokens / t for t in took) / c
        seq = [(i * 7919) % 40000 + 100 for i in range(score_len)]
        body = {
            "input_ids": seq,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        reps = 4
        t0 = time.perf_counter()
        for _ in range(reps):
            r = await http.post(url + "/generate", json=body)
            assert len(r.json()["meta_info"]["input_token_logprobs"]) == score_len, r.text
        score = reps * score_len / (time.perf_counter() - t0)
    finally:
        for client in clients:
            await client.aclose()
    return {"generate_single": single, "generate_concurrent": concurrent, "score": score}, per_request


def server_info(url: str) -> dict[str, Any]:
    """What the server says it is: SGLang's version, device, dtype, attention backend and model."""
    info = httpx.get(url + "/server_info", timeout=30).json()
    model = httpx.get(url + "/model_info", timeout=30).json()
    return {
        "server": f"SGLang {info.get('version')}",
        **{k: info.get(k) for k in ("device", "dtype", "attention_backend")},
        "model_path": model.get("model_path"),
    }


def rounded(figures: Figures) -> Figures:
    return {k: rounded(v) if isinstance(v, dict) else round(v, 1) for k, v in figures.items()}


def ratios(top: Figures, bottom: Figures) -> Figures:
    return {
        k: ratios(v, bottom[k]) if isinstance(v, dict) else round(v / bottom[k], 3) for k, v in top.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="the highest concurrency level")
    ap.add_argument(
        "--levels", default=None, help="concurrency levels, comma-separated (default 1,CONCURRENCY)"
    )
    ap.add_argument("--score-len", type=int, default=512)
    ap.add_argument("--engine-url", default=None, help="measure this running SGLang instead of starting one")
    args = ap.parse_args()
    levels = sorted({int(x) for x in (args.levels or f"1,{args.concurrency}").split(",")})

    engine_log = None
    if args.engine_url:
        url = args.engine_url.rstrip("/")
        info = server_info(url)
        served = Path(str(info["model_path"]))
        model_path = served if served.is_dir() else fetch_smollm2(log=False)
        sglang, per_request = asyncio.run(engine_side(url, args.new_tokens, levels, args.score_len))
    else:
        model_path = fetch_smollm2(log=False)
        # SGLang's own output would swamp the JSON on stdout: it goes to a file, named in the result.
        log = tempfile.NamedTemporaryFile("w", prefix="turnstream-bench-sglang-", suffix=".log", delete=False)
        engine_log = log.name
        with log, EngineProcess(model_path, log=log) as engine:
            info = server_info(engine.url)
            sglang, per_request = asyncio.run(
                engine_side(engine.url, args.new_tokens, levels, args.score_len)
            )
    base = baseline(model_path, args.new_tokens, levels, args.score_len)
    print(
        json.dumps(
            {
                "engine": {
                    **info,
                    "expected": f"SGLang {SGLANG_VERSION}",
                    "started_here": engine_log is not None,
                    **({"log": engine_log} if engine_log else {"url": args.engine_url}),
                },
                "baseline": f"transformers model.generate, {model_path.name} (fp32, 1 torch thread)",
                "new_tokens": args.new_tokens,
                "levels": levels,
                "score_len": args.score_len,
                "tokens_per_s": {"sglang": rounded(sglang), "transformers_baseline": rounded(base)},
                "sglang_per_request_tokens_per_s": rounded(per_request),
                "ratio_sglang_over_baseline": ratios(sglang, base),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
