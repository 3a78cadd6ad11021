"""``turnstream replay drive``: recorded sessions' user messages sent through the proxy again, so the current
policy answers them and fresh on-policy turns are recorded.

Each session starts from its first request's messages; after each fresh answer, the next state the user sent
originally (their next message) is appended and sent. A next state holding tool results ends the session there:
those results answered the old tool calls, not the ones the policy makes now. Re-driven sessions get their own
session ids (``<id>~<tag>``) so their turns are numbered from 1 and never mix with the originals.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import defaultdict
from typing import Any

import httpx
import msgspec

from schemas import Turn
from services.replay.records import OpenClawRecord

log = logging.getLogger("turnstream.replay")


class Script(msgspec.Struct):
    session_id: str
    first: list[dict[str, Any]]
    """The first request's messages."""
    follow: list[list[dict[str, Any]]]
    """What the user added after each answer, in order."""
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    cut_at_tool: bool = False
    """The original went on with tool results, which cannot be replayed."""


class DriveSummary(msgspec.Struct):
    tag: str
    sessions: int
    turns_sent: int
    turns_failed: int
    sessions_cut_at_tool_results: int
    session_ids: list[str]


def _added(prev: list[dict[str, Any]], following: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ``following`` adds after ``prev`` and the assistant message that answered it."""
    n = len(prev)
    return following[n + 1 :] if len(following) > n + 1 else following[-1:]


def scripts(records: list[Turn] | list[OpenClawRecord]) -> list[Script]:
    """One script per session, from recorded turns or OpenClaw records (turns in order; a gap ends it)."""
    sessions: dict[str, list[tuple[int, list[dict[str, Any]], list[dict[str, Any]]]]] = defaultdict(list)
    for r in records:
        index = r.turn_index if isinstance(r, Turn) else r.turn
        tools = list(r.tools) if isinstance(r, Turn) else []
        sessions[r.session_id].append((index, [msgspec.to_builtins(m) for m in r.messages], tools))
    out: list[Script] = []
    for sid, rows in sorted(sessions.items()):
        rows.sort(key=lambda row: row[0])
        script = Script(sid, rows[0][1], [], rows[0][2])
        for (i, prev, _), (j, following, _) in itertools.pairwise(rows):
            if j != i + 1:
                break
            added = _added(prev, following)
            if any(m.get("role") == "tool" for m in added):
                script.cut_at_tool = True
                break
            script.follow.append(added)
        out.append(script)
    return out


async def drive(
    scripts_: list[Script],
    proxy_url: str,
    tag: str,
    *,
    concurrency: int = 4,
    max_tokens: int = 128,
    api_key: str | None = None,
    model: str = "policy",
) -> DriveSummary:
    """Send every script through the proxy at ``proxy_url`` (ending in /v1), ``concurrency`` sessions at once."""
    sent = failed = 0
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = proxy_url.rstrip("/") + "/chat/completions"

    async def one(http: httpx.AsyncClient, script: Script) -> None:
        nonlocal sent, failed
        sid = f"{script.session_id}~{tag}"
        history = list(script.first)
        steps: list[list[dict[str, Any]]] = [[], *script.follow]
        async with gate:
            for i, added in enumerate(steps):
                history += added
                body: dict[str, Any] = {"model": model, "messages": history, "max_tokens": max_tokens}
                if script.tools:
                    body["tools"] = script.tools
                done = "true" if i == len(steps) - 1 else "false"
                try:
                    r = await http.post(
                        url, json=body, headers={**headers, "X-Session-Id": sid, "X-Session-Done": done}
                    )
                    r.raise_for_status()
                    message = r.json()["choices"][0]["message"]
                except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                    failed += 1
                    log.warning(
                        "re-driven turn failed; session stops", extra={"session": sid, "error": repr(exc)}
                    )
                    return
                sent += 1
                answer: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
                if message.get("tool_calls"):
                    answer["tool_calls"] = message["tool_calls"]
                history.append(answer)

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(one(http, s) for s in scripts_))
    return DriveSummary(
        tag,
        len(scripts_),
        sent,
        failed,
        sum(s.cut_at_tool for s in scripts_),
        [f"{s.session_id}~{tag}" for s in scripts_],
    )
