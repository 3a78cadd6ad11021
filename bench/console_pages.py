"""The console's page times with 100,000 turns recorded (issue: "pages answer in under 200 ms").

Builds a projection from real events (``schemas``) through the console's own ``projection.apply``: sessions of
3 turns, each turn paired, judged (eval and hint votes), half of them taught by the teacher (a 40-token heat map),
a sample per turn, a weight version every 16 samples with its held-out evaluation, two personas as the requests'
``user``. Then serves the real app (uvicorn, ``runtime/transport/http_server.py``) and times each page over HTTP,
as a browser would fetch it, at the large size and at a small one (1,000 turns) in the same run: the ratio says
how the pages scale. The sessions page is also timed with the query it had before the ``sessions`` table (a
``GROUP BY`` over turns and one outcome query per session), the baseline of that change. Prints JSON.

    .venv/bin/python bench/console_pages.py [--turns 100000] [--small 1000] [--repeat 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.process.ports import free_port
from schemas import (
    EvalAnswer,
    EvalResult,
    Judgment,
    Message,
    PairedTurn,
    Sample,
    TeacherScores,
    Turn,
    Vote,
    WeightsPublished,
)
from services.console.app import create_app
from services.console.projection import apply, connect
from services.console.queries import sessions

PERSONAS = ("plain-short", "sign-off")
TOKENS = 40
TURNS_PER_SESSION = 3


def _events(i: int, t0: float) -> list[Any]:
    """Every event about turn ``i`` (session ``i // 3``)."""
    session, index = f"bench-{i // TURNS_PER_SESSION:07d}", i % TURNS_PER_SESSION + 1
    now = t0 + i * 0.05
    ids = [(i * 7 + k) % 49000 + 17 for k in range(TOKENS)]
    rollout = [-0.05 * (k % 9) for k in range(TOKENS)]
    turn = Turn(
        turn_id=f"{session}:{index}",
        session_id=session,
        turn_index=index,
        messages=[Message(role="user", content=f"Question number {i}: why is the sky blue?")],
        response=Message(role="assistant", content="Because of Rayleigh scattering of sunlight. " * 3),
        prompt_token_ids=list(range(1, 30)),
        response_token_ids=ids,
        response_logprobs=rollout,
        finish_reason="stop",
        weight_version=i // 16,
        model="policy",
        created_at=now,
        completed_at=now + 0.5,
        user=PERSONAS[(i // TURNS_PER_SESSION) % 2],
    )
    paired = PairedTurn(
        turn=turn, next_state=[Message(role="user", content="No, too long.")], paired_at=now + 1
    )
    score = (1, -1, 0)[i % 3]
    out: list[Any] = [
        turn,
        paired,
        Judgment(
            turn_id=turn.turn_id,
            session_id=session,
            judge_id="rules",
            kind="eval",
            votes=[Vote(raw=f"\\boxed{{{score}}}", score=score)],
            paired=paired,
            judge_model="rules",
            created_at=now + 2,
            eval_score=score,
        ),
    ]
    if i % 2 == 0:
        hint = "Please answer in one or two short sentences of plain text."
        out += [
            Judgment(
                turn_id=turn.turn_id,
                session_id=session,
                judge_id="rules",
                kind="hint",
                votes=[Vote(raw=f"\\boxed{{1}} [HINT_START]{hint}[HINT_END]", score=1, hint=hint)],
                paired=paired,
                judge_model="rules",
                created_at=now + 2,
                accepted=True,
                hint=hint,
            ),
            TeacherScores(
                turn_id=turn.turn_id,
                session_id=session,
                judge_id="rules",
                hint=hint,
                teacher_model="teacher",
                response_token_ids=ids,
                teacher_logprobs=[min(lp + 0.4 * ((k % 5) - 2), 0.0) for k, lp in enumerate(rollout)],
                created_at=now + 3,
            ),
        ]
    out.append(
        Sample(
            sample_id=turn.turn_id,
            session_id=session,
            mode="combine",
            kind="opd+rl" if i % 2 == 0 else "rl-only",
            tokens=[*range(1, 30), *ids],
            response_length=TOKENS,
            loss_mask=[1] * TOKENS,
            rollout_logprobs=rollout,
            reward=float(score) if score else 1.0,
            weight_version=i // 16,
            created_at=now + 4,
            teacher_logprobs=rollout if i % 2 else [lp - 0.1 for lp in rollout],
        )
    )
    if i % 16 == 15:
        v = i // 16 + 1
        out.append(
            WeightsPublished(
                version=v,
                path=f"/weights/v{v}",
                base_model="smollm2",
                step=v,
                created_at=now + 5,
                samples_trained=16,
                sample_ids=[
                    f"bench-{j // TURNS_PER_SESSION:07d}:{j % TURNS_PER_SESSION + 1}"
                    for j in range(i - 15, i + 1)
                ],
                figures={"clip_fraction": 0.05, "kl_rollout": 0.1, "grad_norm": 7.5},
            )
        )
        answers = [
            EvalAnswer(
                question=f"q{k}", answer="Short answer.", satisfied={"plain-short": True, "sign-off": False}
            )
            for k in range(16)
        ]
        out.append(
            EvalResult(
                version=v,
                question_set="heldout-16-bench",
                model="policy",
                answers=answers,
                scores={"plain-short": 1.0, "sign-off": 0.0},
                mean_words=2.0,
                evaluated_at=now + 6,
                duration_s=10.0,
            )
        )
    return out


def build(path: Path, turns: int) -> float:
    db = connect(path)
    started, t0 = time.monotonic(), time.time() - turns * 0.05
    batch: list[Any] = []
    for i in range(turns):
        batch += _events(i, t0)
        if len(batch) >= 5000:
            apply(db, batch)
            batch = []
    apply(db, batch)
    db.close()
    return time.monotonic() - started


def _old_sessions(db: sqlite3.Connection, limit: int = 50) -> list[Any]:
    """The sessions query before the ``sessions`` table (commit 1609170)."""
    rows = db.execute(
        "SELECT session_id, COUNT(*) AS turns, MIN(created_at) AS first_at, MAX(created_at) AS last_at, "
        "MAX(weight_version) AS version FROM turns WHERE session_id LIKE ? GROUP BY session_id "
        "ORDER BY last_at DESC LIMIT ?",
        ("%%", limit),
    ).fetchall()
    return [
        db.execute(
            "SELECT j.eval_score FROM judgments j JOIN turns t ON t.turn_id = j.turn_id "
            "WHERE t.session_id = ? AND j.kind = 'eval' AND j.eval_score IS NOT NULL "
            "ORDER BY t.turn_index DESC LIMIT 1",
            (r[0],),
        ).fetchone()
        for r in rows
    ]


def serve(path: Path) -> str:
    import uvicorn

    port = free_port()
    app = create_app(path, lambda ids: [f"t{i}" for i in ids], {"lag": {"turnstream-pairer": 0}})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    return f"http://127.0.0.1:{port}"


def pages(turns: int) -> dict[str, str]:
    last_session = f"bench-{(turns - 1) // TURNS_PER_SESSION:07d}"
    return {
        "overview": "/",
        "sessions": "/sessions",
        "sessions_by_persona": "/sessions?user=sign-off",
        "sessions_bad": "/sessions?outcome=bad",
        "sessions_search": f"/sessions?q={last_session[-5:]}",
        "session": f"/sessions/{last_session}",
        "turn": f"/turns/bench-{0:07d}:1",
        "versions": "/versions",
        "api_overview": "/api/overview",
        "missing_turn": "/turns/nope:1",
    }


def timed(base: str, paths: dict[str, str], repeat: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with httpx.Client(base_url=base, timeout=60) as http:
        for name, path in paths.items():
            http.get(path)  # warm: the first read maps the file
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                r = http.get(path)
                times.append((time.perf_counter() - t) * 1000)
                assert r.status_code in (200, 404), (path, r.status_code)
            times.sort()
            out[name] = {
                "p50_ms": round(statistics.median(times), 1),
                "p95_ms": round(times[int(0.95 * (len(times) - 1))], 1),
                "max_ms": round(times[-1], 1),
            }
    return out


def query_ms(path: Path, query: Any, repeat: int) -> float:
    """Median milliseconds of ``query(db)`` on a read-only connection, as the pages open it."""
    db = connect(path, readonly=True)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        query(db)
        times.append((time.perf_counter() - t) * 1000)
    db.close()
    return round(statistics.median(times), 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {"turns": args.turns, "small": args.small}
    with tempfile.TemporaryDirectory() as tmp:
        figures = {}
        for label, n in (("small", args.small), ("large", args.turns)):
            path = Path(tmp) / f"{label}.sqlite3"
            built = build(path, n)
            base = serve(path)
            figures[label] = {
                "build_s": round(built, 1),
                "file_mb": round(path.stat().st_size / 2**20, 1),
                "pages": timed(base, pages(n), args.repeat),
                "sessions_query_ms": query_ms(path, sessions, args.repeat),
                "sessions_query_before_ms": query_ms(path, _old_sessions, args.repeat),
            }
        result.update(figures)
        large = figures["large"]["pages"]
        result["slowest_page_p95_ms"] = max(p["p95_ms"] for p in large.values())
        result["under_200ms"] = all(p["p95_ms"] < 200 for p in large.values())
        result["large_vs_small_p50"] = {
            name: round(large[name]["p50_ms"] / max(figures["small"]["pages"][name]["p50_ms"], 0.1), 2)
            for name in large
        }
        result["sessions_query_speedup"] = round(
            figures["large"]["sessions_query_before_ms"] / max(figures["large"]["sessions_query_ms"], 0.01), 1
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
