"""What each console page shows, read from the projection (``projection.py``). Plain data: ``pages.py`` renders
it, and the JSON API returns it as is. A query for an id the projection does not hold returns None (a 404)."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from runtime.pipeline.promotion import fold
from schemas import VersionDecision
from services.console.projection import loads

RECENT_S = 300.0
"""The window of the overview's rates."""


def overview(db: sqlite3.Connection) -> dict[str, Any]:
    now = time.time()
    since = now - RECENT_S

    def count(sql: str, *args: Any) -> int:
        return int(db.execute(sql, args).fetchone()[0])

    stages = [
        ("turns", "turns", "created_at"),
        ("paired", "pairs", "paired_at"),
        ("judged", "judgments", "created_at"),
        ("teacher", "teacher", "created_at"),
        ("samples", "samples", "created_at"),
        ("versions", "versions", "created_at"),
    ]
    flow = [
        {
            "stage": name,
            "total": count(f"SELECT COUNT(*) FROM {table}"),
            "per_min": count(f"SELECT COUNT(*) FROM {table} WHERE {column} >= ?", since) * 60.0 / RECENT_S,
        }
        for name, table, column in stages
    ]
    kinds = {r["kind"]: r["n"] for r in db.execute("SELECT kind, COUNT(*) AS n FROM samples GROUP BY kind")}
    dead = [dict(r) for r in db.execute(
        "SELECT consumer_group, error_kind, COUNT(*) AS n FROM dead_letters GROUP BY consumer_group, error_kind"
    )]  # fmt: skip
    unpaired = {
        r["reason"]: r["n"]
        for r in db.execute(
            "SELECT CASE WHEN p.terminal_reason = 'idle_timeout' AND t.turn_index = 1 THEN 'no_session' "
            "ELSE p.terminal_reason END AS reason, COUNT(*) AS n FROM pairs p LEFT JOIN turns t USING (turn_id) "
            "WHERE p.terminal_reason IS NOT NULL GROUP BY reason"
        )
    }
    return {
        "flow": flow,
        "samples_by_kind": kinds,
        "unpaired": unpaired,
        "dead_letters": dead,
        "versions": versions(db, last=10),
    }


def versions(db: sqlite3.Connection, last: int | None = None) -> list[dict[str, Any]]:
    """Per weight version, oldest first: the step that made it, the training traffic it answered (reward mean by
    kind and mean response length of samples it produced) and its held-out evaluation; ``last``: only the newest
    so many versions (each read is then a range of the version-ordered indexes)."""
    out: dict[int, dict[str, Any]] = {}
    newest = db.execute(
        "SELECT MAX(v) FROM (SELECT MAX(version) AS v FROM versions "
        "UNION ALL SELECT MAX(weight_version) FROM version_traffic)"
    ).fetchone()[0]
    since = -1 if last is None or newest is None else newest - last + 1
    for r in db.execute(
        "SELECT version, created_at, samples_trained, figures FROM versions WHERE version >= ? ORDER BY version",
        (since,),
    ):
        out[r["version"]] = {
            "version": r["version"],
            "created_at": r["created_at"],
            "samples_trained": r["samples_trained"],
            "figures": loads(r["figures"]),
        }
    for r in db.execute(
        "SELECT weight_version, kind, reward_sum / samples AS reward, 1.0 * length_sum / samples AS length, "
        "samples AS n FROM version_traffic WHERE weight_version >= ?",
        (since,),
    ):
        row = out.setdefault(r["weight_version"], {"version": r["weight_version"], "figures": {}})
        row.setdefault("reward_by_kind", {})[r["kind"]] = r["reward"]
        row.setdefault("samples", 0)
        row["samples"] += r["n"]
        row.setdefault("_length", []).append((r["length"], r["n"]))
    for r in db.execute(
        "SELECT version, scores, mean_words FROM evals WHERE version >= ? ORDER BY evaluated_at", (since,)
    ):
        row = out.setdefault(r["version"], {"version": r["version"], "figures": {}})
        row["heldout"] = loads(r["scores"])
        row["heldout_words"] = r["mean_words"]
    promotion = fold(_decisions(db))
    for v, state in promotion.states.items():
        if v >= since:
            out.setdefault(v, {"version": v, "figures": {}})["state"] = state
    for r in db.execute(
        "SELECT version, reason FROM decisions WHERE version >= ? AND state NOT IN ('pinned', 'unpinned', "
        "'restored') ORDER BY rowid",
        (since,),
    ):
        out[r["version"]]["reason"] = r["reason"]
    for v in (promotion.serving,) if promotion.decisions else ():
        if v in out:
            out[v]["serving"] = True
    for row in out.values():
        lengths = row.pop("_length", [])
        if lengths:
            row["mean_response_tokens"] = sum(length * n for length, n in lengths) / sum(
                n for _, n in lengths
            )
    return [out[v] for v in sorted(out)]


def _decisions(db: sqlite3.Connection) -> list[VersionDecision]:
    """Every decision on ``versions``, in the order they were written."""
    return [
        VersionDecision(
            version=r["version"], state=r["state"], reason=r["reason"], by=r["by"], decided_at=r["decided_at"]
        )
        for r in db.execute("SELECT version, state, reason, by, decided_at FROM decisions ORDER BY rowid")
    ]


def decisions(db: sqlite3.Connection, last: int = 50) -> dict[str, Any]:
    """Under a gate: what users are served (the fold of every decision, as the proxy makes it) and the newest
    decisions with their reasons and the checks that failed."""
    promotion = fold(_decisions(db))
    rows = db.execute(
        "SELECT version, state, reason, by, decided_at, against, checks FROM decisions ORDER BY rowid DESC LIMIT ?",
        (last,),
    ).fetchall()
    return {
        "decisions": promotion.decisions,
        "serving": promotion.serving,
        "promoted": promotion.promoted,
        "pinned": promotion.pinned,
        "failed_streak": promotion.failed_streak,
        "recent": [
            {
                **{k: r[k] for k in ("version", "state", "reason", "by", "decided_at", "against")},
                "failed_checks": [c for c in loads(r["checks"]) if not c["passed"]],
            }
            for r in rows
        ],
    }


def heldout_curve(db: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every version's held-out scores, oldest first: the learning curve."""
    rows = db.execute("SELECT version, scores FROM evals ORDER BY version").fetchall()
    return [{"version": r["version"], "heldout": loads(r["scores"])} for r in rows]


def sessions(
    db: sqlite3.Connection, query: str = "", outcome: str = "", user: str = "", limit: int = 50
) -> list[dict[str, Any]]:
    """Recent sessions, newest first; ``query`` filters by id substring, ``user`` by the requests' OpenAI ``user``
    (the simulated users' persona), ``outcome`` by the last judged turn's score (``good`` +1, ``bad`` -1,
    ``neutral`` 0, or ``unjudged``). One indexed read of the projection's ``sessions`` table."""
    where: list[str] = ["turns > 0"]
    args: list[Any] = []
    if query:
        where.append("session_id LIKE ? ESCAPE '\\'")
        args.append("%" + query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")
    if user:
        where.append("user = ?")
        args.append(user)
    if outcome:
        where.append("outcome = ?")
        args.append(outcome)
    rows = db.execute(
        "SELECT session_id, user, turns, first_at, last_at, version, outcome FROM sessions "
        f"WHERE {' AND '.join(where)} ORDER BY last_at DESC LIMIT ?",
        (*args, limit),
    ).fetchall()
    return [dict(r) for r in rows]


def users(db: sqlite3.Connection, limit: int = 100) -> list[str]:
    """The distinct ``user`` values sessions were recorded with (for the filter's choices)."""
    rows = db.execute(
        "SELECT DISTINCT user FROM sessions WHERE user != '' ORDER BY user LIMIT ?", (limit,)
    ).fetchall()
    return [r[0] for r in rows]


def session(db: sqlite3.Connection, session_id: str) -> list[dict[str, Any]] | None:
    rows = db.execute(
        "SELECT turn_id, turn_index, created_at, weight_version, response FROM turns WHERE session_id = ? "
        "ORDER BY turn_index",
        (session_id,),
    ).fetchall()
    if not rows:
        return None
    return [{**dict(r), "response": loads(r["response"])} for r in rows]


def turn(db: sqlite3.Connection, turn_id: str) -> dict[str, Any] | None:
    """Everything about one turn: request, response, next state, each judge's votes, the hint the teacher
    scored and the per-token teacher - rollout gap, the sample, and the version that trained on it."""
    t = db.execute("SELECT * FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
    if t is None:
        return None
    pair = db.execute("SELECT * FROM pairs WHERE turn_id = ?", (turn_id,)).fetchone()
    judgments = [
        {**dict(j), "votes": loads(j["votes"]), "accepted": bool(j["accepted"])}
        for j in db.execute("SELECT * FROM judgments WHERE turn_id = ? ORDER BY judge_id, kind", (turn_id,))
    ]
    rollout = loads(t["response_logprobs"])
    teacher = [
        {
            "judge_id": r["judge_id"],
            "hint": r["hint"],
            "gap": [a - b for a, b in zip(loads(r["teacher_logprobs"]), rollout, strict=True)],
        }
        for r in db.execute("SELECT * FROM teacher WHERE turn_id = ? ORDER BY judge_id", (turn_id,))
    ]
    sample = db.execute("SELECT * FROM samples WHERE sample_id = ?", (turn_id,)).fetchone()
    trained = db.execute("SELECT version, advantage FROM trained WHERE sample_id = ?", (turn_id,)).fetchone()
    return {
        "turn_id": t["turn_id"],
        "session_id": t["session_id"],
        "turn_index": t["turn_index"],
        "created_at": t["created_at"],
        "weight_version": t["weight_version"],
        "messages": loads(t["messages"]),
        "response": loads(t["response"]),
        "response_token_ids": loads(t["response_token_ids"]),
        "response_logprobs": rollout,
        "next_state": None if pair is None else loads(pair["next_state"]),
        "terminal_reason": None if pair is None else pair["terminal_reason"],
        "judgments": judgments,
        "teacher": teacher,
        "sample": None if sample is None else dict(sample),
        "trained_into": None if trained is None else int(trained[0]),
        "advantage": None if trained is None else trained[1],
    }
