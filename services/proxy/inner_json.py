"""JSON carried inside a string field: tool-call arguments, Claude Code's ``metadata.user_id``, Codex's
``x-codex-turn-metadata``. The body's limits (``json_budget.py``, ``validation.py``) see such a string as one value,
so what it nests is unbounded: read here, a document nested past Python's recursion limit is malformed like any
other (``ValueError``), never a ``RecursionError`` that reaches the error handler as a 500."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str) -> Any:
    """``json.loads``, raising ``ValueError`` for JSON nested too deeply to read."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
