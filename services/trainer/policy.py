"""The trainable policy: a Megatron-core GPTModel loaded from Hugging Face weights, wrapped in Megatron's
DistributedDataParallel with Megatron's optimizer (Adam, constant learning rate, gradient clipping)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.config import TrainerConfig
from services.trainer.cpu_shim import cpu_allocations
from services.trainer.model import (
    ModelSpec,
    build_model,
    export_hf,
    forward_logits,
    init_single_process,
    load_hf_into,
    read_hf_weights,
)


class Policy:
    def __init__(self, spec: ModelSpec, module: Any, ddp: Any, optimizer: Any, config: TrainerConfig) -> None:
        self.spec = spec
        self.module = module
        self.model = ddp
        self.optimizer = optimizer
        self.config = config

    @classmethod
    def from_hf(cls, path: str | Path, config: TrainerConfig, dtype: torch.dtype = torch.float32) -> Policy:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        init_single_process()
        spec = ModelSpec.from_dir(path)
        module = build_model(spec, dtype)
        load_hf_into(module, spec, read_hf_weights(path))
        ddp = DistributedDataParallel(
            module.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            module,
        )
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2,
            clip_grad=config.clip_grad,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=False,
        )
        with cpu_allocations():
            optimizer = get_megatron_optimizer(opt_config, [ddp])
        return cls(spec, module, ddp, optimizer, config)

    @staticmethod
    def forward(model: Any, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return forward_logits(model, tokens, attention_mask)

    def export(self) -> dict[str, torch.Tensor]:
        return export_hf(self.module, self.spec)
