"""What the pipeline is doing, read from each service's Prometheus /metrics: the live view of ``turnstream run``
and its ``status.json``."""

from __future__ import annotations

from collections import defaultdict

import httpx
import msgspec

from runtime.observability.metrics import Samples, parse_samples


class Progress(msgspec.Struct):
    turns: int = 0
    """Turns the proxy has published to Kafka."""
    spool_pending: int = 0
    paired: int = 0
    judgments: int = 0
    """Turns judged (summed over judge ids)."""
    teacher_scored: int = 0
    samples: dict[str, int] = msgspec.field(default_factory=dict)
    """Samples emitted, by kind."""
    batch_fill: int = 0
    """Samples the trainer holds toward its next batch."""
    batch_size: int = 0
    steps: int = 0
    version: int = 0
    """Newest weight version the trainer published."""
    serving_version: int = 0
    """Weight version the engine serves (as the proxy's reloader saw it load)."""
    reward_mean: dict[str, float] = msgspec.field(default_factory=dict)
    """Mean reward of the last step's samples, by kind."""
    simulated: int = 0
    """Responses the simulated users saw."""
    preference_met: float | None = None
    """Share of those that met the user's preference (all versions)."""
    unpaired: dict[str, int] = msgspec.field(default_factory=dict)
    """Turns closed without a next state, by why (nothing is learned from them): no_session, idle_timeout,
    session_done, regenerated."""
    down: list[str] = msgspec.field(default_factory=list)
    """Services whose /metrics did not answer."""
    heldout: dict[str, float] = msgspec.field(default_factory=dict)
    """The held-out evaluation's share of answers meeting each persona's preference (``turnstream eval``)."""
    heldout_version: int | None = None
    """The weight version that evaluation is of (None: none evaluated yet)."""

    def line(self) -> str:
        samples = ", ".join(f"{k} {v}" for k, v in sorted(self.samples.items())) or "0"
        reward = ", ".join(f"{k} {v:+.2f}" for k, v in sorted(self.reward_mean.items())) or "-"
        text = (
            f"turns {self.turns} | paired {self.paired} | judged {self.judgments} | teacher {self.teacher_scored}"
            f" | samples {samples} | batch {self.batch_fill}/{self.batch_size} | steps {self.steps}"
            f" | weights v{self.version} (serving v{self.serving_version}) | reward {reward}"
        )
        if self.simulated:
            text += f" | simulated {self.simulated}, preference met {100 * (self.preference_met or 0):.0f}%"
        if self.heldout_version is not None:
            scores = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(self.heldout.items()))
            text += f" | held-out v{self.heldout_version}: {scores}"
        if any(self.unpaired.values()):
            why = ", ".join(f"{_REASONS.get(k, k)} {v}" for k, v in sorted(self.unpaired.items()) if v)
            text += f" | no next state: {why}"
        if self.spool_pending:
            text += f" | spooled {self.spool_pending}"
        if self.down:
            text += f" | not answering: {', '.join(self.down)}"
        return text


_REASONS = {"no_session": "no session", "idle_timeout": "idle", "session_done": "done"}


def _total(metrics: Samples, name: str) -> int:
    return int(sum(metrics.get(name, {}).values()))


def _by(metrics: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in metrics.get(name, {}).items():
        out[dict(labels).get(label, "")] += value
    return dict(out)


async def scrape(
    http: httpx.AsyncClient,
    ports: dict[str, int],
    batch_size: int,
    headers: dict[str, dict[str, str]] | None = None,
) -> Progress:
    """One snapshot; a service that does not answer is listed in ``down`` (and counts as zero). ``headers``: per
    service, what its ``/metrics`` needs (the proxy's key)."""
    metrics: Samples = {}
    down = []
    for name, port in ports.items():
        try:
            r = await http.get(
                f"http://127.0.0.1:{port}/metrics", timeout=2, headers=(headers or {}).get(name)
            )
            r.raise_for_status()
        except httpx.HTTPError:
            down.append(name)
            continue
        for metric, values in parse_samples(r.text).items():
            metrics.setdefault(metric, {}).update(values)
    met = _by(metrics, "turnstream_simulate_responses_total", "met")
    simulated = int(sum(met.values()))
    return Progress(
        turns=_total(metrics, "turnstream_proxy_turns_published_total"),
        spool_pending=_total(metrics, "turnstream_proxy_spool_pending"),
        paired=_total(metrics, "turnstream_pairer_pairs_total"),
        judgments=_total(metrics, "turnstream_judge_turns_total"),
        teacher_scored=_total(metrics, "turnstream_teacher_scored_total"),
        samples={k: int(v) for k, v in _by(metrics, "turnstream_dispatcher_samples_total", "kind").items()},
        batch_fill=_total(metrics, "turnstream_trainer_pending_samples"),
        batch_size=batch_size,
        steps=_total(metrics, "turnstream_trainer_steps_total"),
        version=_total(metrics, "turnstream_trainer_version"),
        serving_version=int(min(metrics.get("turnstream_proxy_weight_version", {}).values(), default=0)),
        reward_mean=_by(metrics, "turnstream_trainer_reward_mean", "kind"),
        simulated=simulated,
        preference_met=met.get("true", 0.0) / simulated if simulated else None,
        unpaired={k: int(v) for k, v in _by(metrics, "turnstream_pairer_unpaired_total", "reason").items()},
        down=down,
        heldout=_by(metrics, "turnstream_eval_score", "persona"),
        heldout_version=_total(metrics, "turnstream_eval_version")
        if "turnstream_eval_score" in metrics
        else None,
    )
