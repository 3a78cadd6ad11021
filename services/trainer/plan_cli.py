"""``turnstream trainer plan``: the memory plan of ``memory.py`` for a model on N GPUs, as a table (or JSON):
the layout asked for, or the one proposed, and what else would fit."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from runtime.configuration.config import Config, reference_copy
from services.trainer.memory import GIB, MemoryPlan, PlanInput, layouts, plan, propose, total_params
from services.trainer.spec import ModelSpec


def _spec(path: str) -> ModelSpec:
    p = Path(path)
    config = p if p.is_file() else p / "config.json"
    return ModelSpec.from_hf(json.loads(config.read_text()))


def _table(p: MemoryPlan, gpu_gib: float) -> str:
    lines = [f"  {name:<12}{gib:>8.1f} GiB" for name, gib in p.rows()]
    verdict = "fits" if p.total <= gpu_gib * GIB else "does NOT fit"
    lines[-1] += f"   ({verdict} {gpu_gib:.0f} GiB)"
    return "\n".join(lines)


def _head(lay: PlanInput) -> str:
    return (
        f"TP {lay.tp} x PP {lay.pp} x DP {lay.dp}, recompute {lay.recompute}, "
        f"distributed optimizer {'on' if lay.distributed_optimizer else 'off'}"
    )


def run_plan(config: Config, args: argparse.Namespace) -> int:
    """0 when the planned (or a proposed) layout fits, 1 when none does, 2 on bad input."""
    tc = config.trainer
    lora = tc.lora.enabled or args.lora
    path = args.hf_checkpoint or tc.hf_checkpoint
    if not path:
        print(
            "turnstream trainer plan: give --hf-checkpoint (a Hugging Face folder or config.json)",
            file=sys.stderr,
        )
        return 2
    try:
        spec = _spec(path)
    except (OSError, ValueError, KeyError) as exc:
        print(f"turnstream trainer plan: {path}: {exc}", file=sys.stderr)
        return 2
    recompute = args.recompute or ("selective" if tc.recompute == "auto" else tc.recompute)
    base = PlanInput(
        micro_batch_tokens=args.micro_batch_tokens or tc.micro_batch_tokens,
        seq_len=args.seq_len or 0,
        recompute=recompute,
        dtype_bytes=4 if args.fp32 else 2,
        reference=reference_copy(
            tc.kl_coef > 0 if args.kl is None else args.kl, lora, tc.reference_checkpoint
        ),
        attention=args.attention,
        max_sample_tokens=args.max_sample_tokens or tc.max_sample_tokens,
        lora_rank=tc.lora.rank if lora else 0,
        lora_targets=tuple(tc.lora.target_modules) if lora else (),
    )
    gpus, gpu_gib = args.gpus, args.gpu_memory_gib
    asked = args.tp is not None or args.pp is not None
    if asked:
        tp, pp = args.tp or 1, args.pp or 1
        if gpus % (tp * pp):
            print(
                f"turnstream trainer plan: {gpus} GPUs do not split into TP {tp} x PP {pp}", file=sys.stderr
            )
            return 2
        dp = gpus // (tp * pp)
        chosen: MemoryPlan | None = plan(
            spec, msgspec.structs.replace(base, tp=tp, pp=pp, dp=dp, distributed_optimizer=dp > 1)
        )
    else:
        chosen = propose(spec, gpus, gpu_gib, base)
    fitting = sorted(
        (p for lay in layouts(spec, gpus, base) if (p := plan(spec, lay)).total <= gpu_gib * GIB),
        key=lambda p: p.total,
    )
    if args.json:
        out = {
            "model": {"path": path, "params": total_params(spec), **msgspec.to_builtins(spec)},
            "gpus": gpus,
            "gpu_memory_gib": gpu_gib,
            "plan": _as_json(chosen),
            "fitting": [_as_json(p) for p in fitting],
        }
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{path}: {spec.family}, {total_params(spec) / 1e9:.2f} B parameters; {gpus} GPU(s) of "
            f"{gpu_gib:.0f} GiB; {base.micro_batch_tokens} tokens per micro-batch, samples up to "
            f"{max(base.max_sample_tokens, base.micro_batch_tokens)} tokens, {base.attention} attention, "
            f"{'fp32' if args.fp32 else 'bf16'}{', reference model' if base.reference else ''}"
            f"{f', LoRA rank {base.lora_rank}' if base.lora_rank else ''}"
        )
        if chosen is None:
            print("no layout fits: more GPUs, a smaller micro-batch budget, or LoRA")
        else:
            print(("planned: " if asked else "proposed: ") + _head(chosen.layout) + ", per GPU:")
            print(_table(chosen, gpu_gib))
        others = [p for p in fitting if chosen is None or p.layout != chosen.layout]
        if others:
            print("other layouts that fit (least memory first):")
            for p in others[:8]:
                print(f"  {_head(p.layout)}: {p.total / GIB:.1f} GiB")
    return 0 if chosen is not None and chosen.total <= gpu_gib * GIB else 1


def _as_json(p: MemoryPlan | None) -> dict[str, object] | None:
    if p is None:
        return None
    return {
        "layout": msgspec.to_builtins(p.layout),
        "params_per_gpu": p.params,
        "trainable_per_gpu": p.trainable,
        "gib": {name: round(gib, 3) for name, gib in p.rows()},
    }
