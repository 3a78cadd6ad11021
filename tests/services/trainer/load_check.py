"""Run under torchrun by test_distributed.py: each rank builds its part of the model from a Hugging Face folder
and reports the peak host memory the load added (the highest anonymous resident size, sampled, minus that before)
and its parameter bytes, as ``<out>/<how>-rank<r>.json``. ``sliced``: the trainer's loader (``hf_load``);
``whole``: the way it loaded before (every tensor read, the whole model converted, then sliced, into randomly
initialised parameters), for comparison."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch

from services.trainer.model import build_model, init_parallel, shutdown_parallel
from services.trainer.parallel import ParallelLayout
from services.trainer.spec import ModelSpec

PAGE = os.sysconf("SC_PAGE_SIZE")


def anonymous() -> int:
    """Resident bytes not backed by a file (``statm``: resident - shared). The safetensors files are mapped, and
    their pages are page cache the kernel can drop, not memory the load holds."""
    fields = Path("/proc/self/statm").read_text().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


class PeakAnonymous(threading.Thread):
    """The highest anonymous resident size while running (sampled every millisecond)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = anonymous()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, anonymous())


def main() -> None:
    path, how, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    layout = init_parallel(ParallelLayout.from_env(tp=int(sys.argv[4]) if len(sys.argv) > 4 else 2))
    spec = ModelSpec.from_dir(path)
    before = anonymous()
    sampler = PeakAnonymous()
    sampler.start()
    if how == "sliced":
        from services.trainer.hf_load import load_hf_into, safetensors_source

        model = build_model(spec, torch.float32, layout, initialise=False)
        with safetensors_source(path) as source:
            load_hf_into(model, spec, source, layout)
    else:
        from services.trainer.hf_load import load_hf_into
        from services.trainer.model import read_hf_weights

        model = build_model(spec, torch.float32, layout)
        load_hf_into(model, spec, read_hf_weights(path), layout)
    sampler.done.set()
    sampler.join()
    peak = max(sampler.peak, anonymous()) - before
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    figures = {"rank": layout.rank, "how": how, "peak_added": peak, "param_bytes": params}
    (out / f"{how}-rank{layout.rank}.json").write_text(json.dumps(figures))
    shutdown_parallel(layout)


if __name__ == "__main__":
    main()
