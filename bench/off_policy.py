"""Which pi_old learns best: the CPU learning run once per ``trainer.old_logprobs``, same simulated users (same
seed), one after another. Prints JSON.

    .venv/bin/python bench/off_policy.py [--options rollout,recompute,decoupled] [--steps 12] [--users 3]

Each run is ``turnstream run --simulate USERS`` (SmolLM2 on SGLang, the rules judge, combine mode, batches of 8, lr
5e-5: docs/simulated-users.md, "The learning run") in a namespace of its own, stopped once the trainer has taken
``--steps`` steps. Reported per option: what the simulated users saw at the starting weights and at the last versions
(preference met, words per answer), and the trainer's figures per step (clip fraction, KL from the sampler, importance
weights, OPD gap). A run takes about 10 minutes of both cores; run nothing else meanwhile."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime.engine.model_store import cache_dir  # noqa: E402


def status(run_dir: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((run_dir / "status.json").read_text())
        return data
    except (OSError, ValueError):
        return {}


def step_figures(line: str) -> dict[str, Any]:
    """A trainer "step done" log line's figures, from the JSON format or the text one (``key=value``)."""
    if line.startswith("{"):
        data: dict[str, Any] = json.loads(line)
        return data
    figures: dict[str, Any] = {}
    for key, value in re.findall(r"(\w+)=([-\d.e]+|None)(?=\s|$)", line):
        figures[key] = None if value == "None" else float(value)
    return figures


def learn(option: str, steps: int, users: int, root: Path, timeout_s: float) -> dict[str, Any]:
    run_dir = root / option
    run_dir.mkdir(parents=True)
    name = f"offpolicy-{root.name}-{option}"
    env = {
        **os.environ,
        "TURNSTREAM_KAFKA_NAMESPACE": name,
        "TURNSTREAM_REDIS_KEY_PREFIX": f"{name}:",
        "TURNSTREAM_TRAINER_LR": "5e-5",
        "TURNSTREAM_TRAINER_ROLLOUT_BATCH_SIZE": "8",
        "TURNSTREAM_TRAINER_OLD_LOGPROBS": option,
        "TURNSTREAM_TRAINER_OUTPUT_DIR": str(run_dir / "weights"),
        "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(run_dir / "weights"),
        "TURNSTREAM_PROXY_SPOOL_DIR": str(run_dir / "spool"),
        "OMP_NUM_THREADS": "1",
    }
    started = time.monotonic()
    with open(run_dir / "run.out", "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "run",
                "--simulate",
                str(users),
                "--run-dir",
                str(run_dir),
            ],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            while status(run_dir).get("steps", 0) < steps:
                if proc.poll() is not None or time.monotonic() - started > timeout_s:
                    raise RuntimeError(f"{option}: the run stopped or took too long; see {run_dir}/run.out")
                time.sleep(5)
            time.sleep(35)  # the simulated users' report is rewritten every 30 s
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=180)
    summary = json.loads((run_dir / "simulation" / "summary.json").read_text())
    versions = summary["versions"]
    late = [v for v in versions if v["weight_version"] >= max(1, steps - steps // 3)]

    def seen(vs: list[dict[str, Any]]) -> dict[str, Any]:
        n = sum(v["responses"] for v in vs)
        if not n:
            return {"responses": 0}
        return {
            "responses": n,
            "preference_met": round(sum(v["satisfaction"] * v["responses"] for v in vs) / n, 3),
            "mean_words": round(sum(v["mean_words"] * v["responses"] for v in vs) / n, 1),
        }

    trained = [
        step_figures(line)
        for line in (run_dir / "trainer.log").read_text().splitlines()
        if "step done" in line
    ]

    def mean(key: str) -> float | None:
        values = [t[key] for t in trained if t.get(key) is not None]
        return round(statistics.fmean(values), 5) if values else None

    return {
        "minutes": round((time.monotonic() - started) / 60, 1),
        "steps": len(trained),
        "starting_weights": seen([v for v in versions if v["weight_version"] == 0]),
        f"versions_{max(1, steps - steps // 3)}_on": seen(late),
        "per_step_mean": {
            k: mean(k) for k in ("clip_fraction", "kl_rollout", "is_weight_mean", "is_truncated", "opd_gap")
        },
        "run_dir": str(run_dir),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--options", default="rollout,recompute,decoupled")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--timeout-min", type=float, default=40.0, help="per option")
    args = ap.parse_args()
    root = cache_dir() / "bench" / "off_policy" / time.strftime("%Y%m%d-%H%M%S")
    results = {
        option: learn(option, args.steps, args.users, root, args.timeout_min * 60)
        for option in args.options.split(",")
    }
    print(json.dumps({"steps": args.steps, "users": args.users, "results": results}, indent=2))


if __name__ == "__main__":
    main()
