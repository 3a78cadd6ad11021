"""Pinned host memory as a no-op in the CPU engine (imported at interpreter start: this folder is on the engine's
PYTHONPATH only when there is no GPU, see ``standin/sgl_kernel``).

SGLang 0.5.23's LoRA layers stage their offsets in pinned memory unconditionally
(``srt/lora/layers.py``: ``torch.tensor(..., pin_memory=True)``, ``.cpu().pin_memory()``), and pinning needs a CUDA
driver ("Found no NVIDIA driver on your system"), so ``--enable-lora`` could not start on a CPU. Pinning only
speeds host-to-GPU copies; without a GPU an ordinary tensor is the same tensor. With this, the ``torch_native``
LoRA backend serves adapters on the CPU, its log-probs within 1e-5 of PEFT's on the Hugging Face model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def _unpinned(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return call


def _install() -> None:
    try:
        import torch
    except ImportError:  # not the engine's interpreter
        return
    if torch.cuda.is_available():
        return
    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor", "empty_strided"):
        setattr(torch, name, _unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.is_pinned = lambda self, *a, **k: False  # type: ignore[method-assign]


_install()
