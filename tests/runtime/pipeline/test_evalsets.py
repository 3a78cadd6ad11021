"""Evaluation sets (``runtime/pipeline/evalsets.py``): a file is checked line by line with errors that name the line,
each check kind judges as documented, and a version's result scores each check name over the cases that carry it, as
``EvalResult`` itself verifies."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime.pipeline.evalsets import (
    EvalCase,
    EvalCheck,
    EvalSetError,
    load_set,
    passes,
    scored,
    set_result,
    verdict,
)
from schemas import EvalResult
from schemas.codec import DecodeError, decode, encode

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "evalsets" / "personas.jsonl"


def write(tmp_path: Path, *lines: Any) -> Path:
    path = tmp_path / "team.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_the_shipped_example_loads_with_its_check_names() -> None:
    evalset = load_set(EXAMPLE)
    assert evalset.labels == ["correct", "helpful", "plain-short", "sign-off"]
    assert evalset.set_id.startswith("set-personas-8-")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "hi", "checks": []}, "at least one check"),
        ({"checks": [{"contains": "x"}]}, "exactly one of 'prompt' and 'messages'"),
        ({"prompt": "hi", "messages": [{"role": "user"}], "checks": [{"contains": "x"}]}, "exactly one of"),
        ({"prompt": "hi", "checks": [{"contains": "x", "regex": "y"}]}, "exactly one of exact, contains"),
        ({"prompt": "hi", "checks": [{"name": "x"}]}, "exactly one of exact, contains"),
        ({"prompt": "hi", "checks": [{"regex": "("}]}, "regex '('"),
        ({"prompt": "hi", "checks": [{"callable": "no.such.module:f"}]}, "does not load"),
        ({"prompt": "hi", "checks": [{"callable": "json:dumps"}]}, "the seam calls it with (answer, case)"),
        ({"prompt": "hi", "checks": [{"callable": "os.path:sep"}]}, "not a function"),
        ({"prompt": "hi", "checks": [{"contains": "x", "colour": "red"}]}, "colour"),
        ({"prompt": "hi", "checks": [{"contains": "x"}], "max_tokens": 0}, "max_tokens"),
        ("{not json", "team.jsonl:2"),
    ],
)
def test_a_bad_line_is_refused_naming_its_line(tmp_path: Path, line: Any, message: str) -> None:
    good = {"prompt": "fine", "checks": [{"contains": "x"}]}
    path = write(tmp_path, good, line)
    with pytest.raises(EvalSetError) as info:
        load_set(path)
    assert message in str(info.value)
    assert "team.jsonl:2" in str(info.value)


def test_empty_files_and_repeated_ids_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EvalSetError, match="no cases"):
        load_set(write(tmp_path, "// only a comment", ""))
    case = {"id": "a", "prompt": "hi", "checks": [{"contains": "x"}]}
    with pytest.raises(EvalSetError, match="repeat"):
        load_set(write(tmp_path, case, case))
    with pytest.raises(EvalSetError, match="No such file"):
        load_set(tmp_path / "missing.jsonl")


def test_an_edited_file_is_another_set(tmp_path: Path) -> None:
    case = {"prompt": "hi", "checks": [{"contains": "x"}]}
    before = load_set(write(tmp_path, case)).set_id
    after = load_set(write(tmp_path, {**case, "checks": [{"contains": "y"}]})).set_id
    assert before != after and before.startswith("set-team-1-")


CASE = EvalCase(prompt="What is 2+2?", checks=[EvalCheck(contains="4")])


@pytest.mark.parametrize(
    ("check", "answer", "expected"),
    [
        (EvalCheck(exact="Four"), "  Four \n", True),
        (EvalCheck(exact="Four"), "four", False),
        (EvalCheck(exact="Four", ignore_case=True), "four", True),
        (EvalCheck(exact="Four"), "Four.", False),
        (EvalCheck(contains="4"), "It is 4.", True),
        (EvalCheck(contains="four"), "It is Four.", False),
        (EvalCheck(contains="four", ignore_case=True), "It is Four.", True),
        (EvalCheck(regex=r"\b4\b"), "It is 4.", True),
        (EvalCheck(regex=r"\b4\b"), "It is 44.", False),
        (EvalCheck(regex=r"^four$", ignore_case=True), "FOUR", True),
        (EvalCheck(callable="examples.evalsets.checks:signs_off"), "4. Cheers!", True),
        (EvalCheck(callable="examples.evalsets.checks:signs_off"), "4.", False),
        (EvalCheck(callable="examples.evalsets.checks:plain_short"), "**4**", False),
    ],
)
async def test_each_kind_judges_as_documented(check: EvalCheck, answer: str, expected: bool) -> None:
    assert await passes(check, answer, CASE, None) is expected


async def test_a_rubric_asks_the_judge_with_the_cases_question() -> None:
    asked: list[tuple[str, str, str]] = []

    async def judge(statement: str, question: str, answer: str) -> bool:
        asked.append((statement, question, answer))
        return "polite" in answer

    case = EvalCase(
        messages=[
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Thank my colleague."},
        ],
        checks=[EvalCheck(rubric="The note is polite.")],
    )
    assert await passes(case.checks[0], "A polite note.", case, judge) is True
    assert await passes(case.checks[0], "Go away.", case, judge) is False
    assert asked[0] == ("The note is polite.", "Thank my colleague.", "A polite note.")
    with pytest.raises(EvalSetError, match="judge engine"):
        await passes(case.checks[0], "x", case, None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("YES", True),
        ("no.", False),
        ("Yes, it does.", True),
        ("Answer: NO", False),
        ("Maybe", None),
        ("", None),
    ],
)
def test_the_judges_verdict_is_its_first_yes_or_no(text: str, expected: bool | None) -> None:
    assert verdict(text) is expected


async def test_a_result_scores_each_name_over_the_cases_that_carry_it(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"id": "a", "prompt": "2+2?", "checks": [{"contains": "4", "name": "correct"}, {"regex": "!$"}]},
        {"id": "b", "prompt": "3+3?", "checks": [{"contains": "6", "name": "correct"}]},
        {"id": "c", "prompt": "1+1?", "checks": [{"contains": "2", "name": "correct"}, {"contains": "two"}]},
    )
    evalset = load_set(path)
    answers = [
        await scored(case, text, 3, None)
        for case, text in zip(evalset.cases, ("4!", "5", "2 (two)"), strict=True)
    ]
    result = set_result(7, evalset, answers, "smollm2", time.monotonic())
    assert result.scores == {"correct": 2 / 3, "regex": 1.0, "contains": 1.0}
    assert [a.question for a in result.answers] == ["a", "b", "c"]
    assert result.overall == 4 / 5
    # EvalResult checks every score against its answers, also when they arrive over the wire.
    assert decode(encode(result), EvalResult) == result
    tampered = msgspec.to_builtins(result)
    tampered["scores"]["correct"] = 1.0
    with pytest.raises(DecodeError, match="correct"):
        decode(msgspec.msgpack.encode(tampered), EvalResult)
    tampered["scores"] = {**result.scores, "unjudged": 1.0}
    with pytest.raises(DecodeError, match="no answer is judged"):
        decode(msgspec.msgpack.encode(tampered), EvalResult)


async def test_a_name_repeated_in_a_case_passes_only_when_all_its_checks_do() -> None:
    case = EvalCase(
        prompt="2+2?", checks=[EvalCheck(contains="4", name="ok"), EvalCheck(regex="!$", name="ok")]
    )
    assert (await scored(case, "4!", 1, None)).satisfied == {"ok": True}
    assert (await scored(case, "4.", 1, None)).satisfied == {"ok": False}
