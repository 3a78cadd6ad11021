"""``turnstream engine``: start the real SGLang server with the flags this machine needs.

On a machine without CUDA, SGLang 0.5.23 runs on the CPU only with ``SGLANG_USE_CPU_ENGINE=1`` (without it
``--device cpu`` still takes a GPU code path), the import-only ``sgl_kernel`` stand-in (``standin/``) first on the
engine's PYTHONPATH, and the flags in ``CPU_FLAGS``: without ``--disable-overlap-schedule --sleep-on-idle`` the
idle scheduler burns a core, without ``--dtype float32`` an fp32 model runs in fp16 and its log-probs move by ~1e-2.
The KV cache is fixed by ``--max-total-tokens``; ``--mem-fraction-static`` only bounds SGLang's start-up check, which
fails ("Loaded weights leave no GPU memory for the KV cache") when the machine's free memory fell by more than that
fraction's complement while the weights loaded: at 0.2, another engine starting beside it was enough.
On a GPU none of that is added. Every policy engine reports raw (temperature 1) log-probs of the sampled tokens
(``SGLANG_RETURN_ORIGINAL_LOGPROB=1``): the trainer compares them with ``log_softmax(logits)``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from runtime.configuration.config import LORA_TARGETS
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from runtime.security.addresses import is_loopback

__all__ = ["SGLANG_VERSION", "EngineOptions", "EngineProcess", "sglang_command"]

SGLANG_VERSION = "0.5.23"
"""The SGLang the project is built and tested against (scripts/sglang/version, compose.yaml's image tag)."""

STANDIN = Path(__file__).resolve().parent / "standin"

CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--sleep-on-idle",
    "--dtype", "float32",
    "--mem-fraction-static", "0.6",
    "--tp", "1",
)  # fmt: skip

Device = Literal["auto", "cpu", "cuda"]


@dataclass
class EngineOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    weight_version: str = "0"
    """What the engine reports until its first weight update: turnstream's number for the starting weights."""
    tool_call_parser: str | None = "qwen"
    """SGLang flushes a streamed step's log-probs that have no text (the final EOS) only when a tool-call or
    reasoning parser is set: without one, a streamed turn loses its last log-prob. ``qwen`` (Qwen2.5/Qwen3's
    ``<tool_call>`` format) is inert for models that never write it."""
    reasoning_parser: str | None = None
    api_key: str | None = None
    """``--api-key``: generation, scoring and info need it (``engine.api_key``)."""
    admin_api_key: str | None = None
    """``--admin-api-key``: weight updates, pauses and adapters need it, and only it (``engine.admin_api_key``)."""
    threads: int = 1
    max_total_tokens: int | None = 16384
    """KV-cache tokens on the CPU (about 4.5 GB of memory for the whole server with SmolLM2); None on a GPU lets
    SGLang size it from ``--mem-fraction-static``."""
    device: Device = "auto"
    lora_rank: int | None = None
    """Serve LoRA adapters up to this rank (``/load_lora_adapter``) on the model; None: no LoRA."""
    lora_targets: Sequence[str] = LORA_TARGETS
    extra: Sequence[str] = field(default_factory=tuple)


def has_cuda() -> bool:
    """An NVIDIA device node is present (no torch import: the engine's own venv may not be this one)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def sglang_python() -> str:
    """The interpreter that has SGLang: $TURNSTREAM_SGLANG_PYTHON, this one (SGLang's docker image), or the
    checkout's .venv-sglang made by scripts/setup-sglang.sh."""
    if given := os.environ.get("TURNSTREAM_SGLANG_PYTHON"):
        return given
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / ".venv-sglang" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(
        "no SGLang found: run `bash scripts/setup-sglang.sh` (or set TURNSTREAM_SGLANG_PYTHON to a python that "
        f"has sglang=={SGLANG_VERSION})"
    )


def sglang_command(opts: EngineOptions, python: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions that start SGLang for ``opts``."""
    cpu = opts.device == "cpu" or (opts.device == "auto" and not has_cuda())
    argv = [
        python or sglang_python(),
        "-m",
        "sglang.launch_server",
        "--model-path", opts.model,
        "--host", opts.host,
        "--port", str(opts.port),
        "--served-model-name", opts.served_model_name or os.path.basename(os.path.normpath(opts.model)),
        "--weight-version", opts.weight_version,
        "--enable-metrics",
        "--enable-cache-report",  # usage.prompt_tokens_details.cached_tokens: what the agents' APIs report
    ]  # fmt: skip
    if opts.tool_call_parser:
        argv += ["--tool-call-parser", opts.tool_call_parser]
    if opts.reasoning_parser:
        argv += ["--reasoning-parser", opts.reasoning_parser]
    # One argument each: a key that starts with "-" (token_urlsafe makes one in 32) is otherwise read by SGLang's
    # argparse as an option, and the engine refuses to start ("expected one argument").
    if opts.api_key:
        argv += [f"--api-key={opts.api_key}"]
    if opts.admin_api_key:
        argv += [f"--admin-api-key={opts.admin_api_key}"]
    if opts.lora_rank:  # strict: an adapter whose names or shapes do not match is refused, not half applied
        argv += ["--enable-lora", "--max-lora-rank", str(opts.lora_rank), "--lora-strict-loading"]
        argv += ["--lora-target-modules", *opts.lora_targets]
        if cpu:  # the only backend without Triton or CUDA kernels (with standin/sitecustomize.py's unpinning)
            argv += ["--lora-backend", "torch_native"]
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    if cpu:
        argv += CPU_FLAGS
        if opts.max_total_tokens:
            argv += ["--max-total-tokens", str(opts.max_total_tokens)]
        pythonpath = os.environ.get("PYTHONPATH")
        env |= {
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": str(STANDIN) + (os.pathsep + pythonpath if pythonpath else ""),
            "OMP_NUM_THREADS": str(opts.threads),
            "MKL_NUM_THREADS": str(opts.threads),
        }
    argv += list(opts.extra)
    return argv, env


def refuse_without_keys(opts: EngineOptions) -> str | None:
    """Why the engine must not start, or None: beyond loopback without both keys, anyone who reaches the port
    could load weights from any path, load adapters or pause generation for everyone."""
    if is_loopback(opts.host) or (opts.api_key and opts.admin_api_key):
        return None
    return (
        f"SGLang would take weight updates and adapters from anyone who reaches {opts.host}: set engine.api_key "
        "and engine.admin_api_key (TURNSTREAM_ENGINE_API_KEY, TURNSTREAM_ENGINE_ADMIN_API_KEY), or bind 127.0.0.1"
    )


def exec_sglang(opts: EngineOptions) -> None:
    """Replace this process with SGLang, so that signals reach it directly (SIGTERM stops its whole tree)."""
    argv, env = sglang_command(opts)
    if not os.path.exists(argv[0]) and shutil.which(argv[0]) is None:
        raise FileNotFoundError(argv[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, {**os.environ, **env})


class EngineProcess(ServiceProcess):
    """``turnstream engine`` (the real SGLang) as a subprocess, ready once ``/health`` answers 200 (``wait=False``:
    started, and ``wait_ready`` later, so that its minute or two of start-up overlaps other work)."""

    def __init__(
        self,
        model: str | Path,
        *extra: str,
        port: int | None = None,
        log: IO[str] | None = None,
        startup_timeout_s: float = 600.0,
        threads: int = 1,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        port = port or free_port()
        super().__init__(
            ["engine", "--model", str(model), "--port", str(port), "--threads", str(threads), *extra],
            port=port,
            ready_path="/health",
            env={"OMP_NUM_THREADS": str(threads), **(env or {})},
            log=log,
            startup_timeout_s=startup_timeout_s,
            wait=wait,
        )
