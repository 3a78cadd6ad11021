"""Sessions as JSONL, one turn per line, in two formats.

``turns``: each line is a ``Turn`` exactly as on the ``turns`` topic (token ids, log-probs, weight version):
lossless, so an export imported elsewhere re-derives to the same samples.

``openclaw``: OpenClaw-RL's record (what its proxy writes with ``OPENCLAW_RECORD_ENABLED=1``), one JSON object
per turn with ``session_id``, ``turn``, ``timestamp``, ``messages`` (the request), ``prompt_text`` (the prompt as
the model saw it, chat template applied), ``response_text`` (the response as the model generated it, decoded
with its special tokens: it ends with the template's end token, e.g. ``<|im_end|>``), ``tool_calls`` and
``next_state`` (the next message, an object with its role, or null when the session ended there; a string, as
turnstream's export wrote before, is read as a user message). It carries no token ids or log-probs, so importing
it means tokenizing again and scoring the responses with the current policy.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from schemas import RECORDED_SESSION_ID_MAX, Message, PairedTurn, ToolCall, Turn, session_id_problem

Format = Literal["turns", "openclaw"]


class OpenClawRecord(msgspec.Struct, kw_only=True, omit_defaults=False):
    session_id: str
    turn: int
    messages: list[Message]
    prompt_text: str = ""
    response_text: str = ""
    tool_calls: list[ToolCall] | None = None
    next_state: Message | str | None = None
    timestamp: str | None = None


class BadLine(ValueError):
    def __init__(self, number: int, reason: str) -> None:
        super().__init__(f"line {number}: {reason}")
        self.number = number


def to_openclaw(
    turn: Turn, paired: PairedTurn | None, prompt_text: str, response_text: str
) -> OpenClawRecord:
    """The record OpenClaw-RL's proxy would have written: the next state is the next request's last message (one
    message, as OpenClaw keeps it)."""
    state = paired.next_state if paired is not None else None
    return OpenClawRecord(
        session_id=turn.session_id,
        turn=turn.turn_index,
        messages=turn.messages,
        prompt_text=prompt_text,
        response_text=response_text,
        tool_calls=turn.response.tool_calls,
        next_state=state[-1] if state else None,
        timestamp=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(turn.completed_at)),
    )


_turn_decoder = msgspec.json.Decoder(Turn)
_openclaw_decoder = msgspec.json.Decoder(OpenClawRecord)
_any_decoder = msgspec.json.Decoder(dict[str, Any])


def parse_line(number: int, line: bytes) -> Turn | OpenClawRecord:
    """A line in either format (told apart by its fields), validated; ``BadLine`` says what is wrong. Session ids
    follow the proxy's rules (``schemas/ids.py``): an import cannot bring in a session the proxy would refuse."""
    try:
        fields = _any_decoder.decode(line)
        record: Turn | OpenClawRecord
        if "turn_id" in fields:
            record = _turn_decoder.decode(line)  # the contract checks turn_id names its session and turn
        elif "session_id" in fields and "turn" in fields:
            record = _openclaw_decoder.decode(line)
            if not record.messages:
                raise BadLine(number, "messages must not be empty")
        else:
            raise BadLine(
                number, "neither a turnstream Turn (turn_id) nor an OpenClaw record (session_id, turn)"
            )
    except BadLine:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise BadLine(number, str(exc)) from None
    except RecursionError:
        raise BadLine(number, "nested too deeply") from None
    if (problem := session_id_problem(record.session_id, RECORDED_SESSION_ID_MAX)) is not None:
        raise BadLine(number, problem)
    return record


def read_jsonl(path: str) -> tuple[list[Turn | OpenClawRecord], list[BadLine]]:
    """Every record of the file and every bad line (blank lines are skipped)."""
    good: list[Turn | OpenClawRecord] = []
    bad: list[BadLine] = []
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                good.append(parse_line(number, line))
            except BadLine as exc:
                bad.append(exc)
    return good, bad


def encode_line(record: Turn | OpenClawRecord) -> bytes:
    return msgspec.json.encode(record) + b"\n"
