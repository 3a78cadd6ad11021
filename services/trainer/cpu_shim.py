"""Megatron-core 0.16 on a machine without CUDA (tests, the CPU demo): the few places where it calls CUDA
unconditionally, redirected to the CPU. Applied only when CUDA is absent, and idempotent.

- ``torch.cuda.current_device()`` (rotary embeddings move their inverse frequencies there): the CPU.
- The default causal mask is allocated with ``device="cuda"``: allocated on the CPU.
- The model-parallel RNG tracker keeps CUDA generator states: it keeps CPU generator states instead.
- Gradient clipping asserts that gradients are CUDA tensors: the same clip without the assertion.
- Optimizer and pipeline-schedule code allocates with ``device="cuda"`` (and moves the shared embedding of a
  pipelined model with ``.cuda()``): ``cpu_allocations()``, a torch function mode entered only around model
  construction, the schedule and optimizer steps, keeps those on the CPU.
- Pipeline point-to-point communication calls ``torch.cuda.synchronize()``: a no-op (gloo is synchronous).
- Activation recompute saves and restores the CUDA generator's state around each recomputed part: there is
  none (the CPU generator and the tracker's CPU states are saved and restored as before).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_applied = False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers accept parameters whose type() names a CUDA tensor; the query form only.
            name: str = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_allocations() -> Iterator[None]:
    """Inside: ``device="cuda"`` in torch calls means the CPU (no-op where CUDA exists)."""
    if torch.cuda.is_available():
        yield
        return
    with _CudaToCpu():
        yield


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_shim() -> bool:
    """Patch megatron-core for the CPU if CUDA is absent. Returns whether the shim is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.utils as transformer_utils

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    if hasattr(fused_softmax, "get_default_causal_mask"):
        fused_softmax.get_default_causal_mask = _cpu_causal_mask

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):  # type: ignore[misc]
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as moptimizer

    def clip_grad_by_total_norm_cpu(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        """Megatron's clip, minus its assertion that gradients live on CUDA."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if grads and clip_coeff < 1.0:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _applied = True
    return True
