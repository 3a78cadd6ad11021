"""``turnstream``: one command that starts any part of the pipeline."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import msgspec

from runtime.configuration.config import Config, ConfigError, load_config
from runtime.observability.logs import setup_logging
from schemas.modes import MODES

MODE_HELP = f"{', '.join(MODES)} or a mode registered by plugins.modules (default: dispatcher.mode)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turnstream", description=__doc__)
    p.add_argument("--config", help="TOML config file (default: $TURNSTREAM_CONFIG, then ./turnstream.toml)")
    sub = p.add_subparsers(dest="command", required=True)

    topics = sub.add_parser("topics", help="create or describe the Kafka topics")
    topics.add_argument("action", choices=["create", "describe"])
    topics.add_argument("--namespace", help="topic name prefix (default: kafka.namespace from the config)")
    topics.add_argument("--partitions", type=int, help="override the partition count of new topics")
    topics.add_argument("--bootstrap", help="Kafka bootstrap servers (default: kafka.bootstrap)")

    models = sub.add_parser("models", help="fetch and convert models into the cache")
    models.add_argument("action", choices=["fetch"])
    models.add_argument("name", choices=["smollm2"])

    engine = sub.add_parser(
        "engine", help="the real SGLang server, with this machine's flags (CPU flags when there is no GPU)"
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

    proxy = sub.add_parser(
        "proxy", help="the OpenAI-compatible proxy that records turns (and reloads weights)"
    )
    proxy.add_argument("--host", help="default: proxy.host")
    proxy.add_argument("--port", type=int, help="default: proxy.port")
    proxy.add_argument("--engine-url", help="default: engine.url")

    run = sub.add_parser("run", help="the whole pipeline on this machine, with live progress, until Ctrl-C")
    run.add_argument("--run-dir", help="where service logs and status.json go (default: <cache>/run/<time>)")
    run.add_argument(
        "--no-local-infra",
        dest="local_infra",
        action="store_false",
        default=None,
        help="use the configured Kafka and Redis instead of starting local ones",
    )
    run.add_argument(
        "--judge-backend", choices=["engine", "rules"], help="default: run.judge_backend (rules)"
    )
    run.add_argument(
        "--simulate", type=int, metavar="N", help="also drive N simulated users (default: run.simulate, 0)"
    )
    run.add_argument(
        "--lora",
        action="store_true",
        default=None,
        help="train LoRA adapters (trainer.lora) and serve them from one engine that also answers the judge and"
        " the teacher",
    )
    run.add_argument(
        "--until-version",
        type=int,
        metavar="N",
        help="stop once version N's held-out evaluation is published (default: run.until_version, 0: Ctrl-C)",
    )

    sim = sub.add_parser("simulate", help="simulated users with learnable preferences, through the proxy")
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

    sub.add_parser("pairer", help="pairs each turn with its next state (turns -> turns.paired)")

    judge = sub.add_parser("judge", help="eval and hindsight-hint votes (turns.paired -> judgments)")
    judge.add_argument("--judge-id", help="default: judge.judge_id; each id is its own consumer group")
    judge.add_argument(
        "--backend", help="engine, rules or a plugin's package.module:Class (default: judge.backend)"
    )
    judge.add_argument("--m", type=int, help="eval votes and hint votes per turn (default: judge.m)")
    judge.add_argument("--engine-url", help="the judge engine (default: judge.engine_url)")

    teacher = sub.add_parser("teacher", help="teacher log-probs under accepted hints (judgments -> teacher)")
    teacher.add_argument("--engine-url", help="the teacher engine (default: teacher.engine_url)")
    teacher.add_argument(
        "--top-k", type=int, help="also the teacher's top-K per position (default: teacher.top_k)"
    )

    disp = sub.add_parser("dispatcher", help="joins judgments and teacher scores into samples (-> samples)")
    disp.add_argument("--mode", help=MODE_HELP)
    disp.add_argument(
        "--judge-ids",
        type=lambda v: [j.strip() for j in v.split(",")],
        help="comma-separated judge ids to wait for (default: dispatcher.judge_ids)",
    )

    trainer = sub.add_parser("trainer", help="trains the policy on samples and publishes weight versions")
    trainer.add_argument(
        "--hf-checkpoint", help="the policy's Hugging Face folder (default: trainer.hf_checkpoint)"
    )
    trainer.add_argument(
        "--max-steps", type=int, help="stop after this many steps (default: trainer.max_steps)"
    )
    _plan_parser(trainer.add_subparsers(dest="trainer_command"))

    ev = sub.add_parser(
        "eval", help="the held-out evaluation of each weight version the engine serves (-> evals)"
    )
    ev.add_argument("--engine-url", help="the policy engine (default: eval.engine_url, else engine.url)")
    ev.add_argument(
        "--set",
        action="append",
        dest="sets",
        metavar="FILE",
        help="score an evaluation set (JSONL, docs/evaluation.md) once and exit, instead of serving (repeat)",
    )
    ev.add_argument(
        "--version",
        type=int,
        help="with --set: the version to score (LoRA: any loaded adapter; full weights: the served one)",
    )
    ev.add_argument("--no-publish", action="store_true", help="with --set: print only, do not write to evals")

    sub.add_parser(
        "gate", help="decide which weight versions are promoted, from their evaluations (-> versions)"
    ).add_argument(
        "--standby",
        action="store_true",
        help="with gate.enabled off, stay up deciding nothing instead of refusing to start (compose)",
    )

    versions = sub.add_parser(
        "versions",
        help="weight versions with their state, gate results and figures; promote, roll back, pin by hand",
    )
    vsub = versions.add_subparsers(dest="versions_command")
    vlist = vsub.add_parser("list", help="every version (the default)")
    vlist.add_argument("--json", action="store_true", help="the listing as JSON")
    vsub.add_parser("promote", help="serve version N (a manual decision on `versions`)").add_argument(
        "version", type=int
    )
    vsub.add_parser(
        "rollback", help="take back version N (default: the promoted one); the one promoted before is served"
    ).add_argument("version", type=int, nargs="?")
    vsub.add_parser("pin", help="serve version N whatever is promoted, while training goes on").add_argument(
        "version", type=int
    )
    vsub.add_parser("unpin", help="serve the promoted version again")

    con = sub.add_parser("console", help="the web console: pipeline, sessions, turn inspector, versions")
    con.add_argument("--host", help="default: console.host (127.0.0.1)")
    con.add_argument("--port", type=int, help="default: console.port (8080)")

    cfg = sub.add_parser("config", help="print the resolved configuration as JSON")
    cfg.add_argument("action", choices=["show"])

    forget = sub.add_parser(
        "forget", help="erase sessions (or a user's) from every topic, Redis and the console, and prove it"
    )
    who = forget.add_mutually_exclusive_group(required=True)
    who.add_argument("--session", action="append", help="a session id (repeat for several)")
    who.add_argument("--user", help="every session whose turns name this user (Turn.user)")
    forget.add_argument(
        "--namespace",
        action="append",
        help="search and prove in this namespace only (repeat; '' the live one; default: every namespace)",
    )
    forget.add_argument(
        "--projection",
        action="append",
        help="a console projection to clean (default: console.db_path and those in the cache)",
    )
    forget.add_argument(
        "--wait",
        type=float,
        default=None,
        help="seconds between destroying the keys and the rest (default: kafka.seal_keys_cache_s + 1)",
    )
    forget.add_argument(
        "--fence-days",
        type=float,
        default=30.0,
        help="how long nothing may be written for the sessions again: new turns under their ids are refused "
        "(HTTP 410) and records on their way dropped (default 30; 0: no fence)",
    )

    _replay_parser(sub)
    return p


def _forget(config: Config, args: argparse.Namespace) -> int:
    from pathlib import Path

    from runtime.engine.model_store import cache_dir
    from schemas import normalize_namespace
    from services.console.projection import forget_sessions, session_rows
    from services.forget.main import forget, not_projections, projection_paths, sqlite_rows

    paths = [Path(p) for p in args.projection] if args.projection else projection_paths(config, cache_dir())
    if bad := not_projections(paths):
        print(f"turnstream forget: {'; '.join(bad)}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(
            forget(
                config,
                set(args.session or []),
                user=args.user,
                namespaces=[normalize_namespace(n) for n in args.namespace] if args.namespace else None,
                projections=paths,
                delete_rows=sqlite_rows(forget_sessions),
                count_rows=sqlite_rows(session_rows),
                wait_s=args.wait,
                fence_s=round(args.fence_days * 86400),
            )
        )
    except ValueError as exc:
        print(f"turnstream forget: {exc}", file=sys.stderr)
        return 2
    print(msgspec.json.format(msgspec.json.encode(report).decode()))
    return 0 if report.erased else 1


def _plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = sub.add_parser(
        "plan", help="the trainer's memory per GPU for a model and layout, and a layout that fits"
    )
    plan.add_argument("--hf-checkpoint", help="folder (or its config.json) (default: trainer.hf_checkpoint)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs the trainer gets (default 1)")
    plan.add_argument("--gpu-memory-gib", type=float, default=140.0, help="per GPU (default 140: an H200)")
    plan.add_argument("--tp", type=int, help="plan this tensor-parallel size (default: propose a layout)")
    plan.add_argument("--pp", type=int, help="plan this pipeline-parallel size (default: propose a layout)")
    plan.add_argument("--micro-batch-tokens", type=int, help="default: trainer.micro_batch_tokens")
    plan.add_argument("--seq-len", type=int, help="longest sample (default: the micro-batch budget)")
    plan.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        help="default: trainer.recompute (auto: selective)",
    )
    plan.add_argument(
        "--attention",
        choices=["local", "fused"],
        default="local",
        help="Megatron's local attention (the trainer's without Transformer Engine, as on the CPU; default) or "
        "Transformer Engine's fused one (the trainer's on GPUs where it is installed)",
    )
    plan.add_argument("--fp32", action="store_true", help="fp32 weights (default bf16, as on GPUs)")
    plan.add_argument(
        "--kl",
        action="store_true",
        default=None,
        help="with the KL term (default: kl_coef > 0); its reference is a second model, except under LoRA "
        "without trainer.reference_checkpoint (the base with the adapters off)",
    )
    plan.add_argument(
        "--lora",
        action="store_true",
        help="LoRA adapters (rank, targets: trainer.lora; default: trainer.lora.enabled)",
    )
    plan.add_argument("--json", action="store_true", help="the plans as JSON")


def _replay_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    replay = sub.add_parser("replay", help="re-derive, re-drive, import or export recorded sessions")
    what = replay.add_subparsers(dest="replay_command", required=True)

    def selection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--from-namespace", help="namespace of the recorded turns (default: kafka.namespace)")
        p.add_argument("--since", help="first record time: ISO 8601 (UTC unless given) or Unix seconds")
        p.add_argument("--until", help="record time to stop before (same forms)")
        p.add_argument("--from-offset", type=int, help="first offset, in every partition")
        p.add_argument("--to-offset", type=int, help="offset to stop before, in every partition")

    derive = what.add_parser(
        "derive", help="pair, judge, score and dispatch recorded turns again, into a new namespace"
    )
    derive.add_argument("--into", required=True, help="the new namespace (never the source's)")
    selection(derive)
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
    selection(drive)
    drive.add_argument("--tag", help="suffix of the new session ids (default: redrive-<time>)")
    drive.add_argument("--concurrency", type=int, default=4)
    drive.add_argument("--max-tokens", type=int, default=128)

    export = what.add_parser("export", help="write recorded sessions to a JSONL file")
    export.add_argument("--out", required=True)
    export.add_argument("--format", choices=["turns", "openclaw"], default="turns")
    selection(export)
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


def _topics(config: Config, args: argparse.Namespace) -> int:
    from runtime.messaging.topics import create_topics, describe_topics

    kafka = config.kafka
    if args.namespace is not None or args.bootstrap:
        kafka = msgspec.structs.replace(
            kafka,
            namespace=args.namespace if args.namespace is not None else kafka.namespace,
            bootstrap=args.bootstrap or kafka.bootstrap,
        )
        kafka.__post_init__()
    if args.action == "create":
        created = asyncio.run(create_topics(kafka, partitions=args.partitions))
        states = asyncio.run(describe_topics(kafka))
        for state, outcome in zip(states, created, strict=True):
            state.status = outcome.status
    else:
        states = asyncio.run(describe_topics(kafka))
    width = max(len(s.name) for s in states)
    for s in states:
        detail = f"partitions={s.partitions}" if s.partitions else ""
        if s.configs:
            detail += " " + " ".join(f"{k}={v}" for k, v in sorted(s.configs.items()))
        print(f"{s.name:<{width}}  {s.status:<8} {detail}".rstrip())
    return 1 if any(s.status == "missing" for s in states) else 0


def _engine(args: argparse.Namespace) -> int:
    import shlex

    from runtime.engine.model_store import fetch_smollm2
    from services.engine.launch import EngineOptions, exec_sglang, refuse_without_keys, sglang_command

    config = load_config(args.config)
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
        print(f"turnstream engine: {why}", file=sys.stderr)
        return 2
    try:
        if args.print_command:
            argv, env = sglang_command(opts)
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
            return 0
        exec_sglang(opts)
    except FileNotFoundError as exc:
        print(f"turnstream engine: {exc}", file=sys.stderr)
        return 2
    return 0  # not reached: exec_sglang replaces this process


def _proxy(config: Config, args: argparse.Namespace) -> int:
    from runtime.transport.http_server import serve
    from services.proxy.app import create_app

    proxy = msgspec.structs.replace(
        config.proxy, host=args.host or config.proxy.host, port=args.port or config.proxy.port
    )
    engine = msgspec.structs.replace(config.engine, url=args.engine_url or config.engine.url)
    config = msgspec.structs.replace(config, proxy=proxy, engine=engine)
    from runtime.observability.metrics import serve_metrics
    from services.proxy.keys import KeyFileError, ProxyKeys, refuse_without_keys

    try:
        why = refuse_without_keys(proxy.host, ProxyKeys(proxy.api_key, proxy.keys_file))
    except KeyFileError as exc:
        why = str(exc)
    if why:
        print(f"turnstream proxy: {why}", file=sys.stderr)
        return 2
    # For a Prometheus without the proxy's keys (compose): the same registry, on a port of its own.
    serve_metrics(config.metrics.port, config.metrics.host)
    # No X-Forwarded-* rewriting (the proxy never uses the client's address) and no Server header: per-request
    # work the hot path does not need.
    serve(
        create_app(config),
        host=proxy.host,
        port=proxy.port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        head_timeout_s=proxy.head_timeout_s,
        body_timeout_s=proxy.body_timeout_s,
        max_head_bytes=proxy.max_head_bytes,
        max_connections=proxy.max_connections,
        max_connections_per_address=proxy.max_connections_per_address,
    )
    return 0


def _simulate(config: Config, args: argparse.Namespace) -> int:
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
        print(f"turnstream simulate: {exc}", file=sys.stderr)
        return 2
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


def _versions(config: Config, args: argparse.Namespace) -> int:
    from services.versions.main import VersionsError, decide, history, listing, table

    action = args.versions_command or "list"
    if action == "list":
        shown = listing(*asyncio.run(history(config)))
        print(
            msgspec.json.format(msgspec.json.encode(shown).decode())
            if getattr(args, "json", False)
            else table(shown)
        )
        return 0
    try:
        decision = asyncio.run(decide(config, action, getattr(args, "version", None)))
    except VersionsError as exc:
        print(f"turnstream versions {action}: {exc}", file=sys.stderr)
        return 2
    print(msgspec.json.encode(decision).decode())
    if not config.gate.enabled:
        print(
            "turnstream versions: recorded on `versions`; proxies act on it only with gate.enabled"
            " (docs/evaluation.md)",
            file=sys.stderr,
        )
    return 0


def _eval_sets(config: Config, args: argparse.Namespace) -> int:
    """``turnstream eval --set FILE``: one version scored on each set, a JSON line per set on stdout."""
    from runtime.pipeline.evalsets import EvalSetError, load_set
    from services.eval.set_runner import SetRunError, evaluate_sets

    try:
        config = _override(config, "eval", {"engine_url": args.engine_url})
        sets = [load_set(path) for path in args.sets]
        results = asyncio.run(evaluate_sets(config, sets, args.version, publish=not args.no_publish))
    except (ConfigError, EvalSetError, SetRunError) as exc:
        print(f"turnstream eval: {exc}", file=sys.stderr)
        return 2
    for evalset, r in zip(sets, results, strict=True):
        line = {
            "set": evalset.name,
            "question_set": r.question_set,
            "version": r.version,
            "cases": len(r.answers),
            "scores": r.scores,
            "overall": r.overall,
            "duration_s": round(r.duration_s, 2),
            "published": not args.no_publish,
        }
        print(msgspec.json.encode(line).decode())
    return 0


def _override(config: Config, section: str, values: dict[str, object]) -> Config:
    """``config`` with the command-line flags that were given, validated like the config file's values."""
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return config
    current = msgspec.to_builtins(getattr(config, section))
    try:
        updated = msgspec.convert({**current, **given}, type(getattr(config, section)))
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"{section}: {exc}") from None
    return msgspec.structs.replace(config, **{section: updated})


# Consuming services: where their main loop lives, and which flags override which fields of their config section.
_WORKERS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "pairer": ("services.pairer.worker", "run_pairer", "pairer", ()),
    "judge": ("services.judge.worker", "run_judge", "judge", ("judge_id", "backend", "m", "engine_url")),
    "teacher": ("services.teacher.worker", "run_teacher", "teacher", ("engine_url", "top_k")),
    "dispatcher": ("services.dispatcher.worker", "run_dispatcher", "dispatcher", ("mode", "judge_ids")),
    "trainer": ("services.trainer.worker", "run_trainer", "trainer", ("hf_checkpoint", "max_steps")),
    "eval": ("services.eval.worker", "run_eval", "eval", ("engine_url",)),
    "gate": ("services.gate.worker", "run_gate", "gate", ()),
}


def _worker(config: Config, args: argparse.Namespace) -> int:
    import importlib

    if getattr(args, "trainer_command", None) == "plan":
        from services.trainer.plan_cli import run_plan

        return run_plan(config, args)

    module, function, section, flags = _WORKERS[args.command]
    try:
        config = _override(config, section, {f: getattr(args, f) for f in flags})
    except ConfigError as exc:
        print(f"turnstream {args.command}: {exc}", file=sys.stderr)
        return 2
    extra = {"standby": args.standby} if args.command == "gate" else {}
    asyncio.run(getattr(importlib.import_module(module), function)(config, **extra))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.process.launch import die_with_parent_from_env

    die_with_parent_from_env()
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"turnstream: invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.logging.level, config.logging.format)
    if args.command == "topics":
        try:
            return _topics(config, args)
        except ValueError as exc:
            print(f"turnstream: {exc}", file=sys.stderr)
            return 2
    if args.command == "models":
        from runtime.engine.model_store import fetch

        print(fetch(args.name))
        return 0
    if args.command == "engine":
        return _engine(args)
    if args.command == "proxy":
        return _proxy(config, args)
    if args.command == "simulate":
        return _simulate(config, args)
    if args.command == "run":
        from services.run.main import run_pipeline

        try:
            config = _override(
                config,
                "run",
                {
                    "run_dir": args.run_dir,
                    "local_infra": args.local_infra,
                    "judge_backend": args.judge_backend,
                    "simulate": args.simulate,
                    "until_version": args.until_version,
                },
            )
            if args.lora:
                config = _override(
                    config, "trainer", {"lora": {**msgspec.to_builtins(config.trainer.lora), "enabled": True}}
                )
        except ConfigError as exc:
            print(f"turnstream run: {exc}", file=sys.stderr)
            return 2
        return asyncio.run(run_pipeline(config, args.config))
    if args.command == "eval" and args.sets:
        return _eval_sets(config, args)
    if args.command in _WORKERS:
        return _worker(config, args)
    if args.command == "console":
        from services.console.worker import run_console

        try:
            config = _override(config, "console", {"host": args.host, "port": args.port})
        except ConfigError as exc:
            print(f"turnstream console: {exc}", file=sys.stderr)
            return 2
        return run_console(config)
    if args.command == "config":
        from runtime.configuration.config import redacted

        print(msgspec.json.format(msgspec.json.encode(redacted(config)).decode()))
        return 0
    if args.command == "forget":
        return _forget(config, args)
    if args.command == "versions":
        return _versions(config, args)
    if args.command == "replay":
        from services.replay.main import run_replay

        return run_replay(config, args)
    print(f"turnstream: unknown command {args.command}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
