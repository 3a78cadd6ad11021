"""``turnstream engine``: the real SGLang server with this machine's flags."""

from __future__ import annotations

import argparse

from runtime.configuration.config import Config
from runtime.process.commands import Subparsers, command, refuse


def register(sub: Subparsers) -> None:
    engine = command(
        sub,
        "engine",
        "the real SGLang server, with this machine's flags (CPU flags when there is no GPU)",
        run,
    )
    engine.add_argument(
        "--model", help="Hugging Face folder (default: the cached SmolLM2, fetched if missing)"
    )
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=30000)
    engine.add_argument("--served-model-name", default=None)
    engine.add_argument(
        "--weight-version", default="0", help="version reported until the first weight update"
    )
    engine.add_argument(
        "--tool-call-parser",
        default="qwen",
        help="SGLang's tool-call parser (default qwen: Qwen2.5/Qwen3; 'none' for none)",
    )
    engine.add_argument(
        "--reasoning-parser", default="none", help="SGLang's reasoning parser, e.g. qwen3 (default none)"
    )
    engine.add_argument(
        "--api-key", default=None, help="clients must send this bearer token (default: engine.api_key)"
    )
    engine.add_argument(
        "--admin-api-key",
        default=None,
        help="the only token weight updates, pauses and adapters take (default: engine.admin_api_key)",
    )
    engine.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    engine.add_argument(
        "--max-total-tokens", type=int, default=16384, help="KV-cache tokens on the CPU (default 16384)"
    )
    engine.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    engine.add_argument(
        "--print-command", action="store_true", help="print the SGLang command and environment, start nothing"
    )
    engine.add_argument(
        "--lora",
        action="store_true",
        help="serve LoRA adapters on the model (rank and target modules: trainer.lora); default: on when"
        " trainer.lora is (TURNSTREAM_TRAINER_LORA_ENABLED)",
    )
    engine.add_argument("sglang_args", nargs="*", help="further SGLang flags, after --")


def run(config: Config, args: argparse.Namespace) -> int:
    import shlex

    from runtime.engine.model_store import fetch_smollm2
    from services.engine.launch import EngineOptions, exec_sglang, refuse_without_keys, sglang_command

    lora = config.trainer.lora
    opts = EngineOptions(
        model=args.model or str(fetch_smollm2()),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        weight_version=args.weight_version,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
        api_key=args.api_key or config.engine.api_key,
        admin_api_key=args.admin_api_key or config.engine.admin_api_key,
        threads=args.threads,
        max_total_tokens=args.max_total_tokens,
        device=args.device,
        lora_rank=lora.rank if args.lora or config.lora_adapters else None,
        lora_targets=tuple(lora.target_modules),
        extra=tuple(args.sglang_args),
    )
    if why := refuse_without_keys(opts):
        return refuse("engine", why)
    try:
        if args.print_command:
            argv, env = sglang_command(opts)
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
            return 0
        exec_sglang(opts)
    except FileNotFoundError as exc:
        return refuse("engine", exc)
    return 0  # not reached: exec_sglang replaces this process
