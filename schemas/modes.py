"""The dispatch modes, each declared once: what a mode needs, what it emits, and which functions carry it out.

A mode is a way of turning judged turns into training samples (docs/design.md, "The method, exactly"). The
contract validates a ``Sample``'s mode and kind against this registry; the config and the CLI take their choices
from it; the dispatcher asks it which judgments to wait for; the trainer asks it for a sample's advantage.

The functions are named by dotted path (``package.module:function``), not imported: the contract imports nothing
of turnstream's, and a mode's advantage needs torch, which the dispatcher never loads. A plugin adds a mode with
one ``register_mode`` call in a module named in ``plugins.modules`` (docs/extending.md).
"""

from __future__ import annotations

from typing import Final

import msgspec


class ModeSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    kinds: frozenset[str]
    """The sample kinds it emits."""
    needs_eval: bool
    """The dispatcher waits for every configured judge's eval judgment."""
    needs_hint: bool
    """The dispatcher waits for the hint judgments, and for the teacher's scores of an accepted hint."""
    teacher_kinds: frozenset[str] = frozenset()
    """Kinds whose samples carry the teacher's log-probs (of the hint-enhanced context)."""
    rollout_as_teacher_kinds: frozenset[str] = frozenset()
    """Kinds whose samples carry the rollout log-probs as the teacher's, so a teacher-gap term is exactly zero."""
    zero_reward_kinds: frozenset[str] = frozenset()
    """Kinds that carry reward 0 whatever the eval said (pure distillation)."""
    at_least_one: bool = False
    """A session's first eval-0 turn still becomes a sample (reward 0) when the session has none yet."""
    decide: str
    """``(eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool) -> str | None``:
    the sample kind for a judged turn, or None for no sample."""
    advantage: str
    """``(reward: float, old: Tensor, teacher: Tensor | None, settings: TrainerConfig) -> Tensor``: per-token
    advantages of one sample from its reward, rollout log-probs and teacher log-probs (the default batch-level
    ``trainer.advantages`` calls it per sample)."""
    defaults: dict[str, float | int | bool | str | list[str]] = msgspec.field(default_factory=dict)
    """Settings this mode changes from the global defaults, as ``section.field`` (``trainer.eps_clip_high``,
    ``judge.m``); a value set in the config file or the environment still wins."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.strip():
            raise ValueError("name: a mode needs a name")
        if not self.kinds:
            raise ValueError(f"kinds: mode {self.name!r} emits no sample kind")
        for field in ("teacher_kinds", "rollout_as_teacher_kinds", "zero_reward_kinds"):
            extra = getattr(self, field) - self.kinds
            if extra:
                raise ValueError(f"{field}: {sorted(extra)} are not kinds of mode {self.name!r}")
        if self.teacher_kinds and not self.needs_hint:
            raise ValueError(f"teacher_kinds: mode {self.name!r} uses the teacher, so it needs_hint")
        for key in self.defaults:
            section, dot, field = key.partition(".")
            if not (section and dot and field) or "." in field:
                raise ValueError(f"defaults: {key!r} is not a 'section.field' setting")
        for field in ("decide", "advantage"):
            if ":" not in getattr(self, field):
                raise ValueError(f"{field}: {getattr(self, field)!r} is not a 'package.module:function' path")

    @property
    def kinds_with_teacher_logprobs(self) -> frozenset[str]:
        return self.teacher_kinds | self.rollout_as_teacher_kinds


_DISPATCHER = "services.dispatcher.rules"
_LOSS = "services.trainer.loss"

# The built-in modes' defaults are OpenClaw-RL's scripts' (openclaw-{rl,opd,combine}/run_qwen3_4b_*.sh): judge votes
# per turn (PRM_M) 3 for rl, 1 otherwise; judge tokens (--prm-max-new-tokens) 4096 for rl, 8192 for opd and
# combine; PPO clip 0.2 / 0.28, except opd, which sets no --eps-clip-high and so gets slime's symmetric 0.2 / 0.2.
BUILTIN_MODES: Final[tuple[ModeSpec, ...]] = (
    ModeSpec(
        name="rl",
        kinds=frozenset({"rl"}),
        needs_eval=True,
        needs_hint=False,
        at_least_one=True,
        decide=f"{_DISPATCHER}:decide_rl",
        advantage=f"{_LOSS}:rl_advantage",
        defaults={"judge.m": 3, "judge.max_tokens": 4096},
    ),
    ModeSpec(
        name="opd",
        kinds=frozenset({"opd"}),
        needs_eval=False,
        needs_hint=True,
        teacher_kinds=frozenset({"opd"}),
        zero_reward_kinds=frozenset({"opd"}),
        decide=f"{_DISPATCHER}:decide_opd",
        advantage=f"{_LOSS}:opd_advantage",
        defaults={"trainer.eps_clip_high": 0.2, "judge.max_tokens": 8192},
    ),
    ModeSpec(
        name="combine",
        kinds=frozenset({"opd+rl", "opd-only", "rl-only"}),
        needs_eval=True,
        needs_hint=True,
        teacher_kinds=frozenset({"opd+rl", "opd-only"}),
        rollout_as_teacher_kinds=frozenset({"rl-only"}),
        zero_reward_kinds=frozenset({"opd-only"}),
        decide=f"{_DISPATCHER}:decide_combine",
        advantage=f"{_LOSS}:combine_advantage",
        defaults={"judge.max_tokens": 8192},
    ),
    # OpenClaw-RL's top-K recipe (openclaw-opd/run_qwen3_4b_openclaw_opd_topk.sh): the PPO loss replaced by the
    # reverse KL to the teacher's top-K tokens (plus a tail bin), advantages unused, K 50, lr 1e-6, batches of 4,
    # 3 judge votes.
    ModeSpec(
        name="opd-topk",
        kinds=frozenset({"opd-topk"}),
        needs_eval=False,
        needs_hint=True,
        teacher_kinds=frozenset({"opd-topk"}),
        zero_reward_kinds=frozenset({"opd-topk"}),
        decide=f"{_DISPATCHER}:decide_opd_topk",
        advantage=f"{_LOSS}:opd_advantage",
        defaults={
            "trainer.loss_terms": ["topk"],
            "trainer.topk_coef": 1.0,
            "trainer.lr": 1e-6,
            "trainer.rollout_batch_size": 4,
            "teacher.top_k": 50,
            "judge.m": 3,
            "judge.max_tokens": 8192,
        },
    ),
)

MODES: dict[str, ModeSpec] = {m.name: m for m in BUILTIN_MODES}
"""Every mode this process knows: the built-in ones and those plugins registered."""


class UnknownMode(ValueError):
    pass


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Add a mode. Registering the same declaration again (a module imported twice) is harmless; a different
    one under a known name is refused."""
    known = MODES.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"mode {spec.name!r} is already declared differently: {known}")
    MODES[spec.name] = spec
    return spec


def mode_spec(name: str) -> ModeSpec:
    try:
        return MODES[name]
    except KeyError:
        raise UnknownMode(
            f"{name!r} is not one of {', '.join(sorted(MODES))} (a plugin's mode must be registered by a module"
            " in plugins.modules)"
        ) from None
