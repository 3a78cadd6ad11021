"""Run under torchrun (gloo on the CPU) by test_distributed.py, or in-process for the single-process baseline:
the policy's token log-probs on a fixed batch, then training steps on fixed samples (decoupled PPO, pi_old
recomputed and gathered across ranks, + reference KL + top-K distillation) with the distributed optimizer, then
the exported Hugging Face weights, and one more step both continued and resumed from the saved state. Rank 0
writes ``<out>``; the last pipeline stage's first rank writes ``<out>.logprobs``."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from runtime.configuration.config import LoraConfig, TrainerConfig
from schemas import Sample
from services.trainer.model import shutdown_parallel
from services.trainer.parallel import ParallelLayout

STEPS = 2


def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(4):
        prompt = torch.randint(1, 300, (4 + i,), generator=g).tolist()
        response = torch.randint(1, 300, (3 + 2 * i,), generator=g).tolist()
        n = len(response)
        old = (-torch.rand(n, generator=g) * 4 - 0.5).tolist()
        teacher = (-torch.rand(n, generator=g) * 4 - 0.1).tolist()
        topk_ids = [torch.randperm(300, generator=g)[:3].tolist() for _ in range(n)]
        topk_lp = [sorted((-torch.rand(3, generator=g) * 3 - 1.2).tolist(), reverse=True) for _ in range(n)]
        out.append(
            Sample(
                sample_id=f"s:{i}",
                session_id="s",
                mode="combine",
                kind="opd+rl",
                tokens=prompt + response,
                response_length=n,
                loss_mask=[1] * n,
                rollout_logprobs=old,
                reward=1.0 if i % 2 else -1.0,
                weight_version=0,
                created_at=time.time(),
                teacher_logprobs=teacher,
                topk_token_ids=topk_ids,
                topk_logprobs=topk_lp,
            )
        )
    return out


def config(tp: int, pp: int, distributed_optimizer: bool = True, lora: bool = False) -> TrainerConfig:
    return TrainerConfig(
        lora=LoraConfig(enabled=lora, rank=4, alpha=8.0),
        distributed_optimizer=distributed_optimizer,
        lr=1e-4,
        rollout_batch_size=4,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        micro_batch_tokens=24,  # several micro-batches per rank
        kl_coef=0.1,
        topk_coef=0.5,
        precision="fp32",
        # pi_old recomputed on each rank's share and gathered over every layout, the rollout's as the behaviour.
        old_logprobs="decoupled",
        # A plugin term reading the whole log-softmax: under TP it gathers the vocabulary slices.
        loss_terms=[
            "pg",
            "entropy",
            "kl",
            "topk",
            "tests.plugin_contracts.fixtures:full_distribution_entropy",
        ],
    )


def _saved(policy: Any) -> dict[str, Any]:
    """The state as a checkpoint file holds it: serialised, so nothing aliases the live buffers."""
    model_state, optimizer_state = policy.state()
    buffer = io.BytesIO()
    torch.save({"model": model_state, "optimizer": optimizer_state}, buffer)
    buffer.seek(0)
    state: dict[str, Any] = torch.load(buffer, weights_only=False)
    return state


def _unshard_reference(policy: Any) -> dict[str, torch.Tensor]:
    """The export as it was done before it streamed: every rank's whole state pickled to rank 0, then
    ``parallel.unshard``; the streamed export must equal it bit for bit."""
    from services.trainer.export import local_parameters
    from services.trainer.model import megatron_to_hf
    from services.trainer.parallel import unshard

    lay = policy.layout
    if policy.lora:
        return _gathered_adapter(policy)
    local = {k: v.detach().cpu() for k, v in local_parameters(policy.module).items()}
    if not lay.distributed:
        return megatron_to_hf(policy.spec, local)
    import torch.distributed as dist

    mine = ((lay.pp_rank, lay.tp_rank), local) if lay.dp_rank == 0 else (None, None)
    gathered: list[Any] | None = [None] * lay.world_size if lay.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return {}
    parts = {key: part for key, part in gathered if key is not None}
    return megatron_to_hf(policy.spec, unshard(parts, policy.spec, lay.tp, lay.pp))


def _gathered_adapter(policy: Any) -> dict[str, torch.Tensor]:
    """The adapter pickled to rank 0 and joined by hand (B of a column-parallel layer by rows, A of a row-parallel
    one by columns, the rest whole), under PEFT's names: the streamed export must equal it bit for bit."""
    from services.trainer.lora import adapter_state
    from services.trainer.parallel import stage_layers

    lay = policy.layout
    first = stage_layers(policy.spec.num_layers, lay.pp, lay.pp_rank).start
    local = {}
    for name, t in adapter_state(policy.module).items():
        _, _, index, rest = name.split(".", 3)  # decoder.layers.<i>.<path>.lora.pairs.<proj>.<A|B>
        local[f"{first + int(index)}.{rest}"] = t.detach().cpu()
    if lay.distributed:
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * lay.world_size if lay.rank == 0 else None
        dist.gather_object((lay.tp_rank, local) if lay.dp_rank == 0 else None, gathered, dst=0)
        if gathered is None:
            return {}
        parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for item in gathered:
            if item is not None:
                for k, t in item[1].items():
                    parts.setdefault(k, []).append((item[0], t))
    else:
        parts = {k: [(0, t)] for k, t in local.items()}
    out = {}
    for key, shards in parts.items():
        layer, path = key.split(".", 1)
        proj, which = path.split(".")[-2:]
        row = proj in ("o_proj", "down_proj")
        ordered = [t for _, t in sorted(shards, key=lambda p: p[0])]
        split = (row and which == "A") or (not row and which == "B")
        joined = torch.cat(ordered, dim=1 if row else 0) if split else ordered[0]
        module = ("self_attn." if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + proj
        out[f"base_model.model.model.layers.{layer}.{module}.lora_{which}.weight"] = joined
    from services.trainer.lora_export import adapter_tensors

    return {peft: out[peft] for _, peft, _ in adapter_tensors(policy.spec, policy.lora)}


def run(
    model: str,
    tp: int,
    pp: int,
    layout: ParallelLayout | None = None,
    distributed_optimizer: bool = True,
    lora: bool = False,
) -> dict[str, Any]:
    """``STEPS`` steps, then one more from this rank's saved state in a freshly built policy: a resume must
    give the step the running policy takes (``resumed_weights``)."""
    from services.trainer.policy import Policy
    from services.trainer.step import plan, reference_logprobs

    torch.manual_seed(0)
    settings = config(tp, pp, distributed_optimizer, lora)
    policy = Policy.from_hf(model, settings, layout)
    batch = samples()
    micro = plan(batch, 10_000, policy.settings, fixed=policy.layout.pp > 1)
    before = reference_logprobs(policy.model, micro, policy.forward, policy.vocab)
    stats = [policy.train(batch) for _ in range(STEPS)]
    weights = policy.export()
    reference = _unshard_reference(policy)
    saved = _saved(policy)
    policy.train(batch)
    continued = policy.export()
    resumed = Policy.from_hf(model, settings, layout)
    resumed.load_state(saved)
    resumed.train(batch)
    return {
        "logprobs": [t.detach().cpu() for t in before],
        "stats": stats,
        "weights": weights,
        "unshard_reference": reference,
        "continued_weights": continued,
        "resumed_weights": resumed.export(),
        "layout": policy.layout,
    }


def main() -> None:
    """``dist_check.py MODEL OUT SPEC...``, each SPEC ``tp,pp`` or ``tp,pp,lora``: one launch trains every layout
    in turn (a torchrun start, two ranks importing torch and Megatron, costs more than a layout's training), each
    written to ``OUT.<i>``. Between layouts only Megatron's groups are rebuilt; the process group stays."""
    from megatron.core import parallel_state

    from services.trainer.collective import barrier

    model, out, specs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    lay = None
    for i, spec in enumerate(specs):
        tp, pp, *flags = spec.split(",")
        layout = ParallelLayout.from_env(int(tp), int(pp))
        result = run(model, int(tp), int(pp), layout, lora=flags == ["lora"])
        lay = result["layout"]
        if lay.rank == 0:
            keys = ("weights", "unshard_reference", "continued_weights", "resumed_weights")
            stats = [msgspec.to_builtins(s) for s in result["stats"]]
            torch.save({"stats": stats, **{k: result[k] for k in keys}}, f"{out}.{i}")
        if lay.last_stage and lay.tp_rank == 0 and lay.dp_rank == 0:
            torch.save(result["logprobs"], f"{out}.{i}.logprobs")
        barrier(lay)  # every rank done with this layout's groups before they go
        parallel_state.destroy_model_parallel()
    if lay is not None:
        shutdown_parallel(lay)


if __name__ == "__main__":
    main()
