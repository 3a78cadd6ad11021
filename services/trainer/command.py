"""``turnstream trainer`` and ``turnstream trainer plan``."""

from __future__ import annotations

import argparse

from runtime.configuration.config import Config
from runtime.process.commands import Subparsers, command, worker

_TRAIN = worker("trainer", ("hf_checkpoint", "max_steps"), "services.trainer.worker:run_trainer")


def register(sub: Subparsers) -> None:
    trainer = command(sub, "trainer", "trains the policy on samples and publishes weight versions", run)
    trainer.add_argument(
        "--hf-checkpoint", help="the policy's Hugging Face folder (default: trainer.hf_checkpoint)"
    )
    trainer.add_argument(
        "--max-steps", type=int, help="stop after this many steps (default: trainer.max_steps)"
    )
    _plan(trainer.add_subparsers(dest="trainer_command"))


def run(config: Config, args: argparse.Namespace) -> int:
    if args.trainer_command == "plan":
        from services.trainer.plan_cli import run_plan

        return run_plan(config, args)
    return _TRAIN(config, args)


def _plan(sub: Subparsers) -> None:
    plan = sub.add_parser(
        "plan", help="the trainer's memory per GPU for a model and layout, and a layout that fits"
    )
    plan.add_argument("--hf-checkpoint", help="folder (or its config.json) (default: trainer.hf_checkpoint)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs the trainer gets (default 1)")
    plan.add_argument("--gpu-memory-gib", type=float, default=140.0, help="per GPU (default 140: an H200)")
    plan.add_argument("--tp", type=int, help="plan this tensor-parallel size (default: propose a layout)")
    plan.add_argument("--pp", type=int, help="plan this pipeline-parallel size (default: propose a layout)")
    plan.add_argument("--micro-batch-tokens", type=int, help="default: trainer.micro_batch_tokens")
    plan.add_argument("--seq-len", type=int, help="longest sample (default: the micro-batch budget)")
    plan.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        help="default: trainer.recompute (auto: selective)",
    )
    plan.add_argument(
        "--max-sample-tokens",
        type=int,
        help="the longest sample trained (default: trainer.max_sample_tokens)",
    )
    plan.add_argument(
        "--attention",
        choices=["sdpa", "te", "local"],
        default="sdpa",
        help="sdpa: torch's flash kernels in Megatron's layer (the runtime image's; default); te: Transformer "
        "Engine's fused attention (the te image's); local: Megatron's own, s x s probabilities per layer",
    )
    plan.add_argument("--fp32", action="store_true", help="fp32 weights (default bf16, as on GPUs)")
    plan.add_argument(
        "--kl",
        action="store_true",
        default=None,
        help="with the KL term (default: kl_coef > 0); its reference is a second model, except under LoRA "
        "without trainer.reference_checkpoint (the base with the adapters off)",
    )
    plan.add_argument(
        "--lora",
        action="store_true",
        help="LoRA adapters (rank, targets: trainer.lora; default: trainer.lora.enabled)",
    )
    plan.add_argument("--json", action="store_true", help="the plans as JSON")
