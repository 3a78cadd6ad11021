"""Megatron-core 0.16 on a machine without CUDA (tests, the CPU demo): the few places where it calls CUDA
unconditionally, redirected to the CPU. Applied only when CUDA is absent, and idempotent.

- ``torch.cuda.current_device()`` (rotary embeddings move their inverse frequencies there): the CPU.
- The default causal mask is allocated with ``device="cuda"``: allocated on the CPU.
- The model-parallel RNG tracker keeps CUDA generator states: it keeps CPU generator states instead.
- Gradient clipping asserts CUDA tensors for its fused multi-tensor norm: the plain torch norm is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_applied = False


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

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _applied = True
    return True
