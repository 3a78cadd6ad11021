"""The console's HTML, rendered on the server from ``queries.py``'s data: no front-end build, no script needed to
read a page (the overview refreshes itself with a meta tag). Everything user-supplied is escaped."""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d232b; background: #f6f7f9; }
header { background: #1d232b; color: #fff; padding: 10px 20px; display: flex; gap: 18px; align-items: baseline; }
header a { color: #cfe3ff; text-decoration: none; } header b { font-size: 16px; margin-right: 10px; }
main { padding: 16px 20px; max-width: 1200px; }
table { border-collapse: collapse; background: #fff; margin: 8px 0 18px; }
th, td { border: 1px solid #dde1e6; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #eef1f4; } .num { text-align: right; font-variant-numeric: tabular-nums; }
.flow { display: flex; gap: 8px; flex-wrap: wrap; margin: 8px 0 18px; }
.stage { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 8px 12px; min-width: 110px; }
.stage .n { font-size: 20px; font-weight: 600; } .arrow { align-self: center; color: #8a94a0; }
.msg { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 6px 10px; margin: 6px 0;
       white-space: pre-wrap; } .role { color: #5b6470; font-size: 12px; text-transform: uppercase; }
.heat { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 8px; line-height: 1.9;
        white-space: pre-wrap; } .tok { border-radius: 2px; }
.legend span { display: inline-block; padding: 0 6px; margin-right: 4px; border-radius: 2px; }
.muted { color: #6b7480; } .bad { color: #b3261e; } .good { color: #1e7b34; }
"""

NAV = [("/", "Overview"), ("/sessions", "Sessions"), ("/versions", "Versions")]


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def page(title: str, body: str, *, refresh_s: int | None = None) -> str:
    nav = "".join(f'<a href="{href}">{name}</a>' for href, name in NAV)
    meta = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}'
        f'<link rel="icon" href="data:,"><title>{esc(title)} · turnstream</title>'
        f"<style>{CSS}</style></head><body><header><b>turnstream</b>{nav}</header>"
        f"<main><h1>{esc(title)}</h1>{body}</main></body></html>"
    )


def not_found(what: str) -> str:
    return page("Not found", f'<p class="muted">{esc(what)}</p><p><a href="/">Back to the overview</a></p>')


def when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows) or (
        f'<tr><td colspan="{len(headers)}" class="muted">none</td></tr>'
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def overview(data: dict[str, Any]) -> str:
    stages = []
    for i, s in enumerate(data["flow"]):
        if i:
            stages.append('<div class="arrow">→</div>')
        stages.append(
            f'<div class="stage" data-stage="{esc(s["stage"])}"><div class="muted">{esc(s["stage"])}</div>'
            f'<div class="n">{s["total"]}</div><div class="muted">{s["per_min"]:.1f}/min</div></div>'
        )
    kinds = table(
        ["sample kind", "samples"], [[esc(k), str(n)] for k, n in sorted(data["samples_by_kind"].items())]
    )
    lag = data.get("lag")
    lags = (
        table(
            ["consumer group", "records behind"],
            [[esc(g), f'<span class="num">{n}</span>'] for g, n in lag.items()],
        )
        if lag is not None
        else '<p class="muted">not measured yet</p>'
    )
    dead = table(
        ["consumer group", "error", "records"],
        [[esc(d["consumer_group"]), esc(d["error_kind"]), str(d["n"])] for d in data["dead_letters"]],
    )
    return page(
        "Overview",
        f'<div class="flow">{"".join(stages)}</div><h2>Samples by kind</h2>{kinds}'
        f"<h2>Consumer lag</h2>{lags}<h2>Dead letters</h2>{dead}"
        f"<h2>Recent versions</h2>{_versions_table(data['versions'])}",
        refresh_s=10,
    )


STEP_FIGURES = [
    ("clip_fraction", "clip fraction"),
    ("kl_rollout", "KL to rollout"),
    ("grad_norm", "grad norm"),
]
"""The training step's figures shown per version (``WeightsPublished.figures``)."""


def _versions_table(rows: Sequence[dict[str, Any]]) -> str:
    personas = sorted({p for r in rows for p in (r.get("heldout") or {})})
    kinds = sorted({k for r in rows for k in (r.get("reward_by_kind") or {})})
    body = []
    for r in rows:
        held = r.get("heldout") or {}
        rewards = r.get("reward_by_kind") or {}
        body.append(
            [
                f"v{r['version']}",
                when(r.get("created_at")),
                *(f'<span class="num">{_fmt(rewards.get(k), 2)}</span>' for k in kinds),
                f'<span class="num">{_fmt(r.get("mean_response_tokens"), 1)}</span>',
                *(
                    f'<span class="num">{_fmt((r.get("figures") or {}).get(f), 4)}</span>'
                    for f, _ in STEP_FIGURES
                ),
                *(
                    f'<span class="num">{_fmt(100 * held[p], 0) if p in held else ""}</span>'
                    for p in personas
                ),
            ]
        )
    headers = [
        "version",
        "published",
        *(f"reward {k}" for k in kinds),
        "response tokens",
        *(name for _, name in STEP_FIGURES),
        *(f"held-out {p} %" for p in personas),
    ]
    return table(headers, body)


VERSIONS_SHOWN = 200
"""The versions page's table holds the newest so many (its curve, every version; ``/api/versions``, all)."""


def versions(rows: Sequence[dict[str, Any]], curve: Sequence[dict[str, Any]]) -> str:
    note = (
        f'<p class="muted">The newest {len(rows)} versions; every one: <a href="/api/versions">/api/versions</a>.</p>'
        if len(rows) >= VERSIONS_SHOWN
        else ""
    )
    return page("Versions", _curve(curve) + note + _versions_table(rows))


def _curve(rows: Sequence[dict[str, Any]]) -> str:
    """The held-out learning curve per persona as an inline SVG (no script)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for persona, score in (r.get("heldout") or {}).items():
            points.setdefault(persona, []).append((r["version"], score))
    if not points:
        return '<p class="muted">No held-out evaluation yet (turnstream eval).</p>'
    w, h, pad = 640, 220, 30
    top = max(v for series in points.values() for v, _ in series) or 1
    colours = ["#1f6feb", "#d9480f", "#2f9e44", "#862e9c"]
    lines = []
    for i, (persona, series) in enumerate(sorted(points.items())):
        xy = " ".join(
            f"{pad + (w - 2 * pad) * v / top:.1f},{h - pad - (h - 2 * pad) * s:.1f}" for v, s in series
        )
        colour = colours[i % len(colours)]
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{xy}"/>')
        lines.append(
            f'<text x="{w - pad + 4}" y="{pad + 14 * i}" fill="{colour}" font-size="12">{esc(persona)}</text>'
        )
    axes = (
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#8a94a0"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#8a94a0"/>'
        f'<text x="{pad}" y="{h - 8}" font-size="11">v0</text><text x="{w - pad - 20}" y="{h - 8}" font-size="11">'
        f'v{top}</text><text x="2" y="{pad + 4}" font-size="11">100%</text>'
    )
    label = 'role="img" aria-label="held-out score per version"'
    return f'<svg width="{w + 90}" height="{h}" {label}>{axes}{"".join(lines)}</svg>'


def sessions(
    rows: Sequence[dict[str, Any]], users: Sequence[str], query: str, outcome: str, user: str
) -> str:
    options = "".join(
        f'<option value="{o}"{" selected" if o == outcome else ""}>{o or "any outcome"}</option>'
        for o in ("", "good", "bad", "neutral", "unjudged")
    )
    people = "".join(
        f'<option value="{esc(u)}"{" selected" if u == user else ""}>{esc(u) or "any user / persona"}</option>'
        for u in ("", *users)
    )
    form = (
        f'<form method="get"><input name="q" value="{esc(query)}" placeholder="session id contains">'
        f'<select name="user" aria-label="user or persona">{people}</select>'
        f'<select name="outcome" aria-label="outcome">{options}</select><button>Filter</button></form>'
    )
    body = [
        [
            f'<a href="/sessions/{quote(r["session_id"], safe="")}">{esc(r["session_id"])}</a>',
            esc(r["user"]),
            f'<span class="num">{r["turns"]}</span>',
            when(r["last_at"]),
            f"v{r['version']}",
            f'<span class="{"good" if r["outcome"] == "good" else "bad" if r["outcome"] == "bad" else "muted"}">'
            f"{esc(r['outcome'])}</span>",
        ]
        for r in rows
    ]
    return page(
        "Sessions",
        form + table(["session", "user / persona", "turns", "last turn", "version", "outcome"], body),
    )


def session(session_id: str, turns: Sequence[dict[str, Any]]) -> str:
    body = [
        [
            f'<a href="/turns/{quote(t["turn_id"], safe="")}">{t["turn_index"]}</a>',
            when(t["created_at"]),
            f"v{t['weight_version']}",
            esc(_text(t["response"].get("content"))[:160]),
        ]
        for t in turns
    ]
    return page(f"Session {session_id}", table(["turn", "at", "version", "response"], body))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _messages(messages: Sequence[dict[str, Any]] | None) -> str:
    if not messages:
        return '<p class="muted">none</p>'
    return "".join(
        f'<div class="msg"><div class="role">{esc(m.get("role", ""))}</div>{esc(_text(m.get("content")))}</div>'
        for m in messages
    )


GAP_CLIP = 2.0
"""Nats at which the heat map's colour saturates."""


def gap_colour(gap: float) -> str:
    """Green where the teacher (with the hint) likes the token more than the policy did, red where less."""
    alpha = min(abs(gap), GAP_CLIP) / GAP_CLIP
    return f"rgba(0, 160, 0, {alpha:.2f})" if gap >= 0 else f"rgba(200, 0, 0, {alpha:.2f})"


def heat_map(tokens: Sequence[str], gaps: Sequence[float]) -> str:
    cells = "".join(
        f'<span class="tok" style="background: {gap_colour(g)}" title="{g:+.3f}" data-gap="{g:.6f}">{esc(t)}</span>'
        for t, g in zip(tokens, gaps, strict=True)
    )
    legend = (
        f'<div class="legend muted"><span style="background: {gap_colour(GAP_CLIP)}">teacher prefers</span>'
        f'<span style="background: {gap_colour(-GAP_CLIP)}">teacher avoids</span> (teacher − rollout log-prob per'
        f" response token, saturating at {GAP_CLIP:g} nats)</div>"
    )
    return f'<div class="heat">{cells}</div>{legend}'


def turn(data: dict[str, Any], token_text: Callable[[list[int]], list[str]]) -> str:
    parts = [
        f'<p class="muted">session <a href="/sessions/{quote(data["session_id"], safe="")}">'
        f"{esc(data['session_id'])}</a> · turn {data['turn_index']} · {when(data['created_at'])} · answered by "
        f"v{data['weight_version']}</p>",
        "<h2>Request</h2>",
        _messages(data["messages"]),
        "<h2>Response</h2>",
        _messages([data["response"]]),
        "<h2>Next state</h2>",
        _messages(data["next_state"])
        if data["next_state"] is not None
        else f'<p class="muted">{esc(data["terminal_reason"] or "not paired yet")}</p>',
        "<h2>Judges</h2>",
    ]
    votes = []
    for j in data["judgments"]:
        for i, v in enumerate(j["votes"]):
            votes.append(
                [
                    esc(j["judge_id"]),
                    esc(j["kind"]),
                    str(i + 1),
                    esc("" if v.get("score") is None else v["score"]),
                    esc(v.get("hint") or ""),
                    f'<div class="msg">{esc(v.get("raw", ""))}</div>',
                ]
            )
    parts.append(table(["judge", "kind", "vote", "score", "hint", "raw text"], votes))
    chosen = [j for j in data["judgments"] if j["kind"] == "hint" and j["accepted"]]
    if chosen:
        parts.append(f"<p>Chosen hint ({esc(chosen[0]['judge_id'])}): <b>{esc(chosen[0]['hint'])}</b></p>")
    parts.append("<h2>What the teacher taught, token by token</h2>")
    tokens = token_text(data["response_token_ids"])
    if data["teacher"]:
        for t in data["teacher"]:
            parts.append(f'<p class="muted">under the hint of {esc(t["judge_id"])}: {esc(t["hint"])}</p>')
            parts.append(heat_map(tokens, t["gap"]))
    else:
        parts.append('<p class="muted">no teacher scores for this turn</p>')
    sample = data["sample"]
    parts.append("<h2>Sample</h2>")
    if sample is None:
        parts.append('<p class="muted">no sample (yet, or the dispatcher emitted none for this turn)</p>')
    else:
        trained = data["trained_into"]
        parts.append(
            table(
                [
                    "kind",
                    "mode",
                    "reward",
                    "advantage (mean per token, as trained)",
                    "version",
                    "trained into",
                ],
                [
                    [
                        esc(sample["kind"]),
                        esc(sample["mode"]),
                        f"{sample['reward']:+.1f}",
                        "not trained yet" if data["advantage"] is None else f"{data['advantage']:+.4f}",
                        f"v{sample['weight_version']}",
                        "not yet" if trained is None else f"v{trained}",
                    ]
                ],
            )
        )
    return page(f"Turn {data['turn_id']}", "".join(parts))
