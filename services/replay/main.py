"""``turnstream replay derive|drive|export|import``: argument handling; the work is in the modules beside."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from runtime.configuration.config import Config
from runtime.engine.client import EngineError
from services.replay.select import Range, parse_time


def _fail(command: str, message: str) -> int:
    print(f"turnstream replay {command}: {message}", file=sys.stderr)
    return 2


def _source(config: Config, args: argparse.Namespace) -> tuple[Config, Range]:
    if args.from_namespace is not None:
        config = msgspec.structs.replace(config, kafka=config.kafka.in_namespace(args.from_namespace))
    span = Range(
        since_ms=parse_time(args.since) if args.since else None,
        until_ms=parse_time(args.until) if args.until else None,
        from_offset=args.from_offset,
        to_offset=args.to_offset,
    )
    return config, span


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _print(summary: msgspec.Struct) -> None:
    print(msgspec.json.format(msgspec.json.encode(summary)).decode())


def run_replay(config: Config, args: argparse.Namespace) -> int:
    command = args.replay_command
    try:
        if command == "derive":
            return _derive(config, args)
        if command == "drive":
            return _drive(config, args)
        if command == "export":
            return _export(config, args)
        return _import(config, args)
    except (ValueError, KeyError, OSError, EngineError) as exc:  # bad input, missing topics or files, engine
        return _fail(command, str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))


def _derive(config: Config, args: argparse.Namespace) -> int:
    from services.replay.derive import DeriveFailed, DeriveOptions, derive

    source, span = _source(config, args)
    opts = DeriveOptions(
        into=args.into,
        span=span,
        mode=args.mode,
        judge_backend=args.judge_backend,
        judge_engine_url=args.judge_engine_url,
        judge_model=args.judge_model,
        judge_prompts=args.judge_prompts,
        judge_id=args.judge_id,
        teacher_engine_url=args.teacher_engine_url,
        idle_timeout_s=args.idle_timeout,
        run_dir=args.run_dir or "",
        timeout_s=args.timeout,
    )
    try:
        _print(asyncio.run(derive(source, opts, args.config)))
    except DeriveFailed as exc:
        print(f"turnstream replay derive: {exc}", file=sys.stderr)
        return 1
    return 0


def _drive(config: Config, args: argparse.Namespace) -> int:
    from services.replay.drive import drive, scripts
    from services.replay.records import read_jsonl
    from services.replay.select import recorded_turns

    if args.input:
        records, bad = read_jsonl(args.input)
        if bad:
            return _fail("drive", "; ".join(str(b) for b in bad[:20]))
    else:
        source, span = _source(config, args)

        async def turns() -> list[Any]:
            return [rec.event async for rec in recorded_turns(source.kafka, span)]

        records = asyncio.run(turns())
    plan = scripts(records)  # type: ignore[arg-type]
    tag = args.tag or time.strftime("redrive-%Y%m%d-%H%M%S")
    url = args.proxy_url or f"http://127.0.0.1:{config.proxy.port}/v1"
    summary = asyncio.run(
        drive(
            plan,
            url,
            tag,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            api_key=config.proxy.api_key,
            model=config.proxy.served_model_name,
        )
    )
    _print(summary)
    return 0 if summary.turns_failed == 0 else 1


def _export(config: Config, args: argparse.Namespace) -> int:
    from services.replay.transfer import export_sessions

    source, span = _source(config, args)
    tokenizer = None
    if args.format == "openclaw":
        from runtime.engine.model_store import fetch_smollm2

        tokenizer = _tokenizer(args.tokenizer or config.trainer.hf_checkpoint or str(fetch_smollm2()))
    _print(asyncio.run(export_sessions(source.kafka, span, Path(args.out), args.format, tokenizer)))
    return 0


def _import(config: Config, args: argparse.Namespace) -> int:
    from runtime.engine.client import EngineClient
    from services.replay.records import OpenClawRecord, read_jsonl
    from services.replay.transfer import import_sessions

    kafka = config.kafka if args.into_live else config.kafka.in_namespace(args.into)
    engine_url = args.engine_url or config.engine.url

    async def run() -> Any:  # one event loop for the engine calls and Kafka
        tokenizer = None
        records, _ = await asyncio.to_thread(read_jsonl, args.input)
        if any(isinstance(r, OpenClawRecord) for r in records):
            path = args.tokenizer
            if not path:
                info = await EngineClient(engine_url, api_key=config.engine.api_key).model_info()
                path = str(info.get("tokenizer_path") or info.get("model_path") or "")
            if not path:
                raise ValueError("give --tokenizer: the engine does not say where its model is")
            tokenizer = await asyncio.to_thread(_tokenizer, path)
        return await import_sessions(
            kafka,
            args.input,
            engine_url=engine_url,
            engine_api_key=config.engine.api_key,
            tokenizer=tokenizer,
            skip_bad=args.skip_bad,
        )

    _print(asyncio.run(run()))
    return 0
