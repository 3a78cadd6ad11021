"""Hypothesis strategies that build valid events of every type, and simple example builders."""

from __future__ import annotations

import time

from hypothesis import strategies as st

from schemas import (
    DeadLetter,
    EvalAnswer,
    EvalResult,
    FunctionCall,
    Judgment,
    Message,
    PairedTurn,
    Sample,
    SamplingParams,
    SessionEnded,
    TeacherScores,
    ToolCall,
    Turn,
    VersionCheck,
    VersionDecision,
    Vote,
    WeightsPublished,
)

ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=16)
texts = st.text(max_size=40)
token_ids = st.integers(min_value=0, max_value=200_000)
logprobs = st.floats(min_value=-50.0, max_value=0.0, allow_nan=False, allow_infinity=False)
timestamps = st.floats(min_value=1.6e9, max_value=2.0e9, allow_nan=False)

tool_calls = st.builds(
    ToolCall, id=ids, function=st.builds(FunctionCall, name=ids, arguments=st.just('{"q": 1}') | texts)
)
json_leaf = st.none() | st.booleans() | st.integers(-1000, 1000) | texts
content_parts = st.lists(st.dictionaries(ids, json_leaf, max_size=3), max_size=2)


def messages(roles: list[str] | None = None) -> st.SearchStrategy[Message]:
    return st.builds(
        Message,
        role=st.sampled_from(roles or ["system", "user", "assistant", "tool", "developer"]),
        content=st.none() | texts | content_parts,
        name=st.none() | ids,
        tool_calls=st.none() | st.lists(tool_calls, max_size=2),
        tool_call_id=st.none() | ids,
        reasoning_content=st.none() | texts,
    )


sampling = st.builds(
    SamplingParams,
    temperature=st.none() | st.floats(0, 2),
    top_p=st.none() | st.floats(0, 1),
    max_tokens=st.none() | st.integers(1, 4096),
    stop=st.none() | st.lists(texts, max_size=2),
    seed=st.none() | st.integers(0, 2**31),
)


@st.composite
def turns(draw: st.DrawFn, session_id: str | None = None) -> Turn:
    sid = session_id or draw(ids)
    n = draw(st.integers(1, 500))
    resp_ids = draw(st.lists(token_ids, max_size=30))
    created = draw(timestamps)
    return Turn(
        turn_id=f"{sid}:{n}",
        session_id=sid,
        turn_index=n,
        messages=draw(st.lists(messages(), min_size=1, max_size=4)),
        response=draw(messages(["assistant"])),
        prompt_token_ids=draw(st.lists(token_ids, min_size=1, max_size=30)),
        response_token_ids=resp_ids,
        response_logprobs=draw(st.lists(logprobs, min_size=len(resp_ids), max_size=len(resp_ids))),
        finish_reason=draw(st.sampled_from(["stop", "length", "tool_calls"])),
        weight_version=draw(st.integers(0, 1000)),
        model=draw(ids),
        created_at=created,
        completed_at=created + draw(st.floats(0, 100)),
        tools=draw(st.lists(st.dictionaries(ids, json_leaf, max_size=3), max_size=2)),
        sampling=draw(sampling),
        session_done=draw(st.booleans()),
        token_source=draw(st.sampled_from(["engine", "retokenized"])),
    )


@st.composite
def paired_turns(draw: st.DrawFn) -> PairedTurn:
    turn = draw(turns())
    if draw(st.booleans()):
        return PairedTurn(
            turn=turn,
            next_state=draw(st.lists(messages(["user", "tool"]), min_size=1, max_size=3)),
            paired_at=draw(timestamps),
            misaligned=draw(st.booleans()),
        )
    return PairedTurn(
        turn=turn,
        next_state=None,
        paired_at=draw(timestamps),
        terminal_reason=draw(st.sampled_from(["session_done", "idle_timeout"])),
    )


@st.composite
def judgments(draw: st.DrawFn) -> Judgment:
    paired = draw(paired_turns())
    kind = draw(st.sampled_from(["eval", "hint"]))
    if kind == "eval":
        votes = draw(
            st.lists(
                st.builds(Vote, raw=texts, score=st.none() | st.sampled_from([-1, 0, 1])),
                min_size=1,
                max_size=3,
            )
        )
        extra = {"eval_score": draw(st.sampled_from([-1, 0, 1]))}
    else:
        votes = draw(
            st.lists(
                st.builds(Vote, raw=texts, score=st.none() | st.sampled_from([-1, 1]), hint=texts),
                min_size=1,
                max_size=3,
            )
        )
        hint = draw(st.none() | texts.filter(lambda s: bool(s.strip())))
        extra = {"accepted": hint is not None, "hint": hint}
    return Judgment(
        turn_id=paired.turn_id,
        session_id=paired.turn.session_id,
        judge_id=draw(ids),
        kind=kind,
        votes=votes,
        paired=paired,
        judge_model=draw(ids),
        created_at=draw(timestamps),
        **extra,
    )


@st.composite
def teacher_scores(draw: st.DrawFn) -> TeacherScores:
    n = draw(st.integers(0, 20))
    k = draw(st.integers(1, 4))
    topk = draw(st.booleans())
    return TeacherScores(
        turn_id=draw(ids) + ":1",
        session_id=draw(ids),
        judge_id=draw(ids),
        hint=draw(texts.filter(lambda s: bool(s.strip()))),
        teacher_model=draw(ids),
        response_token_ids=draw(st.lists(token_ids, min_size=n, max_size=n)),
        teacher_logprobs=draw(st.lists(logprobs, min_size=n, max_size=n)),
        created_at=draw(timestamps),
        topk_token_ids=draw(st.lists(st.lists(token_ids, min_size=k, max_size=k), min_size=n, max_size=n))
        if topk
        else None,
        topk_logprobs=draw(st.lists(st.lists(logprobs, min_size=k, max_size=k), min_size=n, max_size=n))
        if topk
        else None,
    )


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    mode = draw(st.sampled_from(["rl", "opd", "combine"]))
    kind = {
        "rl": st.just("rl"),
        "opd": st.just("opd"),
        "combine": st.sampled_from(["opd+rl", "opd-only", "rl-only"]),
    }
    kind_v = draw(kind[mode])
    n_resp = draw(st.integers(1, 20))
    n_prompt = draw(st.integers(1, 20))
    rollout = draw(st.lists(logprobs, min_size=n_resp, max_size=n_resp))
    teacher = None if kind_v == "rl" else draw(st.lists(logprobs, min_size=n_resp, max_size=n_resp))
    reward = 0.0 if kind_v in ("opd", "opd-only") else float(draw(st.sampled_from([-1, 0, 1])))
    return Sample(
        sample_id=draw(ids) + ":1",
        session_id=draw(ids),
        mode=mode,
        kind=kind_v,
        tokens=draw(st.lists(token_ids, min_size=n_prompt + n_resp, max_size=n_prompt + n_resp)),
        response_length=n_resp,
        loss_mask=[1] * n_resp,
        rollout_logprobs=rollout,
        reward=reward,
        weight_version=draw(st.integers(0, 1000)),
        created_at=draw(timestamps),
        teacher_logprobs=teacher,
    )


weights_published = st.builds(
    WeightsPublished,
    version=st.integers(1, 10_000),
    path=ids.map(lambda s: f"/ckpt/{s}"),
    base_model=ids,
    step=st.integers(0, 10_000),
    created_at=timestamps,
    samples_trained=st.integers(0, 10**6),
    sha256=st.none() | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)

dead_letters = st.builds(
    DeadLetter,
    source_topic=ids,
    source_partition=st.integers(0, 100),
    source_offset=st.integers(0, 10**9),
    error_kind=st.sampled_from(["decode", "validation", "processing"]),
    error=texts.filter(lambda s: bool(s.strip())),
    consumer_group=ids,
    payload=st.binary(max_size=64),
    created_at=timestamps,
    source_key=st.none() | st.binary(max_size=16),
    source_timestamp_ms=st.none() | st.integers(0, 2**41),
)

persona_names = st.lists(
    st.sampled_from(["plain-short", "sign-off", "other"]), min_size=1, max_size=3, unique=True
)


@st.composite
def eval_results(draw: st.DrawFn) -> EvalResult:
    names = draw(persona_names)
    answers = draw(
        st.lists(
            st.builds(
                EvalAnswer,
                question=texts,
                answer=texts,
                satisfied=st.fixed_dictionaries({n: st.booleans() for n in names}),
                completion_tokens=st.integers(0, 4096),
            ),
            min_size=1,
            max_size=5,
        )
    )
    scores = {n: sum(a.satisfied[n] for a in answers) / len(answers) for n in names}
    return EvalResult(
        version=draw(st.integers(0, 10**6)),
        question_set=draw(ids),
        answers=answers,
        scores=scores,
        model=draw(ids),
        evaluated_at=draw(timestamps),
        duration_s=draw(st.floats(0, 1e5)),
        mean_words=draw(st.floats(0, 1e4)),
    )


sessions_ended = st.builds(
    SessionEnded,
    session_id=ids,
    after_turn_index=st.none() | st.integers(0, 10**6),
    ended_at=timestamps,
)

version_decisions = st.builds(
    VersionDecision,
    version=st.integers(0, 10**6),
    state=st.sampled_from(
        ["candidate", "promoted", "rejected", "rolled_back", "pinned", "unpinned", "restored"]
    ),
    reason=ids,
    by=st.sampled_from(["gate", "manual", "trainer"]),
    decided_at=timestamps,
    checks=st.lists(
        st.builds(
            VersionCheck,
            name=ids,
            value=st.floats(allow_nan=False),
            bound=st.floats(allow_nan=False),
            passed=st.booleans(),
            at_most=st.booleans(),
        ),
        max_size=3,
    ),
    against=st.none() | st.integers(0, 10**6),
)

ALL_EVENTS = {
    Turn: turns(),
    SessionEnded: sessions_ended,
    PairedTurn: paired_turns(),
    Judgment: judgments(),
    TeacherScores: teacher_scores(),
    Sample: samples(),
    WeightsPublished: weights_published,
    EvalResult: eval_results(),
    VersionDecision: version_decisions,
    DeadLetter: dead_letters,
}


def example_turn(session_id: str = "s1", n: int = 1, **changes: object) -> Turn:
    now = time.time()
    base = {
        "turn_id": f"{session_id}:{n}",
        "session_id": session_id,
        "turn_index": n,
        "messages": [Message(role="user", content="What is 2+2?")],
        "response": Message(role="assistant", content="4"),
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [4, 5],
        "response_logprobs": [-0.1, -0.2],
        "finish_reason": "stop",
        "weight_version": 0,
        "model": "smollm2",
        "created_at": now,
        "completed_at": now + 0.5,
    }
    base.update(changes)
    return Turn(**base)  # type: ignore[arg-type]


def example_events(session_id: str = "s1") -> dict[type, object]:
    """One valid event of every type, all about the same turn."""
    turn = example_turn(session_id)
    now = time.time()
    paired = PairedTurn(turn=turn, next_state=[Message(role="user", content="thanks!")], paired_at=now)
    return {
        Turn: turn,
        PairedTurn: paired,
        SessionEnded: SessionEnded(session_id=session_id, after_turn_index=turn.turn_index, ended_at=now),
        Judgment: Judgment(
            turn_id=turn.turn_id,
            session_id=session_id,
            judge_id="j1",
            kind="eval",
            votes=[Vote(raw="\\boxed{1}", score=1)],
            paired=paired,
            judge_model="rules",
            created_at=now,
            eval_score=1,
        ),
        TeacherScores: TeacherScores(
            turn_id=turn.turn_id,
            session_id=session_id,
            judge_id="j1",
            hint="Say the answer plainly.",
            teacher_model="smollm2",
            response_token_ids=[4, 5],
            teacher_logprobs=[-0.05, -0.3],
            created_at=now,
            topk_token_ids=[[4, 7], [5, 9]],
            topk_logprobs=[[-0.05, -3.0], [-0.3, -1.5]],
        ),
        Sample: Sample(
            sample_id=turn.turn_id,
            session_id=session_id,
            mode="combine",
            kind="opd+rl",
            tokens=[1, 2, 3, 4, 5],
            response_length=2,
            loss_mask=[1, 1],
            rollout_logprobs=[-0.1, -0.2],
            reward=1.0,
            weight_version=0,
            created_at=now,
            teacher_logprobs=[-0.05, -0.3],
        ),
        WeightsPublished: WeightsPublished(
            version=1, path="/ckpt/v1", base_model="smollm2", step=1, created_at=now
        ),
        EvalResult: EvalResult(
            version=1,
            question_set="heldout-0123abcd",
            answers=[
                EvalAnswer("Capital of Italy?", "Rome. Cheers!", {"plain-short": True, "sign-off": True}, 4),
                EvalAnswer("Why do stars twinkle?", "**Air**", {"plain-short": False, "sign-off": False}, 3),
            ],
            scores={"plain-short": 0.5, "sign-off": 0.5},
            model="smollm2",
            evaluated_at=now,
        ),
        VersionDecision: VersionDecision(
            version=1,
            state="promoted",
            reason="passed 3 checks",
            by="gate",
            decided_at=now,
            checks=[VersionCheck("heldout-0123abcd:overall", 0.5, 0.45, True)],
            against=0,
        ),
        DeadLetter: DeadLetter(
            source_topic="turns",
            source_partition=0,
            source_offset=7,
            error_kind="decode",
            error="bad bytes",
            consumer_group="g",
            payload=b"\xc1",
            created_at=now,
        ),
    }
