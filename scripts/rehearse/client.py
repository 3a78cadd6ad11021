"""The rehearsal's user: the OpenAI Python SDK from the host, through the proxy's published port, as a person's
client would talk to a GPU host.

    python client.py talk BASE_URL --sessions N --turns T [--tag TAG]   # multi-turn sessions, streamed and not
    python client.py served BASE_URL VERSION [--within S]               # a new turn carries VERSION (or newer)
    python client.py apis BASE_URL                                      # the Responses and Messages APIs

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


def apis(base_url: str) -> None:
    """The agents' APIs through the composed proxy, each with its vendor's SDK: a Responses answer continued by
    ``previous_response_id`` (stored in the compose Redis) and streamed, and a Messages answer streamed and not."""
    import anthropic

    key = os.environ["PROXY_API_KEY"]
    client = OpenAI(base_url=base_url, api_key=key, timeout=600, max_retries=0)
    try:
        first = client.responses.create(model="policy", input=QUESTIONS[0], max_output_tokens=16)
        events = [
            e.type
            for e in client.responses.create(
                model="policy",
                previous_response_id=first.id,
                input=QUESTIONS[1],
                max_output_tokens=16,
                stream=True,
            )
        ]
        check(
            first.id.startswith("resp_")
            and events[0] == "response.created"
            and events[-1].startswith("response."),
            f"Responses API: an answer, continued by previous_response_id and streamed ({len(events)} events)",
        )
    except Exception as exc:
        check(False, "Responses API", repr(exc))
    claude = anthropic.Anthropic(
        base_url=base_url.removesuffix("/v1"), api_key=key, timeout=600, max_retries=0
    )
    try:
        said = [{"role": "user", "content": QUESTIONS[0]}]
        done = claude.messages.create(model="policy", max_tokens=16, messages=said)  # type: ignore[arg-type]
        with claude.messages.stream(model="policy", max_tokens=16, messages=said) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        check(
            done.type == "message" and final.usage.output_tokens > 0,
            f"Messages API: an answer ({done.stop_reason}) and a streamed one ({final.stop_reason})",
        )
    except Exception as exc:
        check(False, "Messages API", repr(exc))


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
    sub.add_parser("apis").add_argument("base_url")
    a = ap.parse_args()
    if a.command == "talk":
        talk(a.base_url, a.sessions, a.turns, a.tag)
    elif a.command == "apis":
        apis(a.base_url)
    else:
        served(a.base_url, a.version, a.within)
    sys.exit(1 if failed else 0)
