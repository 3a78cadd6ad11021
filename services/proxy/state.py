"""The proxy's long-lived parts, made once at start-up: the policy replicas (each with its engine client,
served-version probe, adapters and reloader) and the router between them, turn numbering, the recorder, session
inference and stored responses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from runtime.configuration.config import Config, replica_name
from runtime.engine.client import EngineClient, EngineError, version_number
from runtime.transport.resp import command
from services.proxy.adapters import Adapters
from services.proxy.continuity import Continuity
from services.proxy.recorder import TurnRecorder
from services.proxy.replicas import Replica, Router, routing_secret
from services.proxy.sampling import OPENAI_SAMPLING, resolve_sampling_defaults
from services.proxy.stored import ResponseStore
from services.proxy.turn_numbers import TurnNumbers
from services.proxy.versions import ServedVersions

log = logging.getLogger("turnstream.proxy")


@dataclass
class ProxyState:
    config: Config
    replicas: list[Replica]
    """The policy servers (one unless ``engine.replicas`` names several)."""
    router: Router
    turn_numbers: TurnNumbers
    recorder: TurnRecorder
    sampling: dict[str, Any] = field(default_factory=lambda: dict(OPENAI_SAMPLING))
    """Pinned on every main turn where the client gave none, so the recorded values are the effective ones."""
    retokenize: Any = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    background: list[asyncio.Task[None]] = field(default_factory=list)
    """The reloaders and the version probes: cancelled at shutdown."""
    continuity: Continuity | None = None
    """Which session a main turn without a session id continues (``proxy.session_inference``)."""

    stored: ResponseStore | None = None
    """Responses API answers kept for ``previous_response_id`` (None: ``proxy.stored_response_ttl_s`` is 0)."""

    @property
    def lora(self) -> bool:
        """Versions are LoRA adapters (``Config.lora_adapters``)."""
        return self.replicas[0].adapters is not None


async def build_state(config: Config) -> ProxyState:
    from pathlib import Path

    from runtime.engine.model_store import cache_dir

    pc = config.proxy
    spool_dir = Path(pc.spool_dir) if pc.spool_dir else cache_dir() / "spool" / f"proxy-{pc.port}"
    # Where the data keys live in the turn numbers' Redis (the default), numbering also checks the erasure fence.
    same_redis = config.kafka.seal_keys_url and config.kafka.seal_keys_url == config.redis.url
    turn_numbers = TurnNumbers(
        config.redis.url,
        config.redis.key_prefix,
        session_ttl_s=config.redis.session_ttl_s,
        fences=config.kafka.seal_keys_prefix.encode() if same_redis else None,
    )
    recorder = TurnRecorder(
        config.kafka,
        spool_dir,
        linger_s=pc.spool_linger_ms / 1000,
        number_once=turn_numbers.number_once,
        max_bytes=pc.spool_max_bytes,
        when_full=pc.spool_full,
        stop_write_timeout_s=pc.spool_stop_timeout_s,
    )
    await recorder.start()
    infos = await asyncio.gather(*(_info(config, url) for url in config.engine.urls))
    urls = config.engine.urls
    # With several replicas a request that finds one down goes to another at once (ChatProxy.dispatch), not to
    # the same one again after backoff.
    retries = config.engine.retries if len(urls) == 1 else 0
    replicas = [Replica(replica_name(url), url, _client(config, url, retries=retries)) for url in urls]
    router = Router(
        replicas,
        pc.routing,
        overload_abs=pc.overload_abs,
        overload_rel=pc.overload_rel,
        secret=routing_secret(pc.routing_secret, config.engine.admin_api_key, config.engine.api_key),
    )
    state = ProxyState(
        config=config, replicas=replicas, router=router, turn_numbers=turn_numbers, recorder=recorder
    )
    if pc.stored_response_ttl_s:
        state.stored = ResponseStore(
            turn_numbers.redis,
            config.redis.key_prefix,
            pc.stored_response_ttl_s,
            config.kafka,
            pc.stored_responses_per_key,
            pc.stored_bytes_per_key,
        )
    if pc.session_inference == "on":  # over the turn numbers' connection: one pipelined connection per proxy
        state.continuity = Continuity(
            turn_numbers.redis,
            config.redis.key_prefix,
            pc.session_link_ttl_s,
            session_ttl_s=config.redis.session_ttl_s,
        )
    if pc.tokenizer_path:
        from services.proxy.retokenize import Retokenizer

        state.retokenize = Retokenizer(pc.tokenizer_path)
    info = next((i for i in infos if i), {})
    state.sampling = resolve_sampling_defaults(pc.sampling_defaults, info)
    if info and not (info.get("tool_call_parser") or info.get("reasoning_parser")):
        log.warning(
            "the engine runs without a tool-call or reasoning parser: SGLang then drops the log-prob of a streamed "
            "step that has no text (the final EOS), and such streamed turns are not recorded (token_mismatch). "
            "Start it with --tool-call-parser (turnstream engine does)."
        )
    for replica, found in zip(replicas, infos, strict=True):
        await _start_replica(state, replica, found)
    return state


def _client(config: Config, url: str, **kw: Any) -> EngineClient:
    settings = {"timeout_s": config.engine.timeout_s, "retries": config.engine.retries, **kw}
    return EngineClient(url, api_key=config.engine.api_key, **settings)


async def _info(config: Config, url: str) -> dict[str, Any]:
    """A replica's ``/model_info``, or nothing while it does not answer (its probe finds it later)."""
    with contextlib.suppress(EngineError, KeyError, ValueError):
        return await _client(config, url).model_info()
    return {}


async def _start_replica(state: ProxyState, replica: Replica, info: dict[str, Any]) -> None:
    """One replica's served-version record, adapters, reloader and probe."""
    from pathlib import Path

    from runtime.engine.model_store import cache_dir

    config, pc, engine = state.config, state.config.proxy, replica.engine
    replica.versions = ServedVersions(version_number(info.get("weight_version")), replica=replica.name)
    replica.versions.reachable = bool(info)
    if config.lora_adapters:  # a restarted proxy finds the adapters the engine already has
        served = info.get("served_model_name")
        replica.adapters = Adapters(served if isinstance(served, str) else None)
        # Under a gate the newest adapter may be a candidate no user may see: the base until the reloader has
        # read the decisions.
        with contextlib.suppress(EngineError, KeyError, ValueError):
            if not config.gate.enabled:
                replica.adapters.serve(max(await engine.adapter_versions(), default=0))
        replica.versions = ServedVersions(replica.adapters.current, replica=replica.name)
        replica.versions.reachable = bool(info)
    if pc.reload:
        from services.proxy.engine_lease import EngineLease
        from services.proxy.reloader import Reloader

        root = Path(pc.weights_root) if pc.weights_root else cache_dir() / "weights"
        # Its own client: a load is not retried blindly (it checks /model_info instead) and may take minutes.
        # The only holder of the admin key: weight updates, pauses and adapters take nothing else.
        loader = EngineClient(
            replica.url,
            api_key=config.engine.api_key,
            admin_api_key=config.engine.admin_api_key,
            timeout_s=pc.reload_timeout_s,
            retries=0,
        )
        redis = state.turn_numbers.redis

        async def held(version: int) -> bool:  # PTTL: -2 no such key, else the milliseconds it has left
            key = config.redis.eval_hold_key(version).encode()
            return int(await redis.send(command(b"PTTL", key))) > 0

        replica.reloader = Reloader(
            config.kafka,
            loader,
            root,
            replica.versions,
            held=held,
            adapters=replica.adapters,
            gate=config.gate,
            name=replica.name,
            primary=replica is state.replicas[0],
            # full weights: several proxies may reload this engine (engine_lease.py); adapters need no lease
            lease=None
            if replica.adapters
            else EngineLease(redis, config.redis.reload_lease_key(replica.url), ttl_s=pc.reload_lease_s),
        )
        state.background.append(asyncio.create_task(replica.reloader.run()))
    on_change = replica.reloader.engine_changed if replica.reloader is not None else None
    probe_client = _client(config, replica.url, timeout_s=10.0, retries=0)
    adapters = replica.adapters

    async def probe() -> int:
        if adapters is not None:  # the newest adapter loaded: 0 after an engine restart lost them
            loaded = await probe_client.adapter_versions()
            if config.gate.enabled:  # the newest may be a candidate beside: the served one, if still loaded
                return adapters.current if adapters.current in loaded else 0
            return max(loaded, default=0)
        return version_number((await probe_client.model_info()).get("weight_version"))

    state.background.append(
        asyncio.create_task(replica.versions.run(probe, pc.version_probe_s, on_change=on_change))
    )
