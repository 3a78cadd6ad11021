"""The gate against a deliberately bad learning signal, on this CPU with SmolLM2 (docs/evaluation.md). Prints JSON.

    .venv/bin/python bench/guarded.py --runs good,good-gated --until-version 10 \
        --image docs/images/gated-good-signal.png
    .venv/bin/python bench/guarded.py --runs unguarded,guarded --start-from good [--until-version 16]
    .venv/bin/python bench/guarded.py --runs guarded-restore --start-from good --until-version 12 \
        --image docs/images/guarded-restore.png
    .venv/bin/python bench/guarded.py --runs unguarded-lora,guarded-adapter --start-from good --until-version 8 \
        --image docs/images/guarded-adapter.png
    .venv/bin/python bench/guarded.py --plot-only --out bench/guarded_runs --image docs/images/guarded-vs-unguarded.png

``unguarded`` and ``guarded`` are the README's learning run (``turnstream run --simulate 3 --until-version N``,
batches of 8), from the best version of ``--start-from``'s run when given, with every eval vote turned around
(``examples/plugins/inverted_votes.py``) in ``rl`` mode, so the reward is all a step learns from and it rewards
what the simulated users corrected. ``unguarded``: no gate, every version is served. ``guarded``: ``gate.enabled``,
``serve-then-check`` (full weights on one server: a candidate is served, evaluated and rolled back within that one
evaluation when a held-out score falls more than ``gate.margin`` below the promoted version's), the trainer
restoring the promoted version after ``gate.restore_after`` failures.

``good`` and ``good-gated`` are the README's learning run as it is (combine mode, the teacher's top-16) without and
with the same gate: their ``steps_per_min`` (weight versions published per minute, first to last) is the gate's
cost to a run that learns (``--runs good,good-gated --image docs/images/gated-good-signal.png``).

Each run has its own namespace, trainer folder and run folder (``<out>/<run>/``). Afterwards the run's topics are
read (``turnstream run`` leaves the local Kafka running) into ``<out>/<run>.json``: every held-out result with
when it was made, every decision on ``versions``, and the served timeline: without a gate the version evaluated
is the one users had; with it, the promoted (or pinned) version between decisions, and each candidate for the
time it was served before its verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec

from runtime.configuration.config import load_config
from runtime.messaging.bus import read_topic
from runtime.pipeline.promotion import Promotion
from schemas import Turn
from schemas.topics import EVALS, TURNS, VERSIONS, WEIGHTS

REPO = Path(__file__).resolve().parent.parent
BAD_SIGNAL = {
    "TURNSTREAM_DISPATCHER_MODE": "rl",
    "TURNSTREAM_JUDGE_VOTE_PARSER": "examples.plugins.inverted_votes:parse_vote",
    "TURNSTREAM_TRAINER_LR": "5e-5",
    "TURNSTREAM_TRAINER_ROLLOUT_BATCH_SIZE": "8",
}
GOOD_SIGNAL = {  # the README's learning run
    "TURNSTREAM_TEACHER_TOP_K": "16",
    "TURNSTREAM_TRAINER_TOPK_COEF": "1.0",
    "TURNSTREAM_TRAINER_LR": "5e-5",
    "TURNSTREAM_TRAINER_ROLLOUT_BATCH_SIZE": "8",
}
GATED = {
    "TURNSTREAM_GATE_ENABLED": "true",
    "TURNSTREAM_GATE_MECHANISM": "serve-then-check",
    "TURNSTREAM_GATE_MARGIN": "0.05",
    "TURNSTREAM_GATE_RESTORE_AFTER": "3",
}
LORA = {  # the LoRA learning run of bench/RESULTS.md: LoRA wants a larger step than full weights
    "TURNSTREAM_TRAINER_LORA_ENABLED": "true",
    "TURNSTREAM_TRAINER_LR": "2e-4",
}
RUNS = {
    "unguarded": BAD_SIGNAL,
    "guarded": {**BAD_SIGNAL, **GATED},
    "good": GOOD_SIGNAL,
    "good-gated": {**GOOD_SIGNAL, **GATED},
    "guarded-restore": {
        **BAD_SIGNAL,
        **GATED,
        "TURNSTREAM_TRAINER_LR": "1e-4",
        "TURNSTREAM_GATE_RESTORE_AFTER": "2",
    },
    # LoRA: one engine serves the base and an adapter per version; under the gate's ``adapter`` mechanism each
    # candidate is loaded beside the promoted adapter and evaluated by name, so users never meet it
    "unguarded-lora": {**BAD_SIGNAL, **LORA},
    "guarded-adapter": {**BAD_SIGNAL, **LORA, **GATED, "TURNSTREAM_GATE_MECHANISM": "adapter"},
}
"""Each run's settings: the bad signal without and with the gate, and the good one (its steps per minute with
the gate on against off: the gate's cost to a run that learns), and ``guarded-restore``: the bad signal at twice
the learning rate, the trainer restoring after two failed candidates, so that a restore happens within a short run;
``unguarded-lora`` and ``guarded-adapter``: the bad signal with LoRA adapters, without the gate and with its
``adapter`` mechanism (candidates evaluated beside the promoted adapter, never served)."""
PERSONA = "plain-short"
"""The persona whose score moves (SmolLM2 never learns the other one: bench/RESULTS.md)."""


def start_model(out: Path, source: str) -> tuple[Path, int, float]:
    """A model folder holding the weights of run ``source``'s earliest version with its best held-out score:
    a bad signal is shown falling from what a good one reached (SmolLM2 starts at 25%)."""
    from runtime.engine.model_store import fetch_smollm2

    if (out / source / ".complete").is_file():  # a start folder made before (``start-<run>-v<N>``)
        version = int(source.rsplit("-v", 1)[1])
        return out / source, version, float("nan")
    record = json.loads((out / f"{source}.json").read_text())
    best = max(record["evals"], key=lambda e: (e["scores"].get(PERSONA, 0.0), -e["version"]))
    version = best["version"]
    target = out / f"start-{source}-v{version}"
    if not (target / ".complete").is_file():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(fetch_smollm2(log=False), target)  # the tokenizer and config
        if version:
            for f in (out / source / "weights" / "versions" / f"v{version}").iterdir():
                shutil.copy2(f, target / f.name)
        (target / ".complete").touch()
    return target, version, best["scores"][PERSONA]


def run(name: str, until: int, out: Path, start: Path | None = None) -> dict[str, Any]:
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)  # a trainer folder left by an earlier run would be resumed from
    folder.mkdir(parents=True)
    env = {
        **os.environ,
        **RUNS[name],
        **({"TURNSTREAM_TRAINER_HF_CHECKPOINT": str(start)} if start else {}),
        "TURNSTREAM_TRAINER_KEEP_VERSIONS": "1000",  # a later run may start from any version of this one
        "TURNSTREAM_KAFKA_NAMESPACE": (ns := f"guarded-{name}-{uuid.uuid4().hex[:6]}"),
        "TURNSTREAM_REDIS_KEY_PREFIX": f"{ns}:",  # the local Redis outlives a run: no state carried between runs
        "TURNSTREAM_TRAINER_OUTPUT_DIR": str(folder / "weights"),
        "TURNSTREAM_RUN_RUN_DIR": str(folder / "run"),
        "OMP_NUM_THREADS": "1",
    }
    started = time.time()
    subprocess.run(
        [str(REPO / ".venv/bin/turnstream"), "run", "--simulate", "3", "--until-version", str(until)],
        env=env,
        cwd=REPO,
        check=True,
    )
    record = asyncio.run(read_run(env))
    record.update(
        name=name,
        namespace=ns,
        started_at=started,
        wall_s=round(time.time() - started, 1),
        start=str(start or ""),
        mechanism=RUNS[name].get("TURNSTREAM_GATE_MECHANISM", ""),
    )
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    prune(folder / "weights", record)
    return record


def prune(weights: Path, record: dict[str, Any]) -> None:
    """Keep only the best version's weights (what ``--start-from`` copies): a run keeps every version and its
    checkpoints (about 7 GB to v12 with SmolLM2), which filled this machine's disk after five runs."""
    scored = [e for e in record["evals"] if e["version"]]
    best = max(scored, key=lambda e: (e["scores"].get(PERSONA, 0.0), -e["version"]), default=None)
    keep = weights / "versions" / f"v{best['version']}" if best else None
    for path in weights.glob("*"):
        if path.is_dir() and path.name == "versions" and keep is not None:
            for version in path.iterdir():
                if version != keep:
                    shutil.rmtree(version, ignore_errors=True)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


async def read_run(env: dict[str, str]) -> dict[str, Any]:
    config = load_config(env=env)
    evals = [
        {"version": e.version, "scores": e.scores, "mean_words": e.mean_words, "evaluated_at": e.evaluated_at}
        async for r in read_topic(config.kafka, EVALS)
        if (e := r.event).question_set.startswith("heldout")
    ]
    decisions = [
        {"version": d.version, "state": d.state, "by": d.by, "reason": d.reason, "decided_at": d.decided_at}
        async for r in read_topic(config.kafka, VERSIONS)
        if (d := r.event)
    ]
    published = [
        {"version": w.version, "created_at": w.created_at}
        async for r in read_topic(config.kafka, WEIGHTS)
        if (w := r.event)
    ]
    turns = [
        [t.weight_version, t.completed_at]
        async for r in read_topic(config.kafka, TURNS)
        if isinstance(t := r.event, Turn)
    ]
    return {"evals": evals, "decisions": decisions, "published": published, "turns": turns}


async def find_namespace(name: str, record: dict[str, Any]) -> str:
    """The namespace of a run recorded before records named theirs: the run's topics whose first published
    version was made when the record's was."""
    from runtime.messaging.topics import list_topic_names

    config = load_config(env={**os.environ, **RUNS[name]})
    prefix = f"guarded-{name}-"
    spaces = {t.split(".")[0] for t in await list_topic_names(config.kafka) if t.startswith(prefix)}
    first = min(p["created_at"] for p in record["published"])
    for ns in sorted(s for s in spaces if len(s) == len(prefix) + 6):
        kafka = msgspec.structs.replace(config.kafka, namespace=ns)
        made = [r.event.created_at async for r in read_topic(kafka, WEIGHTS)]
        if made and abs(min(made) - first) < 1e-3:
            return ns
    raise LookupError(f"no namespace {prefix}* holds {name}'s versions")


async def reread_turns(name: str, record: dict[str, Any]) -> None:
    """Add the turns (which version answered each, when) to a record made before records held them."""
    ns = record.get("namespace") or await find_namespace(name, record)
    config = load_config(env={**os.environ, **RUNS[name], "TURNSTREAM_KAFKA_NAMESPACE": ns})
    record["namespace"] = ns
    record["turns"] = [
        [t.weight_version, t.completed_at]
        async for r in read_topic(config.kafka, TURNS)
        if isinstance(t := r.event, Turn)
    ]


def served(record: dict[str, Any]) -> list[dict[str, Any]]:
    """(from, version, score, how) for each stretch of time a version was served, in order."""
    scores = {e["version"]: e["scores"].get(PERSONA) for e in record["evals"]}
    if not record["decisions"]:  # no gate: each version as it was evaluated (the eval asks the served one)
        return [
            {
                "at": e["evaluated_at"],
                "version": e["version"],
                "score": e["scores"].get(PERSONA),
                "how": "served",
            }
            for e in sorted(record["evals"], key=lambda e: e["evaluated_at"])
        ]
    from schemas import VersionDecision

    out: list[dict[str, Any]] = []
    fold = Promotion()
    first = min(e["evaluated_at"] for e in record["evals"])
    out.append({"at": first, "version": 0, "score": scores.get(0), "how": "promoted"})
    for d in record["decisions"]:
        fold.apply(VersionDecision(**{k: d[k] for k in ("version", "state", "by", "reason", "decided_at")}))
        if (
            d["state"] == "candidate"
        ):  # serve-then-check: served while it is evaluated; adapter: evaluated beside
            evaluated = [e for e in record["evals"] if e["version"] == d["version"]]
            if evaluated:
                how = "beside" if record.get("mechanism") == "adapter" else "candidate"
                out.append({"at": d["decided_at"], "version": d["version"], "score": scores[d["version"]],
                            "how": how})  # fmt: skip
            continue
        if d["state"] in ("promoted", "rejected", "rolled_back", "pinned", "unpinned", "restored"):
            out.append({"at": d["decided_at"], "version": fold.serving, "score": scores.get(fold.serving),
                        "how": d["state"]})  # fmt: skip
    return out


def summary(record: dict[str, Any]) -> dict[str, Any]:
    timeline = served(record)
    scores = [
        t["score"] for t in timeline if t["score"] is not None and t["how"] != "beside"
    ]  # users met these
    promoted = [
        t["score"] for t in timeline if t["how"] not in ("candidate", "beside") and t["score"] is not None
    ]
    states: dict[str, int] = {}
    for d in record["decisions"]:
        states[d["state"]] = states.get(d["state"], 0) + 1
    times = sorted(p["created_at"] for p in record.get("published", []))
    start = next((e["scores"].get(PERSONA) for e in record["evals"] if e["version"] == 0), None)
    version_scores = {e["version"]: e["scores"].get(PERSONA) for e in record["evals"]}
    turns = record.get("turns", [])
    margin = float(RUNS["guarded"]["TURNSTREAM_GATE_MARGIN"])

    def share(pick: Any) -> float | None:
        return (
            round(sum(1 for v, _ in turns if pick(v)) / len(turns), 3)
            if turns and start is not None
            else None
        )

    return {
        "wall_min": round(record["wall_s"] / 60, 1),
        "turns": len(turns),
        # what users met: the share of their turns answered by a version whose held-out score had fallen more than
        # the margin below the starting version's (candidates served for their check included), and by versions
        # never evaluated (passed over for a newer one, or the run stopped first)
        "turns_by_worse_than_margin": share(
            lambda v: v in version_scores and (version_scores[v] or 0) < (start or 0) - margin
        ),
        "turns_by_unevaluated": share(lambda v: v not in version_scores),
        "steps_per_min": round(60 * (len(times) - 1) / (times[-1] - times[0]), 3) if len(times) > 1 else None,
        "versions_evaluated": len(record["evals"]),
        f"{PERSONA}_v0": start,
        f"{PERSONA}_served_last": scores[-1] if scores else None,
        f"{PERSONA}_served_min": min(scores, default=None),
        f"{PERSONA}_served_min_outside_checks": min(promoted, default=None),
        "decisions": states,
    }


def plot(records: dict[str, dict[str, Any]], image: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    colours = {"unguarded": "tab:red", "guarded": "tab:blue", "good": "tab:green", "good-gated": "tab:olive",
               "guarded-restore": "tab:purple",
               "guarded-restore-unpaced": "tab:orange", "unguarded-lora": "tab:brown",
               "guarded-adapter": "tab:cyan"}  # fmt: skip
    for name, record in records.items():
        timeline = served(record)
        if not timeline:
            continue
        t0 = timeline[0]["at"]
        steady = [t for t in timeline if t["how"] not in ("candidate", "beside") and t["score"] is not None]
        worse = summary(record)["turns_by_worse_than_margin"]
        share = "" if worse is None else f" ({100 * worse:.0f}% of turns by a version worse than the margin)"
        ax.step([(t["at"] - t0) / 60 for t in steady], [100 * t["score"] for t in steady], where="post",
                color=colours.get(name), label=f"{name}: served version{share}")  # fmt: skip
        tried = [t for t in timeline if t["how"] == "candidate"]
        if tried:
            ax.scatter([(t["at"] - t0) / 60 for t in tried], [100 * t["score"] for t in tried], marker="x",
                       color=colours.get(name), label=f"{name}: candidates (served during their check)")  # fmt: skip
        beside = [t for t in timeline if t["how"] == "beside"]
        if beside:
            ax.scatter([(t["at"] - t0) / 60 for t in beside], [100 * t["score"] for t in beside], marker="o",
                       facecolors="none", color=colours.get(name),
                       label=f"{name}: candidates (evaluated beside, never served)")  # fmt: skip
        restores = [t for t in timeline if t["how"] == "restored"]
        for t in restores:
            ax.axvline((t["at"] - t0) / 60, color=colours.get(name), linestyle=":", linewidth=1)
    ax.set_xlabel("minutes since the first evaluation")
    ax.set_ylabel(f"held-out {PERSONA} met (%)")
    ax.set_ylim(-5, 105)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8)
    bad = any(name.startswith(("unguarded", "guarded")) for name in records)
    ax.set_title(
        ("Inverted rewards (rl mode)" if bad else "The README's learning run")
        + ", SmolLM2 on the CPU: what users were served (dotted: trainer restores)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(image, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--until-version", type=int, default=16)
    ap.add_argument("--runs", default="unguarded,guarded", help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--out", default="bench/guarded_runs")
    ap.add_argument("--image", default="docs/images/guarded-vs-unguarded.png")
    ap.add_argument(
        "--start-from",
        default="",
        help="a finished run (e.g. good): start from its best version's weights instead of SmolLM2's; or a "
        "start folder made before (e.g. start-good-v7)",
    )
    ap.add_argument("--plot-only", action="store_true", help="read <out>/<run>.json instead of running")
    ap.add_argument(
        "--reread-turns",
        action="store_true",
        help="with --plot-only: add each record's turns from its topics (local Kafka keeps them) and save it",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = None
    if args.start_from and not args.plot_only:
        start, version, score = start_model(out, args.start_from)
        print(
            f"starting from {args.start_from}'s v{version} ({PERSONA} {score:.0%}): {start}", file=sys.stderr
        )
    records: dict[str, dict[str, Any]] = {}
    for name in args.runs.split(","):
        records[name] = (
            json.loads((out / f"{name}.json").read_text())
            if args.plot_only
            else run(name, args.until_version, out, start)
        )
    if args.reread_turns:
        for name, record in records.items():
            asyncio.run(reread_turns(name, record))
            (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(records, Path(args.image))
    print(json.dumps({name: summary(r) for name, r in records.items()}, indent=2))


if __name__ == "__main__":
    main()
