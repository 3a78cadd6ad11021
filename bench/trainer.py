"""Trainer speed on the CPU, side by side with a plain PyTorch baseline, in one run. Prints JSON.

    .venv/bin/python bench/trainer.py [--batch 16] [--prompt 48] [--response 32] [--steps 3] [--recompute auto]

Both take the same optimizer steps on the same SmolLM2 batch (PPO loss of services/trainer/loss.py): turnstream's
Megatron-core policy (DDP + Megatron's optimizer, the CPU shim) against transformers' model with torch.optim.AdamW.
Then: the time to export a version (HF safetensors, written atomically) and for the CPU engine to load it with
/update_weights_from_disk.

    .venv/bin/python bench/trainer.py --lora [--model smollm2|qwen3-1b|both] [--batch 4] [--prompt 48] [--response 32]

LoRA (trainer.lora's defaults: rank 16, alpha 32, seven projections) against full fine-tuning, side by side on the
same batch, per model: step time, trainable parameters, gradient buffers and Adam's state (bytes actually held),
and the published version's size on disk; then, on SmolLM2, publish -> served: the version written, then loaded
by one SGLang server started with --enable-lora (an adapter with /load_lora_adapter, full weights with
/update_weights_from_disk). ``qwen3-1b`` is bench/trainer_export.py's random ~1.1B Qwen3 (fp32 on the CPU: full
fine-tuning needs ~18 GB and more than a 24 GB machine has free; ``--only lora`` measures LoRA alone).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import torch

from runtime.configuration.config import TrainerConfig
from runtime.engine.model_store import fetch_smollm2
from schemas import Sample
from services.engine.launch import EngineProcess
from services.trainer.checkpoints import TrainerStore
from services.trainer.loss import batch_mean, ppo_clip_loss
from services.trainer.policy import Policy
from services.trainer.step import collate, token_logprobs, train_step


def make_batch(n: int, prompt: int, response: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tokens = torch.randint(10, 40000, (prompt + response,), generator=g).tolist()
        out.append(
            Sample(
                sample_id=f"b:{i + 1}",
                session_id="b",
                mode="rl",
                kind="rl",
                tokens=tokens,
                response_length=response,
                loss_mask=[1] * response,
                rollout_logprobs=[-8.0] * response,
                reward=1.0 if i % 2 else -1.0,
                weight_version=0,
                created_at=time.time(),
            )
        )
    return out


def baseline_step(model: torch.nn.Module, opt: torch.optim.Optimizer, samples: list[Sample]) -> None:
    c = collate(samples)
    opt.zero_grad()
    logits = model(c.tokens, attention_mask=c.attention_mask).logits
    loss, _ = ppo_clip_loss(token_logprobs(logits, c.tokens), c.old_logprobs, c.advantages)
    batch_mean(loss, c.loss_mask).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def run_baseline(path: Path, samples: list[Sample], steps: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.98), weight_decay=0.1)
    return timed(lambda: baseline_step(hf, opt, samples), steps)


def timed(fn, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _held_bytes(obj: object) -> int:
    """Bytes of every tensor in a (nested) state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_held_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_held_bytes(v) for v in obj)
    return 0


def lora_side_by_side(
    path: Path, samples: list[Sample], steps: int, recompute: str, work: Path, modes: tuple[str, ...]
) -> dict[str, dict]:
    import gc

    from runtime.configuration.config import LoraConfig
    from services.trainer.optimizer_state import optimizer_state

    out: dict[str, dict] = {}
    for mode in modes:
        config = TrainerConfig(recompute=recompute, lora=LoraConfig(enabled=mode == "lora"))
        policy = Policy.from_hf(path, config)
        times = timed(functools.partial(policy.train, samples), steps)
        params = list(policy.module.parameters())
        store = TrainerStore(work / mode)
        t0 = time.perf_counter()
        folder, _ = store.write_version(1, policy.entries(), policy.hf_stream(), path, policy.version_files())
        export_s = time.perf_counter() - t0
        out[mode] = {
            "step_s": round(statistics.median(times), 3),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "grad_buffer_mib": round(
                sum(p.main_grad.numel() * 4 for p in params if hasattr(p, "main_grad")) / 2**20, 2
            ),
            "optimizer_state_mib": round(_held_bytes(optimizer_state(policy.optimizer)) / 2**20, 2),
            "version_mib": round(sum(f.stat().st_size for f in folder.iterdir()) / 2**20, 2),
            "export_s": round(export_s, 3),
            "version": str(folder),
        }
        del policy, params
        gc.collect()
    if len(out) < 2:
        return out
    full, lora = out["full"], out["lora"]
    out["ratios_lora_over_full"] = {
        key: round(lora[key] / full[key], 5)
        for key in ("step_s", "trainable_params", "grad_buffer_mib", "optimizer_state_mib", "version_mib")
    }
    return out


def publish_to_served(path: Path, full: str, adapter: str) -> dict[str, float]:
    """One SGLang server with --enable-lora: seconds from a version on disk to the engine serving it."""
    engine = EngineProcess(path, "--lora")
    try:
        t0 = time.perf_counter()
        r = httpx.post(
            engine.url + "/load_lora_adapter", json={"lora_name": "v1", "lora_path": adapter}, timeout=300
        )
        adapter_s = time.perf_counter() - t0
        assert r.status_code == 200 and r.json().get("success"), r.text
        t0 = time.perf_counter()
        r = httpx.post(
            engine.url + "/update_weights_from_disk",
            json={"model_path": full, "weight_version": "1"},
            timeout=600,
        )
        full_s = time.perf_counter() - t0
        assert r.status_code == 200 and r.json().get("success"), r.text
    finally:
        engine.stop()
    return {"adapter_load_s": round(adapter_s, 3), "full_weights_load_s": round(full_s, 3)}


def lora_main(args: argparse.Namespace) -> None:
    from trainer_export import qwen3_1b

    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = {"smollm2": fetch_smollm2(log=False)} if args.model in ("smollm2", "both") else {}
        if args.model in ("qwen3-1b", "both"):
            models["qwen3-1b"] = qwen3_1b(work / "qwen3-1b-model")
        samples = make_batch(args.batch, args.prompt, args.response)
        for name, path in models.items():
            modes = ("full", "lora") if args.only == "both" else (args.only,)
            figures = lora_side_by_side(path, samples, args.steps, args.recompute, work / name, modes)
            if name == "smollm2" and len(modes) == 2:
                served = publish_to_served(path, figures["full"]["version"], figures["lora"]["version"])
                for mode in ("full", "lora"):
                    load = served["full_weights_load_s" if mode == "full" else "adapter_load_s"]
                    figures[mode]["engine_load_s"] = load
                    figures[mode]["publish_to_served_s"] = round(figures[mode]["export_s"] + load, 3)
                figures["ratios_lora_over_full"]["publish_to_served_s"] = round(
                    figures["lora"]["publish_to_served_s"] / figures["full"]["publish_to_served_s"], 4
                )
            for mode in modes:
                figures[mode].pop("version")
            results[name] = figures
    results["batch"] = {"samples": args.batch, "tokens": args.batch * (args.prompt + args.response)}
    print(json.dumps(results, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", default="auto", choices=["auto", "none", "selective", "full"])
    ap.add_argument(
        "--lora", action="store_true", help="LoRA against full fine-tuning (see the module's text)"
    )
    ap.add_argument("--model", choices=["smollm2", "qwen3-1b", "both"], default="both", help="with --lora")
    ap.add_argument(
        "--only",
        choices=["full", "lora", "both"],
        default="both",
        help="with --lora: one side (memory permitting)",
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.lora:
        lora_main(args)
        return
    path = fetch_smollm2(log=False)
    samples = make_batch(args.batch, args.prompt, args.response)
    tokens = args.batch * (args.prompt + args.response)

    base = run_baseline(path, samples, args.steps)

    policy = Policy.from_hf(path, TrainerConfig(recompute=args.recompute))
    ours = timed(
        lambda: train_step(policy.model, policy.optimizer, samples, forward=policy.forward), args.steps
    )

    with tempfile.TemporaryDirectory() as tmp:
        store = TrainerStore(tmp)
        t0 = time.perf_counter()
        version_path, _ = store.write_version(1, policy.entries(), policy.hf_stream(), path)
        export_s = time.perf_counter() - t0
        engine = EngineProcess(path)
        try:
            t0 = time.perf_counter()
            r = httpx.post(
                engine.url + "/update_weights_from_disk",
                json={"model_path": str(version_path), "weight_version": "1"},
                timeout=300,
            )
            load_s = time.perf_counter() - t0
            assert r.status_code == 200 and r.json().get("success"), r.text
        finally:
            engine.stop()

    b, o = statistics.median(base), statistics.median(ours)
    print(
        json.dumps(
            {
                "batch": {
                    "samples": args.batch,
                    "tokens": tokens,
                    "response_tokens": args.batch * args.response,
                },
                "baseline_transformers_adamw": {"step_s": round(b, 3), "tokens_per_s": round(tokens / b, 1)},
                "turnstream_megatron": {"step_s": round(o, 3), "tokens_per_s": round(tokens / o, 1)},
                "recompute": args.recompute,
                "step_time_ratio_megatron_over_baseline": round(o / b, 3),
                "export_version_s": round(export_s, 3),
                "engine_load_version_s": round(load_s, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
