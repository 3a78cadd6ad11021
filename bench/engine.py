"""Engine throughput against a plain transformers baseline, in one process run (report the ratios: this
machine is noisy). Prints one JSON object.

    .venv/bin/python bench/engine.py [--new-tokens 64] [--concurrency 8] [--score-len 512]

- generate_single: one greedy generation of N tokens (EOS ignored): engine over HTTP vs ``model.generate``.
- generate_concurrent: C generations at once through the engine vs the same C run one after another with
  ``model.generate`` (what a server without concurrency would do).
- score: log-probs of every token of a sequence (``max_new_tokens`` 0, ``logprob_start_len`` 0) vs one
  forward pass + log_softmax + gather.
Both sides use one torch thread and run one after the other, never at the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.engine.launch import EngineProcess
from services.model_store import fetch_smollm2

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def baseline(model_path: Path, new_tokens: int, concurrency: int, score_len: int) -> dict[str, float]:
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([tok(PROMPT).input_ids])
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        single = new_tokens / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(concurrency):
            model.generate(ids, **kw)
        sequential = concurrency * new_tokens / (time.perf_counter() - t0)
        seq = torch.tensor([[(i * 7919) % 40000 + 100 for i in range(score_len)]])
        t0 = time.perf_counter()
        reps = 4
        for _ in range(reps):
            lps = torch.log_softmax(model(seq).logits[0, :-1].float(), dim=-1)
            lps.gather(1, seq[0, 1:, None])
        score = reps * score_len / (time.perf_counter() - t0)
    return {"generate_single": single, "generate_concurrent": sequential, "score": score}


async def engine_side(url: str, new_tokens: int, concurrency: int, score_len: int) -> dict[str, float]:
    gen = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }
    async with httpx.AsyncClient(timeout=600) as http:
        await http.post(url + "/generate", json={**gen, "sampling_params": {"max_new_tokens": 4}})  # warm-up
        t0 = time.perf_counter()
        r = await http.post(url + "/generate", json=gen)
        assert len(r.json()["output_ids"]) == new_tokens
        single = new_tokens / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(http.post(url + "/generate", json=gen) for _ in range(concurrency)))
        assert all(len(x.json()["output_ids"]) == new_tokens for x in rs)
        concurrent = concurrency * new_tokens / (time.perf_counter() - t0)
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
            assert len(r.json()["meta_info"]["input_token_logprobs"]) == score_len
        score = reps * score_len / (time.perf_counter() - t0)
    return {"generate_single": single, "generate_concurrent": concurrent, "score": score}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--score-len", type=int, default=512)
    args = ap.parse_args()
    model_path = fetch_smollm2(log=False)
    base = baseline(model_path, args.new_tokens, args.concurrency, args.score_len)
    with EngineProcess(model_path) as engine:
        eng = asyncio.run(engine_side(engine.url, args.new_tokens, args.concurrency, args.score_len))
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct (fp32, 1 torch thread)",
                "new_tokens": args.new_tokens,
                "concurrency": args.concurrency,
                "score_len": args.score_len,
                "tokens_per_s": {
                    "engine": {k: round(v, 1) for k, v in eng.items()},
                    "transformers_baseline": {k: round(v, 1) for k, v in base.items()},
                },
                "ratio_engine_over_baseline": {k: round(eng[k] / base[k], 3) for k in eng},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
