"""``turnstream replay derive|drive|export|import``: the flags (``main.py`` handles them)."""

from __future__ import annotations

import argparse

from runtime.configuration.config import Config
from runtime.process.commands import MODE_HELP, Subparsers, command


def register(sub: Subparsers) -> None:
    replay = command(sub, "replay", "re-derive, re-drive, import or export recorded sessions", run)
    what = replay.add_subparsers(dest="replay_command", required=True)

    derive = what.add_parser(
        "derive", help="pair, judge, score and dispatch recorded turns again, into a new namespace"
    )
    derive.add_argument("--into", required=True, help="the new namespace (never the source's)")
    _selection(derive)
    derive.add_argument("--mode", help=MODE_HELP)
    derive.add_argument(
        "--judge-backend", help="engine, rules or package.module:Class (default: judge.backend)"
    )
    derive.add_argument("--judge-engine-url", help="default: judge.engine_url")
    derive.add_argument("--judge-model", help="default: judge.model")
    derive.add_argument("--judge-prompts", help="folder of prompt templates (default: judge.prompts_dir)")
    derive.add_argument("--judge-id", help="judge id of the replay's votes (default: judge.judge_id)")
    derive.add_argument("--teacher-engine-url", help="default: teacher.engine_url")
    derive.add_argument(
        "--idle-timeout", type=float, help="seconds after which an open session ends (default: pairer's)"
    )
    derive.add_argument("--run-dir", help="service logs (default: <cache>/replay/<namespace>)")
    derive.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")

    drive = what.add_parser("drive", help="send recorded sessions' user messages through the proxy again")
    drive.add_argument("--proxy-url", help="the proxy's /v1 URL (default: this config's proxy)")
    drive.add_argument("--input", help="JSONL file (either format) instead of the turns topic")
    _selection(drive)
    drive.add_argument("--tag", help="suffix of the new session ids (default: redrive-<time>)")
    drive.add_argument("--concurrency", type=int, default=4)
    drive.add_argument("--max-tokens", type=int, default=128)

    export = what.add_parser("export", help="write recorded sessions to a JSONL file")
    export.add_argument("--out", required=True)
    export.add_argument("--format", choices=["turns", "openclaw"], default="turns")
    _selection(export)
    export.add_argument(
        "--tokenizer", help="for openclaw's prompt_text (default: trainer.hf_checkpoint or SmolLM2)"
    )

    imp = what.add_parser("import", help="publish sessions from a JSONL file to a namespace's turns topic")
    imp.add_argument("--input", required=True)
    target = imp.add_mutually_exclusive_group(required=True)
    target.add_argument("--into", help="namespace to publish to")
    target.add_argument("--into-live", action="store_true", help="the live turns topic (kafka.namespace)")
    imp.add_argument("--engine-url", help="policy engine that scores OpenClaw records (default: engine.url)")
    imp.add_argument("--tokenizer", help="default: the engine's model path")
    imp.add_argument("--skip-bad", action="store_true", help="skip (and list) bad lines instead of refusing")


def _selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-namespace", help="namespace of the recorded turns (default: kafka.namespace)")
    p.add_argument("--since", help="first record time: ISO 8601 (UTC unless given) or Unix seconds")
    p.add_argument("--until", help="record time to stop before (same forms)")
    p.add_argument("--from-offset", type=int, help="first offset, in every partition")
    p.add_argument("--to-offset", type=int, help="offset to stop before, in every partition")


def run(config: Config, args: argparse.Namespace) -> int:
    from services.replay.main import run_replay

    return run_replay(config, args)
