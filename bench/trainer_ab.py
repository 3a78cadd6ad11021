"""Whether a change moves training: the same three steps at another git revision and in the working tree. Prints
JSON; ``identical`` is true when losses, gradient norms and the trained weights agree bit for bit.

    .venv/bin/python bench/trainer_ab.py [--base HEAD]

A refactor of the trainer, the loss or the advantages should leave training exactly where it was. Both sides
train a small random Llama (seed 0) on one fixed batch of every sample kind (rl, opd, combine's three), with the
entropy, reference-KL and top-K terms on and micro-batches of a few samples each, in a process of their own
(the base checked out into a temporary git worktree), and report each step's figures and a digest of the weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STEPS = r"""
import hashlib, json, sys, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
from schemas import Sample
try:
    from runtime.configuration.config import TrainerConfig
except ImportError:  # a base from before the runtime left services/
    from services.config import TrainerConfig
from services.trainer.policy import Policy

torch.manual_seed(0)
model = Path(sys.argv[1])
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
LlamaForCausalLM(config).save_pretrained(model)

def sample(i, mode, kind, reward, teacher=False, topk=False):
    g = torch.Generator().manual_seed(i)
    n = 3 + i % 4
    tokens = torch.randint(1, 500, (6 + n,), generator=g).tolist()
    old = (-torch.rand(n, generator=g) * 3).tolist()
    extra = {}
    if teacher:
        extra["teacher_logprobs"] = (-torch.rand(n, generator=g) * 3).tolist()
    if topk:
        extra["topk_token_ids"] = [[tokens[6 + k], 7] for k in range(n)]
        extra["topk_logprobs"] = [[-0.5, -1.5]] * n
    return Sample(sample_id=f"x{i}", session_id=f"s{i % 3}", mode=mode, kind=kind, tokens=tokens,
                  response_length=n, loss_mask=[1] * n, rollout_logprobs=old, reward=reward, weight_version=0,
                  created_at=0.0, **extra)

batch = [sample(0, "rl", "rl", 1.0), sample(1, "rl", "rl", -1.0), sample(2, "opd", "opd", 0.0, True, True),
         sample(3, "combine", "opd+rl", -1.0, True, True), sample(4, "combine", "opd-only", 0.0, True),
         sample(5, "combine", "rl-only", 1.0, True), sample(6, "rl", "rl", 0.0),
         sample(7, "combine", "opd+rl", 1.0, True)]
settings = TrainerConfig(lr=1e-3, rollout_batch_size=8, kl_coef=0.1, topk_coef=0.5, entropy_coef=0.01, w_rl=0.7,
                         w_opd=1.3, micro_batch_tokens=40)
policy = Policy.from_hf(model, settings)
steps = []
for _ in range(3):
    st = policy.train(batch)
    steps.append({k: getattr(st, k) for k in ("loss", "pg_loss", "clip_fraction", "entropy", "grad_norm", "kl",
                                               "kl_rollout", "topk_loss", "micro_batches")})
weights = policy.export()
digest = hashlib.sha256(b"".join(weights[k].numpy().tobytes() for k in sorted(weights))).hexdigest()
print(json.dumps({"steps": steps, "weights_sha256": digest}))
"""


def train(root: Path, scratch: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, str(scratch)],
        cwd=root,
        env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree against")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="turnstream-trainer-ab-"))
    worktree = scratch / "base"
    subprocess.run(
        ["git", "worktree", "add", "-q", "--detach", str(worktree), args.base], cwd=REPO, check=True
    )
    try:
        base = train(worktree, scratch / "model-base")
        work = train(REPO, scratch / "model-work")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    print(
        json.dumps(
            {"base": args.base, "identical": base == work, "base_run": base, "work_run": work}, indent=2
        )
    )


if __name__ == "__main__":
    main()
