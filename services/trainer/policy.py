"""The trainable policy on this rank: its part of a Megatron-core GPTModel loaded from Hugging Face weights,
wrapped in Megatron's DistributedDataParallel with Megatron's optimizer (Adam, constant learning rate, gradient
clipping), plus the frozen reference model when the KL term is on (under LoRA, the policy with its adapters off).

One process (the CPU, or one GPU) is the special case of the torchrun layout: world size 1, TP = PP = DP = 1.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from runtime.configuration.config import LoraConfig, TrainerConfig
from schemas import Sample
from services.trainer.checkpoints import FULL_WEIGHTS, VersionFiles, snapshot
from services.trainer.cpu_shim import cpu_allocations
from services.trainer.export import hf_entries, hf_stream, local_parameters
from services.trainer.hf_load import load_hf_into, safetensors_source
from services.trainer.logprobs import VocabShard
from services.trainer.model import build_model, forward_hidden, forward_logits, init_parallel
from services.trainer.optimizer_state import load_optimizer_state, optimizer_state
from services.trainer.parallel import ParallelLayout, dtype_for
from services.trainer.safetensors_stream import Entry
from services.trainer.spec import ModelSpec, padded_vocab
from services.trainer.step import StepStats, check_seams, train_step

log = logging.getLogger("turnstream.trainer")


def _load(
    spec: ModelSpec,
    path: str | Path,
    dtype: torch.dtype,
    layout: ParallelLayout,
    recompute: str = "none",
    layer_spec: str = "auto",
) -> Any:
    module = build_model(spec, dtype, layout, recompute, initialise=False, layer_spec=layer_spec)
    with safetensors_source(path) as source:  # this rank's slices only
        load_hf_into(module, spec, source, layout)
    if torch.cuda.is_available():
        module.cuda(torch.cuda.current_device())
    return module


def check_memory(spec: ModelSpec, config: TrainerConfig, layout: ParallelLayout, dtype: torch.dtype) -> None:
    """Refuse a layout whose memory plan exceeds ``trainer.gpu_memory_gib`` (default: the GPU's free memory)
    before any weight is read, and hold the process to ``trainer.gpu_memory_gib`` when it is set."""
    from services.trainer.memory import GIB, check_fits, for_trainer
    from services.trainer.model import layer_spec_for, recompute_for

    limit = config.gpu_memory_gib
    if not limit and torch.cuda.is_available():
        limit = torch.cuda.mem_get_info()[0] / GIB
    if not limit:
        return
    lay = for_trainer(
        config,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        dtype_bytes=2 if dtype == torch.bfloat16 else 4,
        recompute=recompute_for(config.recompute),
        attention=layer_spec_for(config.layer_spec),
    )
    planned = check_fits(spec, lay, limit)
    if config.gpu_memory_gib and torch.cuda.is_available():
        # The cap held, not only planned: past it this process fails with an OutOfMemoryError of its own instead
        # of taking what SGLang on the same GPU needs. (expandable_segments, set at start, keeps fragmentation
        # from spending the difference.)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, config.gpu_memory_gib * GIB / total))
    log.info(
        "memory plan",
        extra={"limit_gib": round(limit, 1), **{name: round(gib, 2) for name, gib in planned.rows()}},
    )


class Policy:
    def __init__(
        self,
        spec: ModelSpec,
        module: Any,
        ddp: Any,
        optimizer: Any,
        config: TrainerConfig,
        layout: ParallelLayout,
        reference: Any = None,
    ) -> None:
        self.spec = spec
        self.module = module
        self.model = ddp
        self.optimizer = optimizer
        self.config = config
        self.layout = layout
        self.reference = reference
        self.settings = config

    @classmethod
    def from_hf(cls, path: str | Path, config: TrainerConfig, layout: ParallelLayout | None = None) -> Policy:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        check_seams(config)  # a plugin that does not fit fails here, before minutes of model loading
        layout = init_parallel(
            layout or ParallelLayout(tp=config.tensor_parallel, pp=config.pipeline_parallel),
            timeout_s=config.collective_timeout_s,
        )
        spec = ModelSpec.from_dir(path)
        layout.validate(spec, config.rollout_batch_size)
        dtype = dtype_for(config.precision)
        check_memory(spec, config, layout, dtype)
        module = _load(spec, path, dtype, layout, config.recompute, config.layer_spec)
        if config.lora.enabled:  # before DDP and the optimizer: they take only what requires a gradient
            from services.trainer.lora import attach

            count = attach(module, spec, layout, config.lora, dtype)
            log.info("lora adapters", extra={"parameters": count, "rank": config.lora.rank})
        reference: Any = None
        if config.kl_coef > 0 and not config.reference_copy:
            from services.trainer.lora import AdaptersOff

            reference = AdaptersOff(module)
        elif config.kl_coef > 0:
            ref_path = config.reference_checkpoint or path
            if ModelSpec.from_dir(ref_path) != spec:
                raise ValueError(f"reference model {ref_path} has a different architecture than the policy")
            reference = _load(spec, ref_path, dtype, layout, layer_spec=config.layer_spec).eval()
            reference.requires_grad_(False)
        module.config.finalize_model_grads_func = finalize_model_grads
        ddp = DistributedDataParallel(
            module.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=config.distributed_optimizer,
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
            use_distributed_optimizer=config.distributed_optimizer,
        )
        with cpu_allocations():
            optimizer = get_megatron_optimizer(opt_config, [ddp])
        return cls(spec, module, ddp, optimizer, config, layout, reference)

    def forward(self, model: Any, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """What the step runs (``step.Forward``): the final hidden states on the last stage, the output layer
        left to the loss (``head.py``); the stage's output before it."""
        return forward_hidden(model, tokens, attention_mask)

    def logits(self, model: Any, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, S, V]`` logits over this rank's vocabulary slice (``vocab``) at every position."""
        return forward_logits(model, tokens, attention_mask)

    @functools.cached_property
    def vocab(self) -> VocabShard | None:
        """This rank's slice of the vocabulary in the logits (None without tensor parallelism: all of it)."""
        if self.layout.tp == 1:
            return None
        from megatron.core import parallel_state

        return VocabShard.of(
            self.spec.vocab_size,
            padded_vocab(self.spec.vocab_size, self.layout.tp),
            self.layout.tp,
            self.layout.tp_rank,
            parallel_state.get_tensor_model_parallel_group(),
        )

    def train(self, samples: list[Sample]) -> StepStats:
        """One step; a collective: every rank of the layout calls it with the same batch."""
        return train_step(
            self.model,
            self.optimizer,
            samples,
            forward=self.forward,
            settings=self.settings,
            micro_batch_tokens=self.config.micro_batch_tokens,
            reference=self.reference,
            layout=self.layout,
            vocab=self.vocab,
        )

    @property
    def lora(self) -> LoraConfig | None:
        return self.config.lora if self.config.lora.enabled else None

    def entries(self) -> list[Entry]:
        """Name, dtype and shape of every published tensor, in ``hf_stream`` order."""
        if self.lora and self.lora.publish == "adapter":
            from services.trainer.lora_export import adapter_entries

            return adapter_entries(self.spec, self.lora, self.dtype)
        return hf_entries(self.spec, self.dtype)

    def hf_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The published version's tensors in the model's dtype, one at a time, on rank 0 (a collective: every
        rank iterates it; the others get nothing): the Hugging Face weights, or with LoRA the adapter (PEFT
        names) or the weights with the adapter merged in."""
        base = hf_stream(self.spec, self.layout, local_parameters(self.module), self.dtype)
        if not self.lora:
            return base
        from services.trainer.lora import adapter_state
        from services.trainer.lora_export import adapter_stream, merged_stream

        adapter = adapter_stream(self.spec, self.layout, adapter_state(self.module), self.lora, self.dtype)
        return adapter if self.lora.publish == "adapter" else merged_stream(base, adapter, self.lora)

    def version_files(self) -> VersionFiles:
        """How a published version's folder is laid out (full weights, or a PEFT adapter)."""
        if not self.lora or self.lora.publish == "merged":
            return FULL_WEIGHTS
        from services.trainer.lora_export import ADAPTER_FILE, CONFIG_FILE, adapter_config_bytes

        return VersionFiles(
            format="peft-lora",
            weights_file=ADAPTER_FILE,
            extra={CONFIG_FILE: adapter_config_bytes(self.lora, self.config.hf_checkpoint)},
            copy_base=False,
        )

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype, the same on every rank (a parameter's is not: Megatron's local norms keep fp32
        weights in a bf16 model, and a later pipeline stage starts with one)."""
        dtype: torch.dtype = self.module.config.params_dtype
        return dtype

    def export(self) -> dict[str, torch.Tensor]:
        """The whole model as Hugging Face tensors, on rank 0 (a collective; other ranks get ``{}``)."""
        return dict(self.hf_stream())

    def state(self) -> tuple[dict[str, Any], Any]:
        """This rank's model and optimizer state, for its checkpoint file: host copies, so that they can be
        written while the next step changes the live tensors. With LoRA, the model's part is the adapters (the
        frozen base is the starting checkpoint, read again at start)."""
        from services.trainer.lora import adapter_state

        model = adapter_state(self.module) if self.lora else self.module.state_dict()
        return snapshot(model), optimizer_state(self.optimizer)

    def load_state(self, state: dict[str, Any]) -> None:
        if self.lora:
            from services.trainer.lora import load_adapter_state

            load_adapter_state(self.module, state["model"])
        else:
            self.module.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
