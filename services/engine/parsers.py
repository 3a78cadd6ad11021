"""Output parsers: tool calls in the Hermes/Qwen ``<tool_call>{json}</tool_call>`` format (SGLang's ``qwen25``
parser) and ``<think>...</think>`` reasoning (SGLang's ``qwen3`` reasoning parser). Both work on streamed text by
holding back any suffix that could still become a tag."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"
_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict[str, object]:
        out: dict[str, object] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Split ``text`` into (content outside tool blocks, tool calls). A block that is not a JSON object with a
    ``name`` stays in the content: it is the model's text, not a call."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError("name")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ParsedToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments))
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return content, calls


def split_reasoning(text: str, force: bool = False) -> tuple[str | None, str]:
    """(reasoning, content). Reasoning is what precedes ``</think>`` (minus a leading ``<think>``)."""
    body = text
    if body.lstrip().startswith(THINK_START):
        body = body.lstrip()[len(THINK_START) :]
        force = True
    if THINK_END in body:
        reasoning, _, content = body.partition(THINK_END)
        return reasoning.strip(), content.lstrip()
    if force:
        return body.strip(), ""
    return None, text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StreamSplitter:
    """Routes streamed text into reasoning and content deltas, and withholds tool-call blocks (they are parsed
    from the full text at the end and sent as one tool_calls delta)."""

    def __init__(self, reasoning: bool, tools: bool) -> None:
        self.reasoning_enabled = reasoning
        self.tools = tools
        self.buffer = ""
        self.in_reasoning: bool | None = None if reasoning else False
        self.in_tool = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Returns (reasoning delta, content delta)."""
        self.buffer += delta
        reasoning_out, content_out = "", ""
        while True:
            if self.in_reasoning is None:  # not decided yet: does the output open with <think>?
                stripped = self.buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self.buffer = stripped[len(THINK_START) :]
                    self.in_reasoning = True
                    continue
                if THINK_START.startswith(stripped) and not final:
                    break
                self.in_reasoning = False
                continue
            if self.in_reasoning:
                at = self.buffer.find(THINK_END)
                if at != -1:
                    reasoning_out += self.buffer[:at]
                    self.buffer = self.buffer[at + len(THINK_END) :].lstrip()
                    self.in_reasoning = False
                    continue
                hold = 0 if final else _partial_suffix(self.buffer, THINK_END)
                reasoning_out += self.buffer[: len(self.buffer) - hold]
                self.buffer = self.buffer[len(self.buffer) - hold :]
                break
            if self.in_tool:
                break  # everything from <tool_call> on is withheld
            if self.tools:
                at = self.buffer.find(TOOL_START)
                if at != -1:
                    content_out += self.buffer[:at]
                    self.buffer = self.buffer[at:]
                    self.in_tool = True
                    break
                hold = 0 if final else _partial_suffix(self.buffer, TOOL_START)
            else:
                hold = 0
            content_out += self.buffer[: len(self.buffer) - hold]
            self.buffer = self.buffer[len(self.buffer) - hold :]
            break
        return reasoning_out, content_out
