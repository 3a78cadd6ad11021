"""``turnstream simulate``: simulated users with learnable preferences, through the proxy."""

from __future__ import annotations

import argparse
import asyncio

import msgspec

from runtime.configuration.config import Config
from runtime.process.commands import Subparsers, command, refuse


def register(sub: Subparsers) -> None:
    sim = command(sub, "simulate", "simulated users with learnable preferences, through the proxy", run)
    sim.add_argument("--proxy-url", help="default: http://127.0.0.1:<proxy.port>/v1")
    sim.add_argument("--users", type=int, default=2, help="concurrent users (default 2)")
    sim.add_argument("--sessions", type=int, help="sessions in all (default: until Ctrl-C)")
    sim.add_argument("--turns", type=int, default=3, help="judged turns per session (default 3)")
    sim.add_argument("--personas", help="comma-separated (default: all: plain-short, sign-off)")
    sim.add_argument("--max-tokens", type=int, default=64)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--stock-share",
        type=float,
        default=0.5,
        help="share of sessions sent without session headers, as a stock client (default 0.5)",
    )
    sim.add_argument(
        "--out", help="summary.json, observations.jsonl, learning.png (default: <cache>/simulate/<time>)"
    )


def run(config: Config, args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from runtime.engine.model_store import cache_dir
    from runtime.pipeline.personas import by_name
    from services.simulate.driver import run_simulate

    try:
        personas = by_name(args.personas)
        if not 0 <= args.stock_share <= 1:
            raise ValueError(f"--stock-share must be in [0, 1], got {args.stock_share}")
    except ValueError as exc:
        return refuse("simulate", exc)
    out = Path(args.out) if args.out else cache_dir() / "simulate" / time.strftime("%Y%m%d-%H%M%S")
    summary = asyncio.run(
        run_simulate(
            args.proxy_url or f"http://127.0.0.1:{config.proxy.port}/v1",
            personas,
            users=args.users,
            sessions=args.sessions,
            out_dir=out,
            turns=args.turns,
            max_tokens=args.max_tokens,
            seed=args.seed,
            api_key=config.proxy.api_key,
            metrics_port=config.metrics.port,
            stock_share=args.stock_share,
        )
    )
    print(msgspec.json.format(msgspec.json.encode(summary)).decode())
    return 0
