"""Incremental detokenization with stop strings, shared by streaming and non-streaming responses.

Text is released only when it can no longer change: a trailing incomplete UTF-8 sequence (decoded as U+FFFD)
and any suffix that could still grow into a stop string are held back until the next token decides them.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class StopDecoder:
    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.released = 0
        self.matched: str | None = None
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_id: int) -> str:
        """Add a generated token; returns newly releasable text. Sets ``matched`` when a stop string appears."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        search_from = max(0, self.released - self._hold)
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1 and (self.matched is None or at < self._match_at):
                self.matched, self._match_at = s, at
        if self.matched is not None:
            self.text = self.text[: self._match_at]
            return self._release(len(self.text))
        safe = len(self.text) - self._hold
        while safe > self.released and self.text[safe - 1] == _REPLACEMENT:
            safe -= 1
        return self._release(safe)

    def finish(self) -> str:
        """Release whatever is left (the generation ended)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out = self.text[self.released : upto]
        self.released = upto
        return out
