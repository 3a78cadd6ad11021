"""Judge prompts: template files rendered into chat messages (the judge engine applies its chat template).

Each kind (``eval``, ``hint``) has a system and a user template, ``<kind>.system.txt`` and ``<kind>.user.txt``,
with ``string.Template`` placeholders ``${response}``, ``${next_state}`` and ``${next_state_role}``. The defaults
ship in ``services/judge/prompts/`` and put the conversation's text between ``<response>`` and ``<next_state>``
tags, which that text cannot close (``as_data``), and tell the judge it is data; ``judge.prompts_dir`` points at
a folder that overrides any of the four files.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import Message, PairedTurn

DEFAULT_DIR = Path(__file__).with_name("prompts")
KINDS = ("eval", "hint")
FIELDS = ("response", "next_state", "next_state_role")


class PromptError(ValueError):
    pass


def message_text(m: Message) -> str:
    """The visible text of a message: text parts joined, other parts named, tool calls spelled out."""
    content = m.content
    if isinstance(content, list):
        parts = []
        for p in content:
            kind = str(p.get("type", "text"))
            parts.append(str(p.get("text", "")) if kind == "text" else f"[{kind}]")
        text = "".join(parts)
    else:
        text = content or ""
    calls = [f"[tool call] {c.function.name}({c.function.arguments})" for c in m.tool_calls or ()]
    return "\n".join(x for x in (text.strip(), *calls) if x)


def clip(text: str, limit: int) -> str:
    """Keep the head and tail of a long text (tool outputs can be huge), saying how much was cut."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


def next_state_text(messages: list[Message], limit: int) -> tuple[str, str]:
    """(text, role) of a next state of one or more messages, each labelled with its role."""
    roles = list(dict.fromkeys(m.role for m in messages))
    if len(messages) == 1:
        return clip(message_text(messages[0]), limit), roles[0]
    per = max(limit // len(messages), 200)
    blocks = []
    for m in messages:
        label = f"[{m.role}{' ' + m.name if m.name else ''}]"
        blocks.append(f"{label}\n{clip(message_text(m), per)}")
    return "\n\n".join(blocks), ", ".join(roles)


_DATA_TAGS = re.compile(r"<(\s*/?\s*(?:response|next_state)\s*)>", re.IGNORECASE)


def as_data(text: str) -> str:
    """Text from the conversation, made unable to close or open the tags the shipped prompts put around it: a
    user's ``</next_state>`` followed by instructions stays inside the data (issue 55: the user's text went into
    the judge's prompt verbatim). The tags' ``<`` become ``&lt;``; nothing else changes."""
    return _DATA_TAGS.sub(r"&lt;\1>", text)


@dataclass(frozen=True)
class PromptSet:
    templates: dict[str, tuple[string.Template, string.Template]]
    max_chars: int = 8000

    @classmethod
    def load(cls, directory: str | Path | None = None, max_chars: int = 8000) -> PromptSet:
        templates = {}
        for kind in KINDS:
            pair = []
            for part in ("system", "user"):
                name = f"{kind}.{part}.txt"
                path = Path(directory) / name if directory else None
                if path is None or not path.exists():
                    path = DEFAULT_DIR / name
                tpl = string.Template(path.read_text(encoding="utf-8"))
                try:
                    tpl.substitute({f: "" for f in FIELDS})
                except (KeyError, ValueError) as exc:
                    raise PromptError(
                        f"{path}: bad placeholder {exc}; use ${{response}}, ${{next_state}}, "
                        "${next_state_role} ($$ for a literal $)"
                    ) from None
                pair.append(tpl)
            templates[kind] = (pair[0], pair[1])
        return cls(templates=templates, max_chars=max_chars)

    def render(self, kind: str, paired: PairedTurn) -> list[dict[str, Any]]:
        if paired.next_state is None:
            raise PromptError("a terminal pairing has no next state to judge")
        system, user = self.templates[kind]
        state, role = next_state_text(paired.next_state, self.max_chars)
        values = {
            "response": as_data(
                clip(message_text(paired.turn.response), self.max_chars) or "(empty response)"
            ),
            "next_state": as_data(state or "(empty)"),
            "next_state_role": role,
        }
        return [
            {"role": "system", "content": system.substitute(values)},
            {"role": "user", "content": user.substitute(values)},
        ]
