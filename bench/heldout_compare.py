"""Held-out curves of several learning runs side by side (each run's ``<run_dir>/heldout.json``, written by
``turnstream run``), one panel per persona; prints per run the first, last, best and mean score after v0 (JSON).

    .venv/bin/python bench/heldout_compare.py "full, lr 5e-5=bench/learning_runs/full-lr5e-5.json" \\
        "LoRA, lr 2e-4=bench/learning_runs/lora-r16-lr2e-4.json" --out docs/images/learning-run-lora-vs-full.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summary(rows: list[dict[str, object]], persona: str) -> dict[str, object]:
    scores = {int(r["version"]): 100 * float(r["scores"][persona]) for r in rows}  # type: ignore[index,call-overload]
    after = [s for v, s in scores.items() if v > 0]
    last = max(scores)
    return {
        "versions_evaluated": len(scores),
        "v0": scores.get(0),
        f"v{last}": scores[last],
        "best": max(after, default=None),
        "mean_after_v0": round(statistics.mean(after), 1) if after else None,
        "first_version_at_80": next((v for v in sorted(scores) if v > 0 and scores[v] >= 80), None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="name=path/to/heldout.json")
    ap.add_argument("--out", help="PNG to write")
    args = ap.parse_args()
    runs = {name: json.loads(Path(path).read_text()) for name, path in (r.split("=", 1) for r in args.runs)}
    personas = sorted({p for rows in runs.values() for r in rows for p in r["scores"]})
    print(
        json.dumps({name: {p: summary(rows, p) for p in personas} for name, rows in runs.items()}, indent=2)
    )
    if not args.out:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(personas), figsize=(6 * len(personas), 4), sharey=True, squeeze=False)
    for ax, persona in zip(axes[0], personas, strict=True):
        for name, rows in runs.items():
            xs = [r["version"] for r in rows]
            ax.plot(xs, [100 * r["scores"][persona] for r in rows], marker="o", markersize=3, label=name)
        ax.set_title(f"held-out: {persona}")
        ax.set_xlabel("policy weight version")
        ax.set_ylim(-5, 105)
        ax.legend(loc="best", fontsize=8)
    axes[0][0].set_ylabel("preference met (%)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
