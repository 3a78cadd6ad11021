"""A judge backend that asks the keyword rules first and the LLM judge only when the rules have nothing to say.

The rules are exact when they fire (a user's thanks, a correction, a tool error) and silent otherwise; a small
LLM judge has an opinion on everything, right or not. Together: the rules' verdict where there is one, the
engine's elsewhere, and judge-engine calls only for the turns that need them.

    [judge]
    backend = "examples.plugins.rules_then_engine:RulesThenEngine"
    engine_url = "http://127.0.0.1:30001"

Written against turnstream's public seams only (docs/extending.md).
"""

from __future__ import annotations

from typing import Any

from runtime.configuration.config import Config
from schemas import PairedTurn
from services.judge.backends import from_config
from services.judge.votes import parse_vote


class RulesThenEngine:
    def __init__(self, config: Config) -> None:
        self.rules = from_config(config, "rules")
        self.engine = from_config(config, "engine")
        self.model = f"rules+{config.judge.model or config.judge.engine_url}"

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        text = await self.rules.vote(kind, paired, messages)
        score, _ = parse_vote(kind, text)
        if score in (1, -1) and not (kind == "hint" and score == -1):
            return text  # the rules fired: a clear eval verdict, or a correction that is itself the hint
        return await self.engine.vote(kind, paired, messages)
