"""judge.backend, judge.vote_parser and teacher.hint_template: a plugin that fits is used (through Kafka for the
judge); one that does not is refused at start-up naming the field, the path and the mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.configuration.config import Config, KafkaConfig
from runtime.configuration.plugins import PluginError, load_function
from schemas import Message
from services.judge.backends import from_config
from services.judge.worker import Judge, run_judge
from services.teacher.enhance import HINT_TEMPLATE, enhanced_messages, load_template
from tests.services.judge.conftest import expected_keys, judge_config, make_pairs, publish
from tests.services.judge.test_worker import run_until

FIX = "tests.plugin_contracts.fixtures"


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        ("NoVoteJudge", r"has no 'async def vote\(self, kind, paired, messages\)'"),
        ("SyncVoteJudge", r"has no 'async def vote\(self, kind, paired, messages\)'"),
        ("NoModelJudge", r"has no 'model' string"),
        ("NoConfigJudge", r"has the signature \(\).* but the seam calls it with \(config\)"),
        ("constant_advantages", r"is a function, not a class"),
    ],
)
def test_a_judge_backend_that_does_not_fit_is_refused(cls: str, message: str) -> None:
    config = Config()
    config.judge.backend = f"{FIX}:{cls}"
    with pytest.raises(PluginError, match=rf"^judge\.backend: '{FIX}:{cls}.*{message}"):
        from_config(config)


def test_a_judge_backend_name_that_is_no_path_is_refused() -> None:
    config = Config()
    config.judge.backend = "llm"
    with pytest.raises(
        PluginError, match=r"judge\.backend: 'llm' is not engine, rules or a 'package\.module:Class'"
    ):
        from_config(config)


def test_a_vote_parser_reads_the_votes_and_a_reading_that_is_no_vote_is_recorded_as_invalid() -> None:
    from tests.plugin_contracts.fixtures import parse_out_of_range, parse_plain_digits

    judge = Judge("j", from_config(Config()), None, None, parse=parse_plain_digits)  # type: ignore[arg-type]
    assert judge._to_vote("eval", "-1").score == -1
    hint = judge._to_vote("hint", "1 Use Celsius, as I asked.")
    assert (hint.score, hint.hint) == (1, "Use Celsius, as I asked.")
    assert judge._to_vote("eval", "\\boxed{1}").score is None, "the default format is not this parser's"
    bad = Judge("j", from_config(Config()), None, None, parse=parse_out_of_range)  # type: ignore[arg-type]
    vote = bad._to_vote("eval", "whatever")
    assert (
        vote.score is None and vote.error is not None and "judge.vote_parser returned (7, '')" in vote.error
    )


@pytest.mark.integration
async def test_the_judge_service_votes_with_the_plugin_backend_through_kafka(kafka: KafkaConfig) -> None:
    pairs = make_pairs(6)
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["echo"])
    config = judge_config(kafka, judge_id="echo", backend=f"{FIX}:EchoJudge", m=2)
    found = await run_until(config, lambda js: {j.key for j in js} >= want)
    assert {j.key for j in found} == want
    assert all(j.judge_model == "echo-echo" for j in found)
    assert all(j.eval_score == 1 for j in found if j.kind == "eval"), (
        "the rules would have said -1 or 0 to some"
    )
    assert all(j.accepted and j.hint == "Answer in Celsius, please." for j in found if j.kind == "hint")


async def test_the_judge_service_refuses_a_vote_parser_that_does_not_fit_at_start(kafka: KafkaConfig) -> None:
    config = judge_config(kafka, backend="rules", vote_parser=f"{FIX}:samples_only")
    with pytest.raises(PluginError, match=r"judge\.vote_parser: .*calls it with \(kind, text\)"):
        await run_judge(config, install_signals=False)


def test_the_hint_template_is_a_file_with_one_placeholder(tmp_path: Path) -> None:
    assert load_template(None) == HINT_TEMPLATE == "\n\n[user's hint / instruction]\n{hint}"
    mine = tmp_path / "hint.txt"
    mine.write_text(" (Hindsight: {hint})")
    out = enhanced_messages([Message(role="user", content="Weather?")], "use Celsius", load_template(mine))
    assert out[0].content == "Weather? (Hindsight: use Celsius)"
    mine.write_text("no placeholder")
    with pytest.raises(
        ValueError, match=r"teacher\.hint_template: .*hint\.txt must contain \{hint\} exactly once"
    ):
        load_template(mine)


def test_the_inverted_votes_example_turns_eval_scores_around_and_leaves_hints() -> None:
    """The bad signal of docs/evaluation.md's experiment, loaded as a plugin is."""
    judge = Judge(
        "j",
        from_config(Config()),
        None,
        None,
        parse=load_function(
            "judge.vote_parser", "examples.plugins.inverted_votes:parse_vote", ("kind", "text")
        ),
    )
    assert [judge._to_vote("eval", f"\\boxed{{{s}}}").score for s in ("1", "-1", "0")] == [-1, 1, 0]
    assert judge._to_vote("eval", "no verdict").score is None
    hint = judge._to_vote("hint", "\\boxed{1} [HINT_START]Answer in one short sentence.[HINT_END]")
    assert (hint.score, hint.hint) == (1, "Answer in one short sentence.")
