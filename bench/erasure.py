"""What sealing a record costs (``runtime/security/erasure``): AES-256-GCM seal and unseal of encoded turns of several
sizes, beside msgpack-encoding the same turn, in one process run. Prints JSON (microseconds per record, medians of
``--rounds``; ``seal_vs_encode`` is the ratio to compare, this machine being noisy).

    .venv/bin/python bench/erasure.py [--rounds 7] [--sizes 2000,20000,200000,1000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.security.erasure.envelope import new_key, seal, unseal
from schemas import Message, Turn, encode


def turn_of(chars: int) -> Turn:
    """A turn whose conversation is about ``chars`` characters, with a token id and log-prob per 4 characters."""
    tokens = max(chars // 4, 1)
    return Turn(
        turn_id="s-1:1",
        session_id="s-1",
        turn_index=1,
        messages=[Message(role="user", content="x" * chars)],
        response=Message(role="assistant", content="y" * (chars // 8)),
        prompt_token_ids=list(range(tokens)),
        response_token_ids=list(range(tokens // 8 or 1)),
        response_logprobs=[-0.5] * (tokens // 8 or 1),
        finish_reason="stop",
        weight_version=0,
        model="policy",
        created_at=time.time(),
        completed_at=time.time(),
    )


def per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="2000,20000,200000,1000000")
    args = ap.parse_args()
    key, out = new_key(), []
    for chars in (int(s) for s in args.sizes.split(",")):
        turn = turn_of(chars)
        plain = encode(turn)
        sealed = seal(key, "s-1", plain)
        n = max(20, 20_000_000 // max(len(plain), 1))
        rows: dict[str, list[float]] = {"encode": [], "seal": [], "unseal": []}
        for _ in range(args.rounds):  # interleaved, so that a noisy moment hits all three alike
            rows["encode"].append(per_call_us(lambda t=turn: encode(t), n))
            rows["seal"].append(per_call_us(lambda p=plain: seal(key, "s-1", p), n))
            rows["unseal"].append(per_call_us(lambda s=sealed: unseal(key, "s-1", s), n))
        med = {k: statistics.median(v) for k, v in rows.items()}
        out.append(
            {
                "record_bytes": len(plain),
                "encode_us": round(med["encode"], 2),
                "seal_us": round(med["seal"], 2),
                "unseal_us": round(med["unseal"], 2),
                "seal_vs_encode": round(med["seal"] / med["encode"], 3),
            }
        )
    print(json.dumps({"rounds": args.rounds, "records": out}, indent=2))


if __name__ == "__main__":
    main()
