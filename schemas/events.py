"""The event contract: every record on every turnstream topic is one of these structs.

Invariants are checked in ``__post_init__``, which msgspec runs both when a struct is built in code and when it
is decoded from the wire, so an invalid record is rejected at the boundary with an error that names the field.
Each struct carries ``schema_version``; a consumer rejects versions newer than it understands (dead-letter)
rather than guessing.
"""

from __future__ import annotations

import math
from typing import Any, Final, NoReturn

import msgspec

from schemas.modes import MODES

SCHEMA_VERSION: Final = 1

ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool"})
FINISH_REASONS: Final = frozenset({"stop", "length", "tool_calls", "content_filter", "abort"})
TOKEN_SOURCES: Final = frozenset({"engine", "retokenized"})
TERMINAL_REASONS: Final = frozenset({"session_done", "idle_timeout", "regenerated"})
"""Why a turn has no next state: the client ended the session, it went idle, or the client replaced the turn's
answer (edited or regenerated a message: a branch of the conversation, ``regenerated``)."""
SESSION_END_REASONS: Final = frozenset({"session_done", "regenerated"})
JUDGMENT_KINDS: Final = frozenset({"eval", "hint"})
EVAL_SCORES: Final = frozenset({-1, 0, 1})
HINT_SCORES: Final = frozenset({-1, 1})
DEADLETTER_KINDS: Final = frozenset({"decode", "validation", "processing"})

# Log-probs are <= 0; engines in float16/bfloat16 occasionally report a hair above 0 for a certain token.
_LOGPROB_CEILING: Final = 1e-3


class ContractError(ValueError):
    """An event violates the contract. The message starts with the offending field's name."""


def _fail(field: str, problem: str) -> NoReturn:
    raise ContractError(f"{field}: {problem}")


def _require_id(field: str, value: str) -> None:
    if not value or not value.strip():
        _fail(field, "must be a non-empty id")


def _require_in(field: str, value: object, allowed: frozenset[Any]) -> None:
    if value not in allowed:
        _fail(field, f"{value!r} is not one of {sorted(allowed, key=str)}")


def _require_schema_version(value: int) -> None:
    if not 1 <= value <= SCHEMA_VERSION:
        _fail("schema_version", f"{value} is not supported (this build understands 1..{SCHEMA_VERSION})")


def _require_token_ids(field: str, ids: list[int]) -> None:
    if not ids or min(ids) >= 0:  # the common case in one C loop; decoding every Turn runs this
        return
    for i, tok in enumerate(ids):
        if tok < 0:
            _fail(field, f"token id {tok} at index {i} is negative")


def _require_logprobs(field: str, values: list[float], n_tokens: int, tokens_field: str) -> None:
    if len(values) != n_tokens:
        _fail(field, f"has {len(values)} entries but {tokens_field} has {n_tokens}")
    if not values:
        return
    # The common case in C loops: a NaN makes the sum NaN and -inf makes it -inf (a sum that merely overflows
    # takes the exact loop below, which then passes).
    total = sum(values)
    if total == total and total != -math.inf and max(values) <= _LOGPROB_CEILING:
        return
    for i, lp in enumerate(values):
        if math.isnan(lp) or lp > _LOGPROB_CEILING or lp == -math.inf:
            _fail(field, f"entry {i} is {lp}, not a finite log-probability")


def _require_topk(
    ids_field: str,
    ids: list[list[int]] | None,
    lps_field: str,
    lps: list[list[float]] | None,
    n_tokens: int,
) -> None:
    if ids is None and lps is None:
        return
    if ids is None or lps is None:
        _fail(ids_field if ids is None else lps_field, f"{ids_field} and {lps_field} must be given together")
    assert ids is not None and lps is not None
    if len(ids) != n_tokens:
        _fail(ids_field, f"has {len(ids)} rows but the response has {n_tokens} tokens")
    if len(lps) != n_tokens:
        _fail(lps_field, f"has {len(lps)} rows but the response has {n_tokens} tokens")
    k = len(ids[0]) if ids else 0
    if n_tokens and k < 1:
        _fail(ids_field, "top-K rows must hold at least one token")
    for i, (row_ids, row_lps) in enumerate(zip(ids, lps, strict=True)):
        if len(row_ids) != k:
            _fail(ids_field, f"row {i} has {len(row_ids)} tokens, expected K={k}")
        if len(row_lps) != k:
            _fail(lps_field, f"row {i} has {len(row_lps)} log-probs, expected K={k}")
        _require_token_ids(f"{ids_field}[{i}]", row_ids)
        _require_logprobs(f"{lps_field}[{i}]", row_lps, k, f"{ids_field}[{i}]")


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=False):
    """Base of every event. ``type`` (the tag) tells decoders which struct a record holds."""

    schema_version: int = SCHEMA_VERSION


# --- building blocks (OpenAI chat shapes) -------------------------------------------------------------------


class FunctionCall(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    arguments: str = ""
    """JSON text, exactly as the model produced it (it may be invalid JSON; that is training signal too)."""


class ToolCall(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    function: FunctionCall
    type: str = "function"


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    """One OpenAI chat message. ``content`` may be text or a list of content parts (kept verbatim)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        _require_in("role", self.role, ROLES)

    @property
    def text(self) -> str:
        """The text of ``content``: the string, or the text parts joined (other parts carry no text)."""
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The sampling parameters the response was sampled with. The proxy sends temperature, top_p, top_k, min_p and
    repetition_penalty explicitly on every main turn (the client's value, else the model's default), so these are
    the engine's effective values, never a guess; None only in turns recorded before that."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


# --- events --------------------------------------------------------------------------------------------------


class Turn(Event, frozen=True, tag="turn"):
    """One main-line assistant turn, recorded by the proxy after the response completed.

    The source of truth of the whole pipeline: everything downstream is re-derivable from ``turns``.
    """

    turn_id: str
    """``{session_id}:{turn_index}``; stable across retries, so downstream writes are idempotent."""
    session_id: str
    turn_index: int
    """1, 2, ... within the session (numbered in Redis, so several proxy replicas agree)."""
    messages: list[Message]
    """The request's messages, as the client sent them."""
    response: Message
    """The assistant message returned to the client (content, reasoning_content, tool_calls)."""
    prompt_token_ids: list[int]
    """Exact engine token ids of the rendered prompt."""
    response_token_ids: list[int]
    """Exact engine token ids of the response."""
    response_logprobs: list[float]
    """Rollout log-probs, one per response token (``lp_old`` in the loss)."""
    finish_reason: str
    weight_version: int
    """The policy weight version that actually produced the response."""
    model: str
    created_at: float
    """Unix seconds when the request arrived."""
    completed_at: float
    """Unix seconds when the response completed."""
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """OpenAI tool specs passed to the chat template, verbatim."""
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    session_done: bool = False
    """The client marked the session done with this turn (X-Session-Done)."""
    token_source: str = "engine"
    """``engine`` (ids from the engine) or ``retokenized`` (the engine could not return them)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """What the request passed to the chat template (e.g. ``{"enable_thinking": false}``): with ``tools`` and
    ``messages``, what rendered ``prompt_token_ids``."""
    user: str = ""
    """The request's OpenAI ``user`` field (an end-user id; the simulated users send their persona's name)."""
    api: str = "chat"
    """The API the client spoke: ``chat`` (chat completions), ``responses`` (OpenAI's Responses API) or
    ``messages`` (Anthropic's Messages API). ``messages`` is always the chat form the engine was sent, whatever the
    API (the proxy translates), so nothing downstream reads this: it tells which clients teach the model."""
    replica: str = ""
    """The policy replica that answered (its ``host:port``; empty in turns recorded before replicas were named)."""

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        _require_id("session_id", self.session_id)
        if self.turn_index < 1:
            _fail("turn_index", f"must be >= 1, got {self.turn_index}")
        if self.turn_id != f"{self.session_id}:{self.turn_index}":
            _fail("turn_id", f"{self.turn_id!r} is not '{{session_id}}:{{turn_index}}'")
        if not self.messages:
            _fail("messages", "must not be empty")
        if self.response.role != "assistant":
            _fail("response.role", f"must be 'assistant', got {self.response.role!r}")
        if not self.prompt_token_ids:
            _fail("prompt_token_ids", "must not be empty")
        _require_token_ids("prompt_token_ids", self.prompt_token_ids)
        _require_token_ids("response_token_ids", self.response_token_ids)
        _require_logprobs(
            "response_logprobs", self.response_logprobs, len(self.response_token_ids), "response_token_ids"
        )
        _require_in("finish_reason", self.finish_reason, FINISH_REASONS)
        _require_in("token_source", self.token_source, TOKEN_SOURCES)
        if self.weight_version < 0:
            _fail("weight_version", f"must be >= 0, got {self.weight_version}")
        _require_id("model", self.model)
        if self.completed_at < self.created_at:
            _fail("completed_at", "is earlier than created_at")


class PairedTurn(Event, frozen=True, tag="paired_turn"):
    """A turn with its next state: what the following request added after the turn's response."""

    turn: Turn
    next_state: list[Message] | None
    """The messages that followed the response (user, tool results, ...), with roles; None when terminal."""
    paired_at: float
    terminal_reason: str | None = None
    """Set when there is no next state: ``session_done``, ``idle_timeout`` or ``regenerated``."""
    misaligned: bool = False
    """The next request's history did not contain this turn's response where expected; paired with its last
    message instead."""

    @property
    def turn_id(self) -> str:
        return self.turn.turn_id

    @property
    def terminal(self) -> bool:
        return self.next_state is None

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        if self.next_state is None:
            if self.terminal_reason is None:
                _fail("terminal_reason", "is required when next_state is None (terminal pairing)")
            _require_in("terminal_reason", self.terminal_reason, TERMINAL_REASONS)
        else:
            if not self.next_state:
                _fail("next_state", "must hold at least one message (use None for a terminal pairing)")
            if self.terminal_reason is not None:
                _fail("terminal_reason", "must be None when there is a next state")


class SessionEnded(Event, frozen=True, tag="session_ended"):
    """A session's open turn closed without a next state: a client ended the session on a side request
    (``X-Session-Done`` where no turn is recorded), or replaced the turn's answer (``regenerated``): the session's
    last main turn has no next state. On its own topic, so the pairer reads it beside ``turns``; it names the
    turn it closes, so it needs no ordering with them."""

    session_id: str
    after_turn_index: int | None
    """The session's last main turn number when the client ended it; None when the proxy could not read it
    (Redis unreachable): then it closes whichever turn of the session is open."""
    ended_at: float
    reason: str = "session_done"
    """``session_done`` (the client said so) or ``regenerated`` (the proxy saw the client replace the named turn's
    answer: the conversation branched before it)."""

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        _require_id("session_id", self.session_id)
        _require_in("reason", self.reason, SESSION_END_REASONS)
        if self.after_turn_index is not None and self.after_turn_index < 0:
            _fail("after_turn_index", f"must be >= 0, got {self.after_turn_index}")


class Vote(msgspec.Struct, frozen=True, omit_defaults=True):
    """One judge sample: the raw text, and what parsing made of it (score None = a failed vote)."""

    raw: str
    score: int | None = None
    hint: str = ""
    error: str | None = None
    """Why the vote failed (engine error, deadline), when it did."""


class Judgment(Event, frozen=True, tag="judgment"):
    """The verdict of one judge (``judge_id``) of one kind on one paired turn. Key: turn_id/judge_id/kind."""

    turn_id: str
    session_id: str
    judge_id: str
    kind: str
    """``eval`` (did the turn work: eval_score) or ``hint`` (hindsight hint: accepted, hint)."""
    votes: list[Vote]
    paired: PairedTurn
    """The paired turn judged, so that teacher and dispatcher need no second join."""
    judge_model: str
    created_at: float
    eval_score: int | None = None
    """Kind eval: majority of valid votes in {-1, 0, 1}."""
    accepted: bool = False
    """Kind hint: whether a hint was accepted."""
    hint: str | None = None
    """Kind hint: the accepted hint."""

    @property
    def key(self) -> str:
        return f"{self.turn_id}/{self.judge_id}/{self.kind}"

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        _require_id("turn_id", self.turn_id)
        _require_id("session_id", self.session_id)
        _require_id("judge_id", self.judge_id)
        _require_in("kind", self.kind, JUDGMENT_KINDS)
        if not self.votes:
            _fail("votes", "must hold at least one vote")
        if self.paired.turn_id != self.turn_id:
            _fail("paired", f"holds turn {self.paired.turn_id!r}, not {self.turn_id!r}")
        if self.paired.turn.session_id != self.session_id:
            _fail("session_id", "differs from the paired turn's session_id")
        allowed = EVAL_SCORES if self.kind == "eval" else HINT_SCORES
        for i, vote in enumerate(self.votes):
            if vote.score is not None and vote.score not in allowed:
                _fail(f"votes[{i}].score", f"{vote.score} is not one of {sorted(allowed)}")
        if self.kind == "eval":
            if self.eval_score is None:
                _fail("eval_score", "is required for kind 'eval'")
            _require_in("eval_score", self.eval_score, EVAL_SCORES)
            if self.accepted or self.hint is not None:
                _fail("accepted", "kind 'eval' carries no hint")
        else:
            if self.eval_score is not None:
                _fail("eval_score", "must be None for kind 'hint'")
            if self.accepted != (self.hint is not None):
                _fail("hint", "must be set exactly when accepted is true")
            if self.hint is not None and not self.hint.strip():
                _fail("hint", "an accepted hint must not be blank")


class TeacherScores(Event, frozen=True, tag="teacher_scores"):
    """Teacher log-probs of the turn's exact response tokens, under the accepted hint."""

    turn_id: str
    session_id: str
    judge_id: str
    """The judge whose hint was used."""
    hint: str
    teacher_model: str
    response_token_ids: list[int]
    teacher_logprobs: list[float]
    created_at: float
    topk_token_ids: list[list[int]] | None = None
    """Optional top-K: per response position, the teacher's K most likely token ids."""
    topk_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        _require_id("turn_id", self.turn_id)
        _require_id("session_id", self.session_id)
        _require_id("judge_id", self.judge_id)
        if not self.hint.strip():
            _fail("hint", "must not be blank")
        _require_id("teacher_model", self.teacher_model)
        _require_token_ids("response_token_ids", self.response_token_ids)
        _require_logprobs(
            "teacher_logprobs", self.teacher_logprobs, len(self.response_token_ids), "response_token_ids"
        )
        _require_topk(
            "topk_token_ids",
            self.topk_token_ids,
            "topk_logprobs",
            self.topk_logprobs,
            len(self.response_token_ids),
        )


class Sample(Event, frozen=True, tag="sample"):
    """One training-ready sample. ``sample_id`` is the turn id: at most one sample per turn."""

    sample_id: str
    session_id: str
    mode: str
    """Dispatch mode: ``rl``, ``opd``, ``combine`` or a plugin's (``schemas/modes.py``)."""
    kind: str
    """One of the mode's kinds: ``rl``; ``opd``; or for combine ``opd+rl``, ``opd-only``, ``rl-only``."""
    tokens: list[int]
    """Prompt token ids followed by response token ids."""
    response_length: int
    loss_mask: list[int]
    """One entry per response token, 0 or 1."""
    rollout_logprobs: list[float]
    reward: float
    weight_version: int
    """The policy version that produced the response (staleness is measured against it)."""
    created_at: float
    teacher_logprobs: list[float] | None = None
    """Per response token; for ``rl-only`` equal to rollout_logprobs so the OPD term is exactly zero."""
    topk_token_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        _require_id("sample_id", self.sample_id)
        _require_id("session_id", self.session_id)
        spec = MODES.get(self.mode)
        if spec is None:
            _fail("mode", f"{self.mode!r} is not one of {sorted(MODES)}")
        _require_in("kind", self.kind, spec.kinds)
        _require_token_ids("tokens", self.tokens)
        if not 1 <= self.response_length < len(self.tokens):
            _fail("response_length", f"{self.response_length} must be in [1, len(tokens)={len(self.tokens)})")
        if len(self.loss_mask) != self.response_length:
            _fail("loss_mask", f"has {len(self.loss_mask)} entries, expected response_length")
        if any(m not in (0, 1) for m in self.loss_mask):
            _fail("loss_mask", "entries must be 0 or 1")
        _require_logprobs("rollout_logprobs", self.rollout_logprobs, self.response_length, "response_length")
        if self.kind in spec.kinds_with_teacher_logprobs and self.teacher_logprobs is None:
            _fail("teacher_logprobs", f"is required for kind {self.kind!r}")
        if self.teacher_logprobs is not None:
            _require_logprobs(
                "teacher_logprobs", self.teacher_logprobs, self.response_length, "response_length"
            )
        _require_topk(
            "topk_token_ids", self.topk_token_ids, "topk_logprobs", self.topk_logprobs, self.response_length
        )
        if not math.isfinite(self.reward) or not -1.0 <= self.reward <= 1.0:
            _fail("reward", f"{self.reward} is not a finite value in [-1, 1]")
        if self.kind in spec.zero_reward_kinds and self.reward != 0:
            _fail("reward", f"must be 0 for kind {self.kind!r}")
        if self.weight_version < 0:
            _fail("weight_version", f"must be >= 0, got {self.weight_version}")


WEIGHT_FORMATS = frozenset({"hf-safetensors", "peft-lora"})


class WeightsPublished(Event, frozen=True, tag="weights_published"):
    """A new policy weight version at ``path``: Hugging Face safetensors (``format`` ``hf-safetensors``: full
    weights, the engine loads the folder as a model) or a PEFT LoRA adapter for ``base_model`` (``peft-lora``:
    ``adapter_config.json`` + ``adapter_model.safetensors``, served on the base model)."""

    version: int
    path: str
    base_model: str
    step: int
    created_at: float
    samples_trained: int = 0
    format: str = "hf-safetensors"
    sha256: str | None = None
    """Digest of the weights file(s), so a loader can verify what it read."""
    sample_ids: list[str] = msgspec.field(default_factory=list)
    """The samples the step behind this version trained on (empty from producers that predate the field)."""
    figures: dict[str, float] = msgspec.field(default_factory=dict)
    """The step's figures (loss, clip_fraction, kl_rollout, grad_norm, entropy, ...), for dashboards."""
    advantages: list[float] = msgspec.field(default_factory=list)
    """Each trained sample's advantage as the step used it (``trainer.advantages``), its mean over the response's
    tokens; parallel to ``sample_ids`` (empty from producers that predate the field)."""

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        if self.advantages and len(self.advantages) != len(self.sample_ids):
            _fail("advantages", f"{len(self.advantages)} values for {len(self.sample_ids)} sample_ids")
        if not all(math.isfinite(a) for a in self.advantages):
            _fail("advantages", "must all be finite")
        if self.version < 1:
            _fail("version", f"must be >= 1, got {self.version}")
        _require_id("path", self.path)
        _require_id("base_model", self.base_model)
        if self.step < 0:
            _fail("step", f"must be >= 0, got {self.step}")
        if self.samples_trained < 0:
            _fail("samples_trained", f"must be >= 0, got {self.samples_trained}")
        _require_in("format", self.format, WEIGHT_FORMATS)


class EvalAnswer(msgspec.Struct, frozen=True):
    """One held-out question, the policy's greedy answer, and whether each persona's preference is met by it."""

    question: str
    answer: str
    satisfied: dict[str, bool]
    """Persona (or an evaluation set's check) name -> whether the answer meets it."""
    completion_tokens: int = 0


class EvalResult(Event, frozen=True, tag="eval_result"):
    """The evaluation of one weight version on one question set, answered greedily by ``version``: the held-out set
    (questions training traffic never asks, each answer scored by every persona's preference check) or a team's
    own evaluation set (``services/eval/sets.py``: each answer judged by its case's checks only). ``scores`` is
    derived from ``answers`` (checked): each name's score is the share of the answers judged for it that met it,
    so a reader can recompute and audit every figure."""

    version: int
    """The weight version the engine served for every answer (0: the starting weights)."""
    question_set: str
    """Names the question set (the held-out one's or an evaluation set's, with a digest of its contents), so results
    of different sets are never mixed."""
    answers: list[EvalAnswer]
    scores: dict[str, float]
    """Persona (or check) name -> the share of the answers judged for it that meet it."""
    model: str
    evaluated_at: float
    duration_s: float = 0.0
    mean_words: float = 0.0

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        if self.version < 0:
            _fail("version", f"must be >= 0, got {self.version}")
        _require_id("question_set", self.question_set)
        _require_id("model", self.model)
        if not self.answers:
            _fail("answers", "must hold at least one answer")
        personas = set(self.scores)
        if not personas:
            _fail("scores", "must score at least one persona")
        for i, a in enumerate(self.answers):
            if not a.satisfied or not set(a.satisfied) <= personas:
                _fail(
                    "answers",
                    f"answer {i} is judged for {sorted(a.satisfied)}, the scores for {sorted(personas)}",
                )
            if a.completion_tokens < 0:
                _fail("answers", f"answer {i}: completion_tokens must be >= 0")
        for name, score in self.scores.items():
            judged = [a.satisfied[name] for a in self.answers if name in a.satisfied]
            if not judged:
                _fail("scores", f"{name}: no answer is judged for it")
            met, n = sum(judged), len(judged)
            if abs(score - met / n) > 1e-9:
                _fail("scores", f"{name}: {score} is not the share of satisfied answers ({met}/{n})")
        if self.duration_s < 0:
            _fail("duration_s", f"must be >= 0, got {self.duration_s}")

    @property
    def overall(self) -> float:
        """One figure for the result: the share of all (answer, name) outcomes that were met."""
        outcomes = [ok for a in self.answers for ok in a.satisfied.values()]
        return sum(outcomes) / len(outcomes)


VERSION_STATES = frozenset(
    {"candidate", "promoted", "rejected", "rolled_back", "superseded", "pinned", "unpinned", "restored"}
)
"""What a decision makes of a version: ``candidate`` (published, not yet served under a gate), ``promoted``
(served), ``rejected`` (failed its gate, never served), ``rolled_back`` (was served, taken back), ``pinned`` /
``unpinned`` (serving frozen at it while training goes on, and released), ``superseded`` (a newer candidate
arrived before it was judged: never evaluated, not a failure), ``restored`` (the trainer went back to
its weights and optimiser state after ``gate.restore_after`` rejected candidates)."""
DECIDERS = frozenset({"gate", "manual", "trainer"})


class VersionCheck(msgspec.Struct, frozen=True):
    """One comparison behind a gate's decision: ``value`` against ``bound`` (the least a score may be, or with
    ``at_most`` the most a figure or a length may be)."""

    name: str
    value: float
    bound: float
    passed: bool
    at_most: bool = False


class VersionDecision(Event, frozen=True, tag="version_decision"):
    """A decision about which weight version users are served (guarded learning, docs/evaluation.md). The whole
    history is kept and replayed: the served version is the fold of every decision, so a restarted proxy, the
    trainer and the console agree on it."""

    version: int
    state: str
    reason: str
    by: str
    """``gate``, ``manual`` (``turnstream versions``) or ``trainer`` (a restore)."""
    decided_at: float
    checks: list[VersionCheck] = msgspec.field(default_factory=list)
    """What the gate compared (empty for manual decisions)."""
    against: int | None = None
    """The promoted version the candidate was compared with."""
    figures: dict[str, float] = msgspec.field(default_factory=dict)
    """The trainer's figures for the version (``WeightsPublished.figures``), copied when it became a candidate:
    ``weights`` keeps only the newest version."""
    path: str = ""
    """Where the version's weights are (``WeightsPublished.path``), copied when it became a candidate, so that a
    rollback or a pin can load a version ``weights`` no longer holds."""

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        if self.version < 0:
            _fail("version", f"must be >= 0, got {self.version}")
        _require_in("state", self.state, VERSION_STATES)
        _require_in("by", self.by, DECIDERS)
        _require_id("reason", self.reason)


class DeadLetter(Event, frozen=True, tag="dead_letter"):
    """A record a consumer could not use, with where it came from and why. Its payload is kept verbatim, unless
    the letter would not fit a Kafka record: then ``payload`` is empty and ``payload_omitted_bytes`` and
    ``payload_sha256`` describe the source record, which its coordinates still find (a dead letter must always fit,
    or the partition it came from could never move on)."""

    source_topic: str
    source_partition: int
    source_offset: int
    error_kind: str
    """``decode`` (not msgpack / unknown type), ``validation`` (contract violated) or ``processing``."""
    error: str
    consumer_group: str
    payload: bytes
    created_at: float
    source_key: bytes | None = None
    source_timestamp_ms: int | None = None
    payload_omitted_bytes: int = 0
    payload_sha256: str = ""

    def __post_init__(self) -> None:
        _require_schema_version(self.schema_version)
        _require_id("source_topic", self.source_topic)
        if self.payload_omitted_bytes < 0:
            _fail("payload_omitted_bytes", f"must be >= 0, got {self.payload_omitted_bytes}")
        if self.source_partition < 0:
            _fail("source_partition", f"must be >= 0, got {self.source_partition}")
        if self.source_offset < 0:
            _fail("source_offset", f"must be >= 0, got {self.source_offset}")
        _require_in("error_kind", self.error_kind, DEADLETTER_KINDS)
        _require_id("error", self.error)


EVENT_TYPES: Final[tuple[type[Event], ...]] = (
    Turn,
    SessionEnded,
    PairedTurn,
    Judgment,
    TeacherScores,
    Sample,
    WeightsPublished,
    EvalResult,
    VersionDecision,
    DeadLetter,
)
