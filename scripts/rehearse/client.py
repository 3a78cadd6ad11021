"""The rehearsal's user: the OpenAI Python SDK from the host, through the proxy's published port, as a person's
client would talk to a GPU host.

    python client.py talk BASE_URL --sessions N --turns T [--tag TAG]   # multi-turn sessions, streamed and not
    python client.py served BASE_URL VERSION [--within S]               # a new turn carries VERSION (or newer)

Sessions carry OpenClaw-RL's headers (``X-Session-Id``, ``X-Turn-Type: main``; the last turn ``X-Session-Done``),
so each turn pairs with the next user message. Every check prints ``PASS <what>`` or ``FAIL <what>: <why>``; a
failure exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from openai import OpenAI

QUESTIONS = (
    "Name three colours of the rainbow.",
    "No, answer in one word.",
    "Thanks. What is two plus two?",
    "Say it as a word, please.",
)
failed = False


def check(ok: bool, what: str, why: str = "") -> None:
    global failed
    print(f"{'PASS' if ok else 'FAIL'} {what}" + ("" if ok else f": {why}"), flush=True)
    failed |= not ok


def version_of(response: Any) -> int | None:
    """The policy version SGLang's ``metadata`` names (the proxy relabels it with the adapter's under LoRA). The
    SDK's ChatCompletion declares ``metadata``; a chunk keeps it among its extra fields."""
    metadata = getattr(response, "metadata", None) or (response.model_extra or {}).get("metadata") or {}
    version = metadata.get("weight_version")
    return None if version is None else int(version)


def turn(
    client: OpenAI, messages: list[dict[str, Any]], headers: dict[str, str], stream: bool
) -> tuple[str, int | None]:
    """One chat turn; the answer and the weight version the response names."""
    args: dict[str, Any] = {
        "model": "policy",
        "messages": messages,
        "max_tokens": 24,
        "extra_headers": headers,
    }
    if not stream:
        done = client.chat.completions.create(**args)
        return done.choices[0].message.content or "", version_of(done)
    text: list[str] = []
    version = None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        version = version_of(chunk) if version_of(chunk) is not None else version
        text += [c.delta.content or "" for c in chunk.choices]
    return "".join(text), version


def talk(base_url: str, sessions: int, turns: int, tag: str) -> None:
    client = OpenAI(base_url=base_url, api_key=os.environ["PROXY_API_KEY"], timeout=600, max_retries=0)
    answered = streamed = 0
    for s in range(sessions):
        sid, messages = f"rehearse-{tag}-{s}", []
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            headers = {"X-Session-Id": sid, "X-Turn-Type": "main"}
            if t == turns - 1:
                headers["X-Session-Done"] = "true"
            stream = (s + t) % 2 == 1
            try:
                answer, _ = turn(client, messages, headers, stream)
            except Exception as exc:  # reported as a failed check, the rest still runs
                check(False, f"{sid} turn {t + 1}", repr(exc))
                continue
            messages.append({"role": "assistant", "content": answer})
            answered += 1
            streamed += stream
    want = sessions * turns
    check(answered == want, f"{answered}/{want} turns answered through the proxy ({streamed} streamed)", "")


def served(base_url: str, version: int, within_s: float) -> None:
    client = OpenAI(base_url=base_url, api_key=os.environ["PROXY_API_KEY"], timeout=600, max_retries=0)
    deadline, seen = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        headers = {
            "X-Session-Id": f"rehearse-served-{time.monotonic_ns()}",
            "X-Turn-Type": "main",
            "X-Session-Done": "true",
        }
        _, seen = turn(client, [{"role": "user", "content": QUESTIONS[0]}], headers, stream=False)
        if seen is not None and seen >= version:
            break
        time.sleep(5)
    ok = seen is not None and seen >= version
    check(ok, f"a new turn is answered by weight version {seen} (wanted {version} or newer)", "")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("talk")
    t.add_argument("base_url")
    t.add_argument("--sessions", type=int, default=3)
    t.add_argument("--turns", type=int, default=3)
    t.add_argument("--tag", default="a")
    v = sub.add_parser("served")
    v.add_argument("base_url")
    v.add_argument("version", type=int)
    v.add_argument("--within", type=float, default=600)
    a = ap.parse_args()
    if a.command == "talk":
        talk(a.base_url, a.sessions, a.turns, a.tag)
    else:
        served(a.base_url, a.version, a.within)
    sys.exit(1 if failed else 0)
