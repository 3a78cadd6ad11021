"""The trainer's host memory per step, at another git revision and in the working tree, in one run. Prints JSON.

    .venv/bin/python bench/trainer_memory.py [--base HEAD|none] [--steps 6] [--samples 8] [--min-len 150]
        [--max-len 900] [--micro-batch-tokens 8192] [--topk 0] [--mode rl] [--tp 1]

Both sides train the SmolLM2-135M policy (Megatron-core on the CPU, one thread) on the same batches, each in a
process of its own (the base checked out into a temporary git worktree): every step draws a new set of sample
lengths, as live traffic does, so allocator growth from varying shapes shows. Per step: the peak resident set
(VmHWM, reset before the step through /proc/self/clear_refs), the resident set after it, and the step's seconds;
a side the OOM killer stops reports the steps it finished. The ratios are over the steps both sides finished.
``--topk K`` gives every sample the teacher's top-K at each response position (the top-K term's memory);
``--mode opd`` gives them teacher log-probs instead of rewards. ``--tp 2``: each side runs under torchrun with
tensor parallelism over gloo, and reports each rank's figures (``ranks``; the top-level ones are rank 0's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

STEPS = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from schemas import Sample
from runtime.configuration.config import TrainerConfig
from runtime.engine.model_store import fetch_smollm2
from services.trainer.parallel import ParallelLayout
from services.trainer.policy import Policy

a = json.loads(sys.argv[1])
rank = int(os.environ.get("RANK", "0"))

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024 / 1024  # GiB
    raise KeyError(field)

def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i in range(a["samples"]):
        n = int(torch.randint(a["min_len"], a["max_len"] + 1, (1,), generator=g))
        r = max(1, n // 2)
        tokens = torch.randint(10, 40000, (n,), generator=g).tolist()
        extra = {}
        if a["mode"] == "opd":
            extra["teacher_logprobs"] = (-torch.rand(r, generator=g) * 4).tolist()
        if a["topk"]:
            extra["topk_token_ids"] = torch.randint(10, 40000, (r, a["topk"]), generator=g).tolist()
            extra["topk_logprobs"] = (-torch.rand(r, a["topk"], generator=g) * 8).sort(-1, True).values.tolist()
        out.append(Sample(sample_id=f"m:{step}:{i}", session_id="m", mode=a["mode"], kind=a["mode"],
            tokens=tokens, response_length=r, loss_mask=[1] * r,
            rollout_logprobs=(-torch.rand(r, generator=g) * 4).tolist(),
            reward=(1.0 if i % 2 else -1.0) if a["mode"] == "rl" else 0.0,
            weight_version=0, created_at=time.time(), **extra))
    return out

config = TrainerConfig(micro_batch_tokens=a["micro_batch_tokens"], topk_coef=1.0 if a["topk"] else 0.0,
    **a.get("set", {}))
layout = ParallelLayout.from_env(a.get("tp", 1)) if a.get("tp", 1) > 1 else None
policy = Policy.from_hf(fetch_smollm2(log=False), config, layout)
rows = [{"step": "loaded", "rss_gib": round(status("VmRSS"), 2)}]
for step in range(a["steps"]):
    samples = batch(step)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    stats = policy.train(samples)
    seconds = time.perf_counter() - t0
    rows.append({"step": step, "tokens": sum(len(s.tokens) for s in samples),
        "peak_gib": round(status("VmHWM"), 2), "rss_after_gib": round(status("VmRSS"), 2),
        "seconds": round(seconds, 2), "loss": round(stats.loss, 6), "grad_norm": round(stats.grad_norm, 6)})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    with open(os.path.join(a["out"], f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
if layout is not None:
    from services.trainer.model import shutdown_parallel
    shutdown_parallel(policy.layout)
"""


def measure(root: Path, args: dict[str, object]) -> dict[str, Any]:
    """The steps one side took, per rank; a side the kernel's OOM killer stopped reports the steps it finished
    and ``killed``."""
    tp = int(str(args.get("tp", 1)))
    with tempfile.TemporaryDirectory() as out:
        script = Path(out) / "steps.py"
        script.write_text(STEPS)
        launcher = [sys.executable]
        if tp > 1:
            launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={tp}", "--master-port=29617"]
        proc = subprocess.run(
            [*launcher, str(script), json.dumps({**args, "out": out})],
            cwd=root,
            env={
                "OMP_NUM_THREADS": "1",
                "PATH": "/usr/bin:/bin",
                "HOME": str(Path.home()),
                "PYTHONPATH": str(root),
            },
            capture_output=True,
            text=True,
        )
        ranks = []
        for r in range(tp):
            found = Path(out) / f"rank{r}.json"
            ranks.append(json.loads(found.read_text()) if found.exists() else [])
    killed = proc.returncode != 0
    if killed and not any(ranks) and "Killed" not in proc.stderr and proc.returncode != -9:
        raise SystemExit(f"{root}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    sides = [_summary([r for r in rows if r["step"] != "loaded"], killed) for rows in ranks]
    return {**sides[0], "ranks": sides[1:]} if tp > 1 else sides[0]


def _summary(steps: list[dict[str, Any]], killed: bool) -> dict[str, Any]:
    if not steps:
        return {"killed": killed, "steps_done": 0, "steps": []}
    return {
        "killed": killed,
        "steps_done": len(steps),
        "max_peak_gib": max(float(r["peak_gib"]) for r in steps),
        "max_rss_after_gib": max(float(r["rss_after_gib"]) for r in steps),
        "mean_step_s": round(sum(float(r["seconds"]) for r in steps) / len(steps), 2),
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=150)
    ap.add_argument("--max-len", type=int, default=900)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=0)
    ap.add_argument("--mode", choices=["rl", "opd"], default="rl")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks under torchrun (gloo)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="a trainer setting for the working tree only (e.g. recompute='\"full\"')",
    )
    args = ap.parse_args()
    settings: dict[str, object] = {
        "steps": args.steps,
        "samples": args.samples,
        "min_len": args.min_len,
        "max_len": args.max_len,
        "micro_batch_tokens": args.micro_batch_tokens,
        "topk": args.topk,
        "mode": args.mode,
        "tp": args.tp,
    }
    overrides = {k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}
    ours = measure(REPO, {**settings, "set": overrides})
    if args.base == "none":  # the working tree alone, for exploring settings
        print(json.dumps({"settings": settings, "working_tree": {"set": overrides, **ours}}, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", str(worktree), args.base], cwd=REPO, check=True
        )
        try:
            base = measure(worktree, settings)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    # over the steps both sides finished (the same batches)
    n = min(base["steps_done"], ours["steps_done"])
    peak = [max(float(r["peak_gib"]) for r in side["steps"][:n]) for side in (base, ours)]
    secs = [sum(float(r["seconds"]) for r in side["steps"][:n]) for side in (base, ours)]
    print(
        json.dumps(
            {
                "settings": settings,
                "base": {"revision": args.base, **base},
                "working_tree": {"set": overrides, **ours},
                "common_steps": n,
                "peak_ratio_working_over_base": round(peak[1] / peak[0], 3),
                "step_time_ratio_working_over_base": round(secs[1] / secs[0], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
