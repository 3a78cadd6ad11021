"""Evaluation sets a team writes for its own agent (shared runtime: the eval service scores them, the gate and the
command line name them): a JSONL file of prompts, each with the checks its answer must
pass, scored for any weight version (``turnstream eval --set FILE``) and named by gates (docs/evaluation.md).

One case per line::

    {"id": "sum", "prompt": "What is 2+2?", "checks": [{"contains": "4", "name": "correct"}]}
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
     "checks": [{"regex": "^\\\\W*\\\\w+\\\\W*$", "name": "one-word"}]}

A check is exactly one of ``exact`` (the whole answer, whitespace at the ends ignored), ``contains``, ``regex``
(``re.search``), ``callable`` (``package.module:function`` called as ``f(answer, case) -> bool``) or ``rubric``
(a statement the judge engine grades the answer against, greedily, YES or NO); ``ignore_case`` applies to the
first three. Its ``name`` (default: its kind) is the score it counts toward: a version's score for a name is the
share of the cases carrying a check of that name that pass it. Pure apart from the rubric's engine call, which the
caller passes in.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from runtime.configuration.plugins import PluginError, check_call, load_object
from schemas import EvalAnswer, EvalResult

KINDS = ("exact", "contains", "regex", "callable", "rubric")

RUBRIC_PROMPT = """You grade an AI assistant's answer against a rubric.

Rubric: {rubric}

The user asked:
{question}

The assistant answered:
{answer}

Does the answer meet the rubric? Reply with one word: YES or NO."""
"""What the judge engine is asked for a ``rubric`` check (greedy, a few tokens; the first YES or NO counts)."""

_VERDICT = re.compile(r"\b(YES|NO)\b", re.IGNORECASE)


class EvalSetError(ValueError):
    """A set file that cannot be used, naming the file and line."""


class EvalCheck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    exact: str | None = None
    contains: str | None = None
    regex: str | None = None
    callable: str | None = None
    rubric: str | None = None
    name: str | None = None
    ignore_case: bool = False

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def label(self) -> str:
        """The score this check counts toward."""
        return self.name or self.kind


class EvalCase(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    checks: list[EvalCheck]
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    id: str | None = None
    max_tokens: int | None = None

    def conversation(self) -> list[dict[str, Any]]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]

    @property
    def question(self) -> str:
        """The case's last user message: what a rubric grades the answer against."""
        for m in reversed(self.conversation()):
            if m.get("role") == "user" and isinstance(m.get("content"), str):
                return str(m["content"])
        return ""


class EvalSet(msgspec.Struct, frozen=True):
    name: str
    path: str
    cases: list[EvalCase]
    set_id: str
    """Names the set in ``EvalResult.question_set``: ``set-<name>-<cases>-<digest of the file>``, so results of an
    edited file never mix with the old one's."""

    @property
    def labels(self) -> list[str]:
        return sorted({c.label for case in self.cases for c in case.checks})


Rubric = Callable[[str, str, str], Awaitable[bool]]
"""``rubric(statement, question, answer)``: whether the judge engine says the answer meets the statement."""


def question_set_id(questions: Sequence[str]) -> str:
    """The held-out set's name: it changes when any question does, so results of different sets never mix."""
    digest = hashlib.sha256("\n".join(questions).encode()).hexdigest()[:12]
    return f"heldout-{len(questions)}-{digest}"


def _validate(case: EvalCase, where: str) -> None:
    if (case.prompt is None) == (case.messages is None):
        raise EvalSetError(f"{where}: give exactly one of 'prompt' and 'messages'")
    if case.messages is not None and (
        not case.messages or not all(isinstance(m, dict) and "role" in m for m in case.messages)
    ):
        raise EvalSetError(f"{where}: 'messages' must be a non-empty list of chat messages with a 'role'")
    if not case.checks:
        raise EvalSetError(f"{where}: 'checks' must hold at least one check")
    if case.max_tokens is not None and case.max_tokens < 1:
        raise EvalSetError(f"{where}: 'max_tokens' must be >= 1")
    for i, check in enumerate(case.checks):
        kinds = [k for k in KINDS if getattr(check, k) is not None]
        if len(kinds) != 1:
            raise EvalSetError(
                f"{where}: check {i} must have exactly one of {', '.join(KINDS)} (has {kinds})"
            )
        if check.regex is not None:
            try:
                re.compile(check.regex)
            except re.error as exc:
                raise EvalSetError(f"{where}: check {i}: regex {check.regex!r}: {exc}") from None
        if check.callable is not None:
            try:
                target = load_object(f"{where}: check {i}", check.callable)
                check_call(f"{where}: check {i}", check.callable, target, ("answer", "case"))
            except PluginError as exc:
                raise EvalSetError(str(exc)) from None


def load_set(path: str | Path) -> EvalSet:
    """Read and check a set file; every problem is an ``EvalSetError`` naming its line."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise EvalSetError(f"{p}: {exc.strerror or exc}") from None
    decoder = msgspec.json.Decoder(EvalCase)
    cases: list[EvalCase] = []
    for n, line in enumerate(raw.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith(b"//"):
            continue
        where = f"{p}:{n}"
        try:
            case = decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise EvalSetError(f"{where}: {exc}") from None
        _validate(case, where)
        cases.append(case)
    if not cases:
        raise EvalSetError(f"{p}: no cases")
    ids = [c.id for c in cases if c.id is not None]
    if len(ids) != len(set(ids)):
        raise EvalSetError(f"{p}: case ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", p.stem) or "set"
    digest = hashlib.sha256(raw).hexdigest()[:12]
    return EvalSet(name=name, path=str(p), cases=cases, set_id=f"set-{name}-{len(cases)}-{digest}")


def _fold(text: str, check: EvalCheck) -> str:
    return text.casefold() if check.ignore_case else text


async def passes(check: EvalCheck, answer: str, case: EvalCase, rubric: Rubric | None) -> bool:
    """Whether ``answer`` passes ``check``."""
    if check.exact is not None:
        return _fold(answer.strip(), check) == _fold(check.exact.strip(), check)
    if check.contains is not None:
        return _fold(check.contains, check) in _fold(answer, check)
    if check.regex is not None:
        return re.search(check.regex, answer, re.IGNORECASE if check.ignore_case else 0) is not None
    if check.callable is not None:
        return bool(load_object("check", check.callable)(answer, case))
    assert check.rubric is not None
    if rubric is None:
        raise EvalSetError("a rubric check needs the judge engine (judge.engine_url)")
    return await rubric(check.rubric, case.question, answer)


def verdict(text: str) -> bool | None:
    """The judge's YES/NO (the first one it says); None when it says neither."""
    found = _VERDICT.search(text)
    return None if found is None else found.group(1).upper() == "YES"


async def scored(case: EvalCase, answer: str, tokens: int, rubric: Rubric | None) -> EvalAnswer:
    """One case's answer with each of its checks' outcomes (a check name repeated in a case must all pass)."""
    satisfied: dict[str, bool] = {}
    for check in case.checks:
        ok = await passes(check, answer, case, rubric)
        satisfied[check.label] = satisfied.get(check.label, True) and ok
    return EvalAnswer(
        question=case.id or case.question, answer=answer, satisfied=satisfied, completion_tokens=tokens
    )


def set_result(
    version: int, evalset: EvalSet, answers: Sequence[EvalAnswer], model: str, started: float
) -> EvalResult:
    """The event for one version on one set: each check name's score is the share of the cases it judged that
    passed."""
    scores = {}
    for label in evalset.labels:
        judged = [a.satisfied[label] for a in answers if label in a.satisfied]
        scores[label] = sum(judged) / len(judged)
    return EvalResult(
        version=version,
        question_set=evalset.set_id,
        answers=list(answers),
        scores=scores,
        model=model,
        evaluated_at=time.time(),
        duration_s=max(0.0, time.monotonic() - started),
        mean_words=sum(len(a.answer.split()) for a in answers) / len(answers),
    )
