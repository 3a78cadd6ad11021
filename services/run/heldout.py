"""The run's held-out learning curve: every ``EvalResult`` on ``evals`` as ``<run_dir>/heldout.json`` and
``heldout.png``, written when ``turnstream run`` stops (and by ``--until-version``'s clean stop)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from runtime.configuration.config import Config
from runtime.messaging.bus import read_topic
from schemas import EvalResult
from schemas.topics import EVALS


async def heldout_results(config: Config) -> list[EvalResult]:
    """One result per version (the latest written, should a question set change), oldest version first."""
    by_version = {r.event.version: r.event async for r in read_topic(config.kafka, EVALS)}
    return [by_version[v] for v in sorted(by_version)]


def plot(results: list[EvalResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xs = [r.version for r in results]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name in sorted({p for r in results for p in r.scores}):
        top.plot(xs, [100 * r.scores.get(name, float("nan")) for r in results], marker="o", label=name)
    top.set_ylabel("held-out preference met (%)")
    top.set_ylim(-5, 105)
    top.legend(loc="best", fontsize=8)
    bottom.plot(xs, [r.mean_words for r in results], marker="o", color="tab:red")
    bottom.set_ylabel("mean words per answer")
    bottom.set_xlabel("policy weight version")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    n = len(results[0].answers) if results else 0
    fig.suptitle(f"turnstream held-out evaluation: {n} questions per version, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def write_heldout(config: Config, run_dir: Path) -> list[EvalResult]:
    results = await heldout_results(config)
    if results:
        rows = [
            {
                "version": r.version,
                "scores": r.scores,
                "mean_words": r.mean_words,
                "question_set": r.question_set,
            }
            for r in results
        ]
        (run_dir / "heldout.json").write_text(json.dumps(rows, indent=1) + "\n")
        await asyncio.to_thread(plot, results, run_dir / "heldout.png")
    return results
