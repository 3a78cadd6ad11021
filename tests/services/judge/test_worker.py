"""Judge workers against the real broker: every non-terminal paired turn gets one eval and one hint judgment per
judge id, with verdicts computed from the votes; bad records are dead-lettered; a flaky or absent engine does not
stop the worker, and an outage holds judging instead of emitting empty verdicts."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from runtime.configuration.config import Config, KafkaConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.process.ports import free_port
from schemas import DeadLetter, Judgment
from schemas.topics import DEADLETTER, JUDGMENTS, TURNS_PAIRED
from services.engine.launch import EngineProcess
from services.judge.worker import run_judge
from tests.services.judge.conftest import (
    StubJudge,
    expected_keys,
    judge_config,
    make_pairs,
    publish,
    wait_for_judgments,
)

pytestmark = pytest.mark.integration


async def run_until(
    config: Config, done: Callable[[list[Judgment]], bool], timeout: float = 60
) -> list[Judgment]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_judge(config, install_signals=False, stop=stop))
    try:
        return await wait_for_judgments(config.kafka, lambda js: done(js) or task.done(), timeout)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def keys(js: list[Judgment]) -> set[str]:
    return {j.key for j in js}


async def test_rules_judges_every_turn_once_per_kind_and_skips_terminal(kafka: KafkaConfig) -> None:
    pairs = make_pairs(12)
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["rules-a"])
    found = await run_until(
        judge_config(kafka, judge_id="rules-a", backend="rules", m=3), lambda js: keys(js) >= want
    )
    assert keys(found) == want and len(found) == len(want) == 24
    by_key = {j.key: j for j in found}
    for p in pairs[:12]:
        said = p.next_state[0].content  # type: ignore[index]
        ev, hint = by_key[f"{p.turn_id}/rules-a/eval"], by_key[f"{p.turn_id}/rules-a/hint"]
        assert len(ev.votes) == 3 and len(hint.votes) == 3 and ev.judge_model == "rules"
        assert ev.paired == p and ev.session_id == p.turn.session_id
        if "wrong" in said:
            assert ev.eval_score == -1 and hint.accepted and hint.hint == said
        elif "Thanks" in said:
            assert ev.eval_score == 1 and not hint.accepted and hint.hint is None
        else:
            assert ev.eval_score == 0 and not hint.accepted


async def test_two_judge_ids_judge_the_same_turns_independently(kafka: KafkaConfig) -> None:
    pairs = make_pairs(9)
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["a", "b"])
    stops = [asyncio.Event(), asyncio.Event()]
    tasks = [
        asyncio.create_task(
            run_judge(judge_config(kafka, judge_id=jid, backend="rules"), install_signals=False, stop=stop)
        )
        for jid, stop in zip(["a", "b"], stops, strict=True)
    ]
    try:
        found = await wait_for_judgments(kafka, lambda js: keys(js) >= want)
    finally:
        for s in stops:
            s.set()
        await asyncio.gather(*(asyncio.wait_for(t, 30) for t in tasks))
    assert keys(found) == want
    assert Counter(j.judge_id for j in found) == {"a": 18, "b": 18}


async def test_undecodable_records_are_dead_lettered_and_judging_goes_on(kafka: KafkaConfig) -> None:
    pairs = make_pairs(3)
    async with EventProducer(kafka) as producer:
        await producer.send_raw(TURNS_PAIRED.name(kafka.namespace), b"\x93not msgpack", b"s0")
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["default"])
    found = await run_until(judge_config(kafka, backend="rules"), lambda js: keys(js) >= want)
    assert keys(found) == want
    dead = [r.event async for r in read_topic(kafka, DEADLETTER)]
    assert len(dead) == 1 and isinstance(dead[0], DeadLetter)
    assert dead[0].source_topic == TURNS_PAIRED.name(kafka.namespace) and dead[0].error_kind == "decode"


async def test_flaky_engine_votes_are_retried_and_all_turns_judged(
    kafka: KafkaConfig, stub_judge: Callable[..., StubJudge]
) -> None:
    stub = stub_judge(latency_ms=5, fail_every=3)
    pairs = make_pairs(6)
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["llm"])
    config = judge_config(
        kafka, judge_id="llm", backend="engine", engine_url=stub.url, m=3, max_concurrency=4
    )
    found = await run_until(config, lambda js: keys(js) >= want)
    assert keys(found) == want
    for j in found:
        assert all(v.score is not None and v.error is None for v in j.votes), j.votes
        wrong = "wrong" in str(j.paired.next_state[0].content)  # type: ignore[index]
        if j.kind == "eval":
            assert j.eval_score == (-1 if wrong else 1) and j.judge_model == "stub-judge"
        else:
            assert j.accepted == wrong
            if wrong:
                assert j.hint is not None and j.hint.startswith("Check the request again: No, that's wrong")


async def test_rejected_votes_are_recorded_as_failed(
    kafka: KafkaConfig, stub_judge: Callable[..., StubJudge]
) -> None:
    stub = stub_judge(latency_ms=1, fail_every=2, fail_status=400)  # every other vote rejected
    pairs = make_pairs(3)
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["default"])
    config = judge_config(kafka, backend="engine", engine_url=stub.url, m=2, max_concurrency=1)
    found = await run_until(config, lambda js: keys(js) >= want)
    assert keys(found) == want
    votes = [v for j in found for v in j.votes]
    failed = [v for v in votes if v.error is not None]
    assert len(failed) == len(votes) // 2 and all("400" in (v.error or "") for v in failed)
    assert all(v.score is None and v.raw == "" for v in failed)
    for j in found:  # one valid vote out of two still decides
        if j.kind == "eval":
            valid = [v.score for v in j.votes if v.score is not None]
            assert j.eval_score == (valid[0] if valid else 0)


async def test_engine_outage_holds_judging_until_the_engine_is_back(
    kafka: KafkaConfig, stub_judge: Callable[..., StubJudge]
) -> None:
    port = free_port()
    pairs = make_pairs(3)
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["default"])
    config = judge_config(
        kafka, backend="engine", engine_url=f"http://127.0.0.1:{port}", deadline_s=1.0, max_concurrency=2
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_judge(config, install_signals=False, stop=stop))
    try:
        # Longer than the bus's three tries and their back-off (then a record's own fault: dead-lettered).
        await asyncio.sleep(10)
        assert not task.done()
        assert [r async for r in read_topic(kafka, JUDGMENTS)] == []
        stub_judge(port=port, latency_ms=1)
        found = await wait_for_judgments(kafka, lambda js: keys(js) >= want)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert keys(found) == want
    assert [r async for r in read_topic(kafka, DEADLETTER)] == []
    # Votes that failed as the engine came back may be recorded, but no judgment rests on outage alone.
    assert all(any(v.error is None for v in j.votes) for j in found)


async def test_the_engine_backend_judges_through_the_real_sglang_server(
    kafka: KafkaConfig, engine: EngineProcess
) -> None:
    """The judge's requests as SGLang 0.5.23 takes them: every vote is a 200 answer whose text was parsed (a
    135M model rarely writes a valid \\boxed{} verdict: such a vote is recorded as unparseable, not as an engine
    error), and every non-terminal turn gets its eval and hint judgment."""
    pairs = make_pairs(2)
    await publish(kafka, pairs)
    want = expected_keys(pairs, ["sglang"])
    config = judge_config(
        kafka,
        judge_id="sglang",
        backend="engine",
        engine_url=engine.url,
        m=1,
        max_tokens=48,
        max_concurrency=4,
    )
    found = await run_until(config, lambda js: keys(js) >= want, timeout=240)
    assert keys(found) == want
    for j in found:
        for v in j.votes:
            assert v.error is None and v.raw, f"SGLang refused or failed a vote: {v.error}"


def test_a_judge_votes_only_the_kinds_its_mode_needs() -> None:
    from services.judge.worker import judgment_kinds

    def kinds(mode: str, eval_mode: bool = True) -> tuple[str, ...]:
        config = Config()
        config.dispatcher.mode, config.judge.eval_mode = mode, eval_mode
        return judgment_kinds(config)

    assert [kinds("rl"), kinds("opd"), kinds("combine")] == [("eval",), ("hint",), ("eval", "hint")]
    assert kinds("combine", eval_mode=False) == ("hint",)


async def test_in_rl_mode_no_hint_is_voted(kafka: KafkaConfig) -> None:
    pairs = make_pairs(6)
    await publish(kafka, pairs)
    config = judge_config(kafka, judge_id="rl", backend="rules", m=2)
    config.dispatcher.mode = "rl"
    want = {k for k in expected_keys(pairs, ["rl"]) if k.endswith("/eval")}
    await run_until(config, lambda js: keys(js) >= want)
    await asyncio.sleep(1.0)  # a hint judgment would have been produced with its turn's eval
    assert keys(await wait_for_judgments(kafka, lambda js: True)) == want
