"""One validated configuration for every turnstream service.

Sources, later ones winning: built-in defaults, a TOML file (``--config`` or ``TURNSTREAM_CONFIG``), OpenClaw's
environment variable names (aliases, so its users need not relearn), and ``TURNSTREAM_<SECTION>_<FIELD>``
variables (e.g. ``TURNSTREAM_KAFKA_BOOTSTRAP``, ``TURNSTREAM_JUDGE_M``). An invalid value fails at start with
a ConfigError naming the field and where the value came from.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from runtime.configuration.plugins import PluginError, import_modules
from schemas import normalize_namespace
from schemas.modes import MODES, UnknownMode, mode_spec
from schemas.topics import ALL_TOPICS, BY_BASE, DAY_MS

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Port = Annotated[int, Meta(ge=1, le=65535)]
PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Probability = Annotated[float, Meta(ge=0, le=1)]

ENV_PREFIX = "TURNSTREAM_"
JUDGE_GROUP_PREFIX = "turnstream-judge-"
"""Every judge id's consumer group starts so (``JudgeConfig.group_id``); the judge's Kafka user may join any of them."""


class ConfigError(ValueError):
    """Invalid configuration; the message names the field and its source."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


KAFKA_LOGIN_FIELDS = (
    "security_protocol",
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
)
"""``KafkaConfig``'s fields that say how a client logs in to the brokers (protocol, SASL, TLS)."""

KAFKA_CLIENT_FIELDS = ("bootstrap", "namespace", *KAFKA_LOGIN_FIELDS, "seal_keys_prefix")
"""Its fields a client process shares with the one that starts it (``KafkaConfig.client_env``)."""


class KafkaConfig(_Section):
    bootstrap: str = "127.0.0.1:9092"
    """Comma-separated host:port list."""
    namespace: str = ""
    """Topic name prefix, e.g. ``replay-2026-11-29.``; empty for the live topics."""
    client_id: str = "turnstream"
    """Prefix of each Kafka client's id (the service's name is added): what the broker's logs and quotas see."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How clients reach the brokers: plain, TLS, SASL or SASL over TLS (docs/security.md)."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL's mechanism, with ``sasl_username`` and ``sasl_password`` (SASL_PLAINTEXT, SASL_SSL)."""
    sasl_username: str | None = None
    """The SASL user."""
    sasl_password: str | None = None
    """The SASL password (masked by ``turnstream config show``)."""
    ssl_cafile: str | None = None
    """CA bundle that signed the brokers' certificates (SSL, SASL_SSL; default: the system's CAs)."""
    ssl_certfile: str | None = None
    """Client certificate for mutual TLS, with ``ssl_keyfile``."""
    ssl_keyfile: str | None = None
    """The private key of ``ssl_certfile``."""
    request_timeout_ms: PositiveInt = 30_000
    """How long a Kafka request (produce, fetch, metadata) may take before it fails and is retried."""
    max_batch: PositiveInt = 256
    """Most records one consumer poll hands to a service."""
    poll_timeout_ms: PositiveInt = 500
    """How long one consumer poll waits for records before the service's loop goes round (sweeps, stop checks)."""
    session_timeout_ms: PositiveInt = 10_000
    """A consumer not heard from for this long leaves its group and its partitions go to another."""
    heartbeat_interval_ms: PositiveInt = 1_000
    """How often a consumer tells its group it is alive (well under ``session_timeout_ms``)."""
    connect_wait_s: NonNegFloat = 300.0
    """How long a service keeps retrying when the broker is unreachable as it starts (a broker restarting, or
    started after the services) before it gives up; 0: fail at once."""
    seal: bool = True
    """Seal the records that hold conversations under a key per session (``runtime/security/erasure``), so that
    ``turnstream forget`` can erase a session from every topic, namespace and copy by destroying its key."""
    seal_keys_url: str = ""
    """The Redis holding those keys; empty: ``redis.url``. Back it up as you back up Kafka: without a session's
    key its records cannot be read."""
    seal_keys_prefix: str = "turnstream:dek:"
    """Where in it: one key per session, ``<prefix><session id>``, for every namespace (a replay's copies of a
    session are sealed under the live session's key, and forgotten with it)."""
    seal_keys_cache_s: PositiveFloat = 30.0
    """How long a process keeps a key it used: a forgotten session's records stay readable by a process that
    held its key for at most this long."""
    seal_keys_replicas: NonNegInt = 0
    """Before a data key seals anything, this many Redis replicas must have it (``WAIT``, up to 2 s; else the
    record waits and is tried again), or every replica the master has while fewer are connected (counted in
    ``turnstream_seal_keys_unreplicated_total``): with Redis Sentinel, 1, so that a failover cannot lose a key that
    records were sealed under (Redis copies to replicas asynchronously). docs/security.md."""
    retention_days: list[str] = msgspec.field(default_factory=list)
    """How long each topic keeps records, overriding the defaults (docs/design.md, "Events and topics"): entries
    ``<topic>=<days>``, ``-1`` for forever, e.g. ``turns=365,samples=14`` (``TURNSTREAM_KAFKA_RETENTION_DAYS``).
    ``turnstream topics create`` applies them to existing topics too. ``weights`` always keeps its latest version."""
    replication_factor: NonNegInt = 0
    """Copies of each partition that ``turnstream topics create`` asks for; 0: as many as the cluster has brokers,
    at most 3 (read from the cluster when the topics are made)."""
    min_insync_replicas: NonNegInt = 0
    """``min.insync.replicas`` of the topics it makes: how many copies must have a record before a producer's
    acks=all write succeeds (every turnstream producer waits for all in-sync copies); 0: one fewer than the
    replication factor, at least 1 (2 of 3: one broker may be down and nothing acknowledged is lost)."""

    def client_env(self) -> dict[str, str]:
        """What a process started to work on the same records needs, as ``TURNSTREAM_KAFKA_*`` variables (those
        set): the brokers, the login, the namespace and where the records' sealing keys are named. Not the keys'
        Redis: a service reaches it as its own Redis user."""
        values = {name: getattr(self, name) for name in KAFKA_CLIENT_FIELDS}
        return {f"TURNSTREAM_KAFKA_{name.upper()}": str(v) for name, v in values.items() if v is not None}

    def replication(self, brokers: int) -> tuple[int, int]:
        """(replication factor, min.insync.replicas) for new topics on a cluster of ``brokers``."""
        factor = self.replication_factor or min(3, brokers)
        if factor > brokers:
            raise ValueError(
                f"replication_factor: {factor} copies need {factor} brokers; the cluster has {brokers}"
            )
        insync = self.min_insync_replicas or max(1, factor - 1)
        if insync > factor:
            raise ValueError(f"min_insync_replicas: {insync} is more than the {factor} copies kept")
        return factor, insync

    def __post_init__(self) -> None:
        if not self.bootstrap.strip():
            raise ValueError("bootstrap: must name at least one host:port")
        self.namespace = normalize_namespace(self.namespace)
        self.retention_ms()  # refuses a malformed entry now, not when topics are created
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and not (self.sasl_mechanism and self.sasl_username and self.sasl_password):
            raise ValueError(
                f"security_protocol: {self.security_protocol} needs sasl_mechanism, sasl_username and sasl_password"
            )
        if not sasl and self.sasl_mechanism:
            raise ValueError("sasl_mechanism: set security_protocol to SASL_PLAINTEXT or SASL_SSL to use it")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError(
                "ssl_certfile: a client certificate needs ssl_keyfile too (and the other way round)"
            )

    def in_namespace(self, namespace: str) -> KafkaConfig:
        """The same cluster and settings, topics (and consumer groups) in ``namespace``; validated like the config's
        own."""
        return msgspec.convert({**msgspec.to_builtins(self), "namespace": namespace}, KafkaConfig)

    def retention_ms(self) -> dict[str, int]:
        """Topic base name -> ``retention.ms`` for the topics ``retention_days`` names."""
        out: dict[str, int] = {}
        for entry in self.retention_days:
            topic, _, days = entry.partition("=")
            topic = topic.strip()
            if topic not in BY_BASE or BY_BASE[topic].compacted:
                known = ", ".join(t.base for t in ALL_TOPICS if not t.compacted)
                raise ValueError(f"retention_days: {entry!r}: no such topic; one of {known}")
            try:
                value = float(days)
            except ValueError:
                raise ValueError(f"retention_days: {entry!r}: days must be a number (-1: forever)") from None
            if value != -1 and not value > 0:
                raise ValueError(f"retention_days: {entry!r}: days must be positive, or -1 for forever")
            out[topic] = -1 if value == -1 else round(value * DAY_MS)
        return out


class RedisConfig(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    """The Redis server (``redis://`` or ``rediss://`` with TLS; a password in it is masked by ``config show``)."""
    key_prefix: str = "turnstream:"
    """Prefix of every key turnstream writes, so pipelines (or a test) can share one Redis."""
    session_ttl_s: PositiveInt = 30 * 86400
    """How long a session's turn counter outlives its last turn. Every key turnstream writes expires; this is
    the longest-lived. A session continued after it restarts its numbering (new turn ids ``<session>:1``, ...), so
    keep it above ``dispatcher.dedupe_ttl_s`` and ``pairer.state_ttl_s``."""

    @property
    def pairer_idle_key(self) -> str:
        """The pairer's sorted set of open sessions (by last turn time): also read by a replay to know when
        every session has ended."""
        return f"{self.key_prefix}pairer:idle"

    def eval_hold_key(self, version: int) -> str:
        """Set, with an expiry, by ``turnstream eval`` while it evaluates ``version``: the proxy's reloader leaves an
        engine serving that version alone until the key is deleted or expires."""
        return f"{self.key_prefix}eval:hold:{version}"

    def reload_lease_key(self, engine_url: str) -> str:
        """Held, with an expiry, by the one proxy reloader that may pause, load or continue the policy engine at
        ``engine_url`` (services/proxy/engine_lease.py): every proxy names the engine by the same URL."""
        return f"{self.key_prefix}reload:lease:{engine_url.rstrip('/')}"


class EngineConfig(_Section):
    """The policy engine the proxy serves from: SGLang 0.5.23's HTTP API (``turnstream engine`` starts one)."""

    url: str = "http://127.0.0.1:30000"
    """The policy engine's base URL."""
    replicas: list[str] = msgspec.field(default_factory=list)
    """Several policy servers' base URLs (``TURNSTREAM_ENGINE_REPLICAS=http://a:30000,http://b:30000``), each
    serving the same versions: the proxy routes between them (``proxy.routing``) and reloads each. Empty: ``url``
    alone."""
    api_key: str | None = None
    """SGLang's ``--api-key``: ``turnstream engine`` starts the engine with it and every turnstream client of the
    policy engine sends it (generation, scoring, info). ``turnstream run`` makes one; compose takes
    ``ENGINE_API_KEY``."""
    admin_api_key: str | None = None
    """SGLang's ``--admin-api-key``: the only key its admin routes take (weight updates, pauses, LoRA adapters,
    cache flushes); the proxy's reloader sends it, no other service holds it. ``turnstream engine`` refuses to
    listen beyond loopback without both keys."""
    timeout_s: PositiveFloat = 120.0
    """One HTTP call to an engine (generation included) may take this long; also the eval service's and the proxy's."""
    retries: NonNegInt = 3
    """Retries of an engine call that failed in a way that is safe to repeat (no connection, or a 5xx/429 to an
    idempotent call), with exponential backoff."""

    def __post_init__(self) -> None:
        names = [replica_name(url) for url in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replicas: each must be a different host:port, got {self.replicas}")

    @property
    def urls(self) -> list[str]:
        """Every policy replica's base URL (``url`` when ``replicas`` is empty)."""
        return list(self.replicas) or [self.url]


def replica_name(url: str) -> str:
    """A policy replica's name in metrics and in the turns it answers: its ``host:port``."""
    from urllib.parse import urlsplit

    return urlsplit(url).netloc or url


class ProxyConfig(_Section):
    host: str = "127.0.0.1"
    """Where the proxy listens; beyond loopback it requires ``api_key`` or ``keys_file``."""
    port: Port = 8000
    """The proxy's port (the OpenAI API at ``/v1``)."""
    api_key: str | None = None
    """When set (or ``keys_file``), clients must send ``Authorization: Bearer <key>`` for the API, ``/v1/models``
    and ``/metrics`` (``/healthz`` answers anyone, its details only with a key). Without either the proxy starts
    only on a loopback address."""
    keys_file: str = ""
    """One key per user: lines ``<user id> <key>`` (keys of 16 characters or more) or ``<user id>
    sha256:<hex digest>`` (what ``turnstream keys add`` writes); keep it 0600. Read again when it changes."""
    keys_reload_s: PositiveFloat = 2.0
    """How often the proxy looks whether ``keys_file`` changed: a key added or revoked takes effect within this,
    without a restart; a file it cannot use leaves the keys it had (``turnstream_proxy_keys_reloads_total``)."""
    served_model_name: str = "turnstream-policy"
    """The model name ``/v1/models`` lists and responses carry; requests may name any model (``side_models`` aside)."""
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    """The largest request body (side turns; main turns have ``max_turn_bytes``): larger is a 413."""
    max_turn_bytes: PositiveInt = 3 * 1024 * 1024
    """The largest main-turn request body: a main turn is recorded, and its record (request, answer, token ids and
    log-probs) must stay under ``MAX_TURN_BYTES`` (4 MiB, a quarter of Kafka's record limit, so that the pairing
    and judgment embedding it fit too). Larger is a 413 before the engine is asked; at most 4 MiB."""
    max_messages: PositiveInt = 10_000
    """The most messages one request may hold: more is a 400 (a body of half a million empty messages is cheap to
    send and dear to check)."""
    max_values: PositiveInt = 200_000
    """The most JSON values and keys one request body may hold (an empty array or object counts twice), counted
    from its bytes before anything is decoded: more is a 400 ``too_many_values``. What a body costs is its values,
    not its bytes (8 MiB of ``[],`` is 2.8 million lists); a long agent conversation holds tens of thousands."""
    max_extra_bytes: PositiveInt = 64 * 1024
    """The most bytes a request may hold in fields SGLang's chat API does not read (``metadata``, a client's own
    extras): they are forwarded, and more is a 413 ``extra_fields_too_large`` naming the largest."""
    media_url_prefixes: list[str] = msgspec.field(default_factory=list)
    """Where images, video and audio in a request's content parts (``image_url``, ``video_url``, ``audio_url``;
    the Responses and Messages APIs' images become those) may come from: a URL must start with one of these
    (``https://images.example.com/``). Inline ``data:`` URIs are always taken; any other URL or path is a 400
    ``media_url_not_allowed``: SGLang fetches ``http(s)://`` itself and reads ``file://`` and paths ending in an
    image extension from its own disk, so a client could make it request internal addresses or read its files."""
    max_requests_per_key: PositiveInt = 256
    """Requests one key may have in flight at once (each holds a connection): more is a 429 with Retry-After, so
    one key holder cannot take every connection or the engine's whole queue."""
    large_body_bytes: PositiveInt = 1024 * 1024
    """A body larger than this is large (and so is one of more than 20,000 JSON values, dear to decode): a key may
    send only ``large_bodies_per_key`` at once."""
    large_bodies_per_key: PositiveInt = 2
    """Large bodies one key may have in flight at once: one more is a 429 with Retry-After (before its body is read
    when its length says it is large), so one key cannot fill the proxy's memory and time with bodies being read
    and parsed. With one key shared by many people, raise it, or give each a key of their own
    (``keys_file``)."""
    head_timeout_s: PositiveFloat = 10.0
    """A request's head (request line and headers) must arrive within this of the connection opening or of the
    previous response ending, else the connection is closed (``runtime/transport/guard.py``): a client that
    sends half a request holds no connection for long. Idle keep-alive connections close after it too."""
    body_timeout_s: PositiveFloat = 60.0
    """A request's whole body must arrive within this of its head, else a 408 and the connection closes."""
    max_head_bytes: PositiveInt = 64 * 1024
    """The largest request head: more is a 431 and the connection closes."""
    max_connections: PositiveInt = 1024
    """Open client connections at most: past it the connection that has waited longest for a request head is
    closed to make room (``reason="evicted"``), or, when every one is busy with a request, the new one is refused
    (``turnstream_http_connections_refused_total{reason="connection_limit"}``)."""
    max_connections_per_address: NonNegInt = 256
    """Open connections from one client address at most, made room for the same way (its own longest-waiting one
    closes first), so that one address cannot hold them all. 0: no cap per address; set it so behind a load
    balancer or reverse proxy, where every client comes from its address."""
    spool_dir: str = ""
    """Durable local spool every turn passes through before Kafka; empty: under the cache directory."""
    spool_max_bytes: NonNegInt = 0
    """The spool's cap: turns not yet acknowledged by Kafka, in bytes. Past it (or while the spool cannot be
    written) main turns are refused or served unrecorded (``spool_full``), counted and logged. 0: half the free
    space of the spool's filesystem when the proxy starts."""
    spool_full: Literal["refuse", "serve"] = "refuse"
    """A full spool: ``refuse`` answers main turns 503 ``spool_full`` (with Retry-After; side turns are served),
    so nothing served goes unrecorded; ``serve`` answers them and records nothing, counted in
    ``turnstream_proxy_turns_dropped_total{reason="spool_full"}``."""
    spool_stop_timeout_s: PositiveFloat = 30.0
    """At a stop, how long to keep trying to write turns that only exist in memory (the spool's disk failed)
    before giving them up, logged and counted (``reason="unwritten_at_stop"``)."""
    spool_linger_ms: NonNegInt = 200
    """Turns gather this long before one fsync and one Kafka batch take them all: the user never waits on it, and
    at low traffic it is what keeps recording cheap (a turn lives only in memory for this long)."""
    default_turn_type: Literal["main", "side"] = "main"
    """A request without ``X-Turn-Type`` (or ``turn_type`` in the body): ``main``, recorded and trained on, so a
    plain OpenAI client teaches the model; ``side``, forwarded and never recorded, is OpenClaw-RL's choice, for
    agents whose untagged calls are housekeeping."""
    side_models: list[str] = msgspec.field(default_factory=list)
    """Model names whose requests are ``side`` turns unless they say otherwise: for clients that cannot send
    ``X-Turn-Type``, give their housekeeping calls (titles, summaries, compaction) a model entry of this name
    (docs/clients.md). The engine serves them as usual."""
    missing_session: Literal["generate", "reject"] = "generate"
    """A main turn without a session id: ``generate`` records it under the session it continues (see
    ``session_inference``) or a new one, the id returned in the ``X-Session-Id`` response header; ``reject``
    answers 400."""
    session_inference: Literal["on", "off"] = "on"
    """A main turn without a session id continues the session whose last answer its history repeats
    (``services/proxy/continuity.py``, docs/clients.md); off: every such turn starts a session of its own."""
    session_link_ttl_s: PositiveInt = 7 * 86400
    """How long an answer can still be continued by a request without a session id."""
    stored_response_ttl_s: NonNegInt = 7 * 86400
    """How long a Responses API answer made with ``store`` (its default) can be continued by
    ``previous_response_id``; 0: nothing is kept (such a continuation is then a 404)."""
    stored_responses_per_key: PositiveInt = 10_000
    """The most stored responses one key keeps at once: storing one more drops its oldest (whose continuation is
    then a 404). With one shared key (``api_key``) that is the whole deployment's."""
    stored_bytes_per_key: PositiveInt = 512 * 1024 * 1024
    """The most bytes of stored responses one key keeps in Redis at once, the oldest dropped first (a stored
    conversation itself is bounded by ``max_body_bytes`` plus one answer)."""
    weights_root: str = ""
    """Weight versions are loaded only from below this folder; empty: the cache's ``weights`` folder."""
    tokenizer_path: str = ""
    """Tokenizer for re-tokenizing when an engine returns no token ids (counted as a mismatch metric)."""
    redis_timeout_ms: PositiveInt = 250
    """How long a request waits on Redis (turn numbers, session resolution) before it is served without it, logged:
    Redis trouble never fails a user's request."""
    reload: bool = True
    """Run the weight reloader in the proxy process (one proxy per engine should)."""
    reload_timeout_s: PositiveFloat = 600.0
    """How long one weight load may take before the reloader checks ``/model_info`` and tries again."""
    reload_lease_s: PositiveFloat = 30.0
    """How long a reloader's hold on an engine's lease lasts unrenewed (renewed every third of it while it pauses,
    loads and continues). Every proxy checks each lease period that its engines are not left paused: a pause whose
    reloader died ends within two periods (services/proxy/engine_lease.py)."""
    version_probe_s: PositiveFloat = 2.0
    """How often the proxy reads the engine's weight version when idle (an engine restart is noticed within
    this); a completed stream triggers a probe at once (see services/proxy/versions.py)."""
    routing: Literal["affinity", "round_robin"] = "affinity"
    """With several policy replicas (``engine.replicas``): ``affinity`` sends a session's turns to the replica
    that holds its prefix (a new session to the least loaded one); ``round_robin`` each request to the next
    (services/proxy/replicas.py, docs/scaling.md)."""
    routing_secret: str | None = None
    """The key of the routing hash that places new sessions on equally loaded replicas: every proxy of a deployment
    must share it, and no client may know it (else it could pick session ids that all land on one replica).
    Unset: derived from ``engine.admin_api_key``, else ``engine.api_key``; with neither, the hash is unkeyed."""
    overload_abs: PositiveInt = 4
    """``affinity``: a session leaves its replica when that replica has this many more requests in flight than the
    least loaded one ..."""
    overload_rel: Annotated[float, Meta(ge=1.0)] = 1.5
    """... and this many times as many."""
    default_max_tokens: NonNegInt = 0
    """The most tokens an answer gets when its client sets no limit (Codex CLI and opencode set none); 0: the
    engine's (up to the context window). The value sent is recorded with the turn like the client's own."""
    sampling_defaults: Literal["model", "openai"] = "model"
    """The sampling values pinned on main turns whose client gave none, as SGLang's ``--sampling-defaults``:
    ``model`` reads the served model's generation_config.json (Qwen3: temperature 0.6, top_k 20, top_p 0.95),
    ``openai`` is temperature 1, top_p 1, top_k -1, min_p 0, repetition_penalty 1."""

    def __post_init__(self) -> None:
        from schemas.topics import MAX_TURN_BYTES

        if self.max_turn_bytes > MAX_TURN_BYTES:
            raise ValueError(
                f"max_turn_bytes: at most {MAX_TURN_BYTES} (a turn's record must fit), got "
                f"{self.max_turn_bytes}"
            )


class PairerConfig(_Section):
    idle_timeout_s: PositiveFloat = 1800.0
    """A session without a new turn for this long is over: its last turn gets a terminal pairing (no next state),
    counted as ``idle``."""
    sweep_interval_s: PositiveFloat = 5.0
    """How often the pairer looks for idle sessions."""
    group_id: str = "turnstream-pairer"
    """The pairer's Kafka consumer group."""
    state_ttl_s: PositiveFloat = 2 * 86400.0
    """A backstop: a session's open turn stays in Redis at most this long after it arrived, even when no idle
    sweep closes it (the pairer stopped for days). A state that expired unswept is counted
    (``turnstream_pairer_skipped_total{reason="state_expired"}``); its turn is still on ``turns`` for a replay.
    Must exceed ``idle_timeout_s``."""

    def __post_init__(self) -> None:
        if self.state_ttl_s <= self.idle_timeout_s:
            raise ValueError(
                f"pairer.state_ttl_s ({self.state_ttl_s:g}) must exceed pairer.idle_timeout_s"
                f" ({self.idle_timeout_s:g}): a session's state would expire before the sweep closes it"
            )


class JudgeConfig(_Section):
    judge_id: str = "default"
    """This judge group's id: its votes carry it, and it names the consumer group (``group_id``), so two ids vote
    side by side."""
    backend: str = "engine"
    """``engine`` (an LLM behind the engine API), ``rules`` (keyword rules, for tests and CPU demos) or a
    plugin's ``package.module:Class`` (docs/extending.md)."""
    engine_url: str = "http://127.0.0.1:30001"
    """The judge's engine (the ``engine`` backend), an OpenAI-compatible chat API."""
    model: str = ""
    """The model name sent to the judge engine (default: what it serves, read at start)."""
    m: PositiveInt = 1
    """Eval votes and hint votes per turn (OpenClaw's PRM_M; mode rl's default is 3, OpenClaw's)."""
    temperature: NonNegFloat = 0.6
    """Sampling temperature of each vote (OpenClaw's PRM_TEMPERATURE): above 0 so ``m`` votes can differ."""
    max_tokens: PositiveInt = 2048
    """Tokens per judge answer (OpenClaw's PRM_MAX_NEW_TOKENS; the modes' defaults are OpenClaw's: rl 4096, opd and
    combine 8192), enough for a reasoning judge to reach its verdict."""
    max_concurrency: PositiveInt = 8
    """Votes in flight per worker."""
    eval_mode: bool = True
    """Run eval votes (OpenClaw's OPENCLAW_EVAL_MODE); hint votes always run."""
    deadline_s: PositiveFloat = 300.0
    """Per vote: transient engine failures are retried until then; a vote still failing is recorded as failed."""
    prompts_dir: str = ""
    """Folder overriding any of eval|hint.system|user.txt (default: the templates shipped with turnstream)."""
    vote_parser: str = "services.judge.votes:parse_vote"
    """``(kind, text) -> (score, hint)``: reads one vote's text (docs/extending.md)."""
    max_state_chars: PositiveInt = 8000
    """Longer responses and next states are cut in the middle (head and tail kept) before judging."""
    max_batch: PositiveInt = 32
    """Paired turns per consumer batch; small enough that a batch finishes well inside Kafka's poll interval."""
    api_key: str | None = None
    """Bearer key sent to the judge engine (compose: ``ENGINE_API_KEY``)."""

    @property
    def group_id(self) -> str:
        """Each judge id is a consumer group of its own: a second judge group sees every paired turn."""
        return f"{JUDGE_GROUP_PREFIX}{self.judge_id}"


class TeacherConfig(_Section):
    engine_url: str = "http://127.0.0.1:30002"
    """The teacher's engine (SGLang), which scores the policy's response under the hint."""
    model: str = ""
    """The teacher model's name recorded with its scores (default: what the engine serves)."""
    tokenizer: str = ""
    """Folder or hub id of the teacher's tokenizer (default: the teacher engine's model path from
    /get_model_info). It must share the policy's vocabulary: the teacher scores the policy's exact token ids."""
    top_k: NonNegInt = 0
    """0: log-probs of the response tokens only; K > 0: also the teacher's top-K per position."""
    max_concurrency: PositiveInt = 1
    """Scoring calls in flight per worker (OpenClaw's OPENCLAW_OPD_TEACHER_LP_MAX_CONCURRENCY)."""
    judge_ids: list[str] = msgspec.field(default_factory=list)
    """Score accepted hints of these judges only (default: every judge)."""
    deadline_s: PositiveFloat = 300.0
    """Transient teacher-engine failures are retried until then, after which the batch is retried."""
    max_batch: PositiveInt = 16
    """Accepted hints per consumer batch."""
    group_id: str = "turnstream-teacher"
    """The teacher's Kafka consumer group."""
    api_key: str | None = None
    """Bearer key sent to the teacher engine (compose: ``ENGINE_API_KEY``)."""
    hint_template: str = ""
    """File whose text, with ``{hint}`` replaced by the hint, is appended to the turn's last user message
    (default: ``services/teacher/hint.txt``, OpenClaw-RL's)."""

    def __post_init__(self) -> None:
        if self.hint_template and not Path(self.hint_template).is_file():
            raise ValueError(f"hint_template: {self.hint_template} is not a file")


class DispatcherConfig(_Section):
    mode: str = "combine"
    """``rl``, ``opd``, ``combine`` or a mode a plugin registers (``schemas/modes.py``)."""
    decide: str = "services.dispatcher.rules:decide"
    """``(mode, eval_score, hint_accepted, session_has_effective_sample) -> kind | None`` (docs/extending.md)."""
    judge_ids: list[str] = msgspec.field(default_factory=lambda: ["default"])
    """The judge groups whose judgments a sample waits for (see ``judge_combine``)."""
    judge_combine: Literal["single", "majority"] = "single"
    """How the eval scores of several judge ids combine: the first id's, or their majority (ties give 0)."""
    join_timeout_s: PositiveFloat = 3600.0
    """A turn whose inputs are not all there this long after its first input is dropped (and counted)."""
    sweep_interval_s: PositiveFloat = 5.0
    """How often turns past ``join_timeout_s`` are looked for."""
    dedupe_ttl_s: PositiveFloat = 7 * 86400.0
    """How long a decided turn is remembered: redelivered or re-judged inputs within it never emit again."""
    claim_lease_s: PositiveFloat = 30.0
    """A sample claimed by a dispatcher that died before confirming it is checked against ``samples`` (and
    emitted if missing) once the claim is this old."""
    group_id: str = "turnstream-dispatcher"
    """The dispatcher's Kafka consumer group."""

    def __post_init__(self) -> None:
        if not self.judge_ids or any(not j.strip() for j in self.judge_ids):
            raise ValueError("judge_ids: must list at least one non-empty judge id")
        try:
            mode_spec(self.mode)
        except UnknownMode as exc:
            raise ValueError(f"mode: {exc}") from None


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Hugging Face projections an adapter can target (Llama and Qwen3 names; PEFT's ``target_modules``)."""


class LoraConfig(_Section):
    """``trainer.lora``: train LoRA adapters on the frozen policy instead of all its weights (OpenClaw-RL's
    ``*_lora.sh`` defaults: rank 16, alpha 32, every attention and MLP projection). Environment:
    ``TURNSTREAM_TRAINER_LORA_<FIELD>``."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight (``turnstream run --lora``; docs/lora.md)."""
    rank: PositiveInt = 16
    """The adapters' rank (the engine's ``--max-lora-rank`` must be at least this)."""
    alpha: PositiveFloat = 32.0
    """The update is scaled by alpha / rank, as PEFT scales it."""
    dropout: Probability = 0.0
    """On the adapters' input in training (PEFT's ``lora_dropout``)."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    """The projections that get adapters (the engine's ``--lora-target-modules`` must include them)."""
    publish: Literal["adapter", "merged"] = "adapter"
    """Each version as a PEFT adapter (megabytes; the engine serves it on the base model) or as full weights with
    the adapter merged in (for engines without LoRA)."""
    seed: int = 1234
    """Seeds the adapters' A matrices (B starts at zero: the first version equals the base model)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"target_modules: {unknown or 'empty'}; choose from {', '.join(LORA_TARGETS)}")


class TrainerConfig(_Section):
    hf_checkpoint: str = ""
    """The policy's starting Hugging Face folder (OpenClaw's HF_CKPT)."""
    output_dir: str = ""
    """Where weight versions (``versions/v<N>``), checkpoints and step records go; empty: the cache's ``weights``
    folder. The policy engine loads versions from here."""
    rollout_batch_size: PositiveInt = 16
    """Samples per training step (one optimizer step, one weight version)."""
    lr: PositiveFloat = 1e-5
    """Adam's learning rate (constant)."""
    adam_beta1: Probability = 0.9
    """Adam's beta1."""
    adam_beta2: Probability = 0.98
    """Adam's beta2."""
    weight_decay: NonNegFloat = 0.1
    """AdamW's decoupled weight decay."""
    eps_clip: Probability = 0.2
    """The PPO ratio's lower clip: ratios below 1 - eps_clip are clipped."""
    eps_clip_high: NonNegFloat = 0.28
    """The PPO ratio's upper clip, 1 + eps_clip_high (asymmetric, as slime's; mode opd's default is 0.2)."""
    w_opd: NonNegFloat = 1.0
    """Weight of the distillation advantage (teacher - old log-prob) in combine (OpenClaw's OPENCLAW_COMBINE_W_OPD)."""
    w_rl: NonNegFloat = 1.0
    """Weight of the reward in combine's advantage (OpenClaw's OPENCLAW_COMBINE_W_RL)."""
    entropy_coef: NonNegFloat = 0.0
    """Weight of the entropy bonus (0: reported, not trained on)."""
    kl_coef: NonNegFloat = 0.0
    """Weight of the KL penalty from the reference (``reference_checkpoint``; 0: no reference is loaded)."""
    max_user_share: Annotated[float, Meta(gt=0, le=1)] = 0.25
    """The largest share of a step's samples one user may give (``ceil(share * rollout_batch_size)``, at least 1):
    one policy learns from everyone, so one person's flood of samples must not steer it for all. Theirs beyond it
    wait for later steps (deferred, never dropped). Lifted for a step, and counted, when no other user sent a
    sample within ``user_share_wait_s`` or the oldest has waited that long. A user is a session's owner under
    per-user keys (``proxy.keys_file``); the shared key's sessions are one user. 1: no cap."""
    user_share_wait_s: PositiveFloat = 300.0
    """How long a step waits for other users' samples to fill it within ``max_user_share`` before it takes the
    deferred ones (``turnstream_trainer_user_share_lifted_total{reason="waited"}``)."""
    max_staleness: NonNegInt = 4
    """A sample whose response came from weights more than this many steps behind the trainer's (counted along its
    lineage: after a restore, version numbers jump) is dropped (counted as ``stale``)."""
    clip_grad: NonNegFloat = 1.0
    """Gradients are clipped to this total norm (0: not clipped)."""
    group_id: str = "turnstream-trainer"
    """The trainer's Kafka consumer group (its committed offsets are where a restart resumes)."""
    max_steps: NonNegInt = 0
    """Stop after this many steps in this run (0: run until stopped)."""
    keep_versions: PositiveInt = 5
    """Published weight folders kept on disk (older ones are deleted; the engine has loaded them by then)."""
    checkpoint_every_steps: PositiveInt = 10
    """See ``checkpoint_every_s``."""
    checkpoint_every_s: PositiveFloat = 1800.0
    """A full checkpoint (every rank's model and optimizer state: 2 x DP + 12 bytes per parameter in bf16 with
    the distributed optimizer, 147 GB for 8B at DP 3) after this many steps or seconds since the last, whichever
    comes first, and at a clean stop. Weight versions are written every step; a restart replays the steps since
    the last full checkpoint from the samples topic (recorded per step)."""
    checkpoint_async: bool = True
    """Write full checkpoints in the background: the state is copied to host memory at the step boundary (one
    more copy of this rank's model and optimizer state while it is written) and training goes on."""
    micro_batch_tokens: PositiveInt = 8192
    """Forward/backward passes hold at most this many (padded) tokens; gradients accumulate across them."""
    max_sample_tokens: PositiveInt = 32768
    """The longest sample trained, prompt and response (agents' turns start at 10-12k tokens). A sample over
    ``micro_batch_tokens`` is a micro-batch of its own; the memory plan counts one of this length, so the trainer
    refuses at start a layout where it would not fit. Longer samples follow ``long_samples``."""
    long_samples: Literal["truncate", "drop"] = "truncate"
    """A sample over ``max_sample_tokens``, decided as it is read (services/trainer/lengths.py): ``truncate`` cuts
    its prompt's oldest tokens (the response and its log-probs untouched; counted as
    ``turnstream_trainer_truncated_total``), or drops it where the response alone is longer; ``drop`` drops it.
    A drop is counted (``turnstream_trainer_dropped_total{reason="too_long"}``) and logged."""
    recompute: Literal["auto", "none", "selective", "full"] = "auto"
    """Activation recompute (Megatron's): ``selective`` keeps no attention probabilities for backward (the
    sequence x sequence tensors, cheap to recompute); ``full`` keeps only each layer's input and reruns the layer
    in backward (activations of one layer at a time; on the CPU a step of 8 samples of 150-900 tokens peaks at
    5.6-7.6 GB instead of 18-21 GB at the same speed; short batches take ~12% longer: bench/RESULTS.md); ``none``
    keeps everything. ``auto``: ``full`` on the CPU (where memory is what runs out), ``selective`` on GPUs."""
    reference_checkpoint: str = ""
    """Hugging Face folder of the frozen reference for the KL term (default: the starting policy). Loaded only
    when ``kl_coef`` > 0, and under LoRA only when set: the policy with its adapters off is the starting policy."""
    topk_coef: NonNegFloat = 0.0
    """Weight of the top-K distillation loss (samples carrying the teacher's top-K; see ``teacher.top_k``)."""
    tensor_parallel: PositiveInt = 1
    """Megatron's tensor-parallel size."""
    pipeline_parallel: PositiveInt = 1
    """Model-parallel sizes; data parallelism is the rest of torchrun's world size."""
    layer_spec: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Megatron-core's layer implementation: ``sdpa``, Megatron's local layer with torch's
    ``scaled_dot_product_attention`` (flash kernels: memory linear in the sequence, on GPUs and the CPU); ``te``,
    Transformer Engine's (fused attention, fused norm+linear; GPUs only, the ``te`` image installs it);
    ``local``, Megatron's own attention (a ``[b, heads, s, s]`` matrix per layer: for comparison and short
    sequences); ``auto``: ``te`` where Transformer Engine imports and CUDA is present, else ``sdpa``. All map to
    Hugging Face weights exactly."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """``auto``: bf16 on GPUs, fp32 on the CPU."""
    collective_timeout_s: PositiveFloat = 600.0
    """How long a step's tensor collective (NCCL on GPUs) waits for a peer before the rank fails. Ranks waiting
    for the next batch wait on a separate gloo group without a practical timeout, so idle traffic never trips it."""
    distributed_optimizer: bool = True
    """Megatron's distributed optimizer: the fp32 main weights and Adam's moments (12 of the ~18 bytes per
    parameter in bf16) sharded over data-parallel ranks; each rank checkpoints its shard. A checkpoint resumes
    only with the setting it was written with."""
    gpu_memory_gib: NonNegFloat = 0.0
    """Memory each trainer process may use (GiB); the trainer refuses at start a layout whose memory plan
    (``turnstream trainer plan``) needs more. 0: the GPU's free memory at start (no check on the CPU)."""
    old_logprobs: Literal["rollout", "recompute", "decoupled"] = "rollout"
    """pi_old in the PPO ratio and the OPD gap: ``rollout``, the log-probs the engine recorded (up to
    ``max_staleness`` versions old); ``recompute``, the weights about to be trained, by a no-grad forward before
    the update (slime's default, and so OpenClaw-RL's effective behaviour: ratio 1 on a batch's one step);
    ``decoupled``, recomputed for the clip with the rollout policy corrected by a truncated importance weight
    (``is_cap``), as in AReaL's decoupled PPO."""
    is_cap: PositiveFloat = 2.0
    """Truncation of the importance weight exp(recomputed - rollout) under ``decoupled`` (also what the step's
    ``is_truncated`` share counts)."""
    advantages: str = "services.trainer.advantages:by_mode"
    """``(samples, settings) -> one per-token advantage tensor per sample``, over the whole batch
    (docs/extending.md); the default applies each sample's mode's formula."""
    loss_terms: list[str] = msgspec.field(default_factory=lambda: ["pg", "entropy", "kl", "topk"])
    """Terms summed into the loss: built-in names or ``package.module:function`` (docs/extending.md)."""
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)

    @property
    def reference_copy(self) -> bool:
        """Whether the KL term loads a frozen model of its own (the memory plan counts it)."""
        return reference_copy(self.kl_coef > 0, self.lora.enabled, self.reference_checkpoint)


def reference_copy(kl: bool, lora: bool, reference_checkpoint: str) -> bool:
    """A KL term's reference is a second model, except under LoRA without a ``reference_checkpoint``: there the
    starting policy is the trained model with its adapters off (``trainer.lora.disabled``), as PEFT-based trainers
    take it, and costs no memory."""
    return kl and not (lora and not reference_checkpoint)


class EvalConfig(_Section):
    """``turnstream eval``: the held-out evaluation of each weight version the policy engine serves."""

    engine_url: str = ""
    """The policy engine (default: ``engine.url``); asked directly, never through the proxy."""
    personas: str = ""
    """Comma-separated persona names whose checks score the answers (default: all)."""
    max_tokens: PositiveInt = 64
    """Per answer, as the simulated users ask (``turnstream simulate --max-tokens``); with ``thinking`` on, room
    for the thinking as well (the GPU recipes: 1024)."""
    thinking: bool = False
    """The chat template's ``enable_thinking`` in every evaluation request (services/eval/asking.py): off, a
    reasoning model (Qwen3) answers at once, in ``content``, which is what is scored; on, it thinks first and the
    answer after ``</think>`` is scored (a reasoning parser on the engine separates them)."""
    concurrency: PositiveInt = 4
    """Held-out questions asked at once."""
    poll_s: PositiveFloat = 2.0
    """How often the engine's served version is checked."""
    sets: list[str] = msgspec.field(default_factory=list)
    """Evaluation set files (JSONL, ``runtime/pipeline/evalsets.py``) scored for each version beside the held-out set,
    each result on ``evals``; gates name them (docs/evaluation.md). Rubric checks ask ``judge.engine_url``."""
    hold_reload_s: NonNegFloat = 300.0
    """While a version is evaluated, the proxy's reloader waits (at most this long) before loading a newer one, so
    every version the engine serves is evaluated even when versions come faster than an evaluation takes (CPU
    runs): training traffic is served by the older version meanwhile (an evaluation takes seconds on a GPU,
    ~20 s on this CPU). 0: never wait; versions served too briefly are then skipped and counted."""


class GateConfig(_Section):
    """Guarded learning (docs/evaluation.md): a weight version is a candidate until its evaluations pass the gate,
    and only promoted versions are served."""

    enabled: bool = False
    """Off: every version the trainer publishes is served at once, as without a gate."""
    mechanism: Literal["adapter", "serve-then-check"] = "adapter"
    """How a candidate is evaluated before users rely on it: ``adapter`` (LoRA only): loaded beside the promoted
    adapter and evaluated by name, no user sees it first; ``serve-then-check`` (full weights, one server holds one
    set of weights): served, evaluated at once, and rolled back within that one evaluation when it fails; one
    candidate at a time, paced after a failure (``candidate_share``)."""
    candidate_share: Annotated[float, Meta(gt=0, le=1)] = 0.25
    """``serve-then-check``: after a candidate is rolled back, the next is tried only once users have been served
    the promoted version long enough that the failed candidate had at most this share of the time (0.25: a check
    of a minute, then three minutes on the promoted version). A trainer that publishes faster than a check keeps
    users on untested candidates otherwise (measured: 83% of turns under a bad signal). 1: the next at once."""
    check_timeout_s: PositiveFloat = 900.0
    """``serve-then-check``: a candidate still without a verdict this long after it was tried is superseded once a
    newer version waits (its weights could not be loaded, or no evaluation came), so the gate never stalls."""
    margin: NonNegFloat = 0.05
    """How far any score (each persona's or check's, and the overall share) may fall below the promoted version's."""
    heldout: bool = True
    """Gate on the held-out set (``turnstream eval``'s personas)."""
    sets: list[str] = msgspec.field(default_factory=list)
    """Evaluation set files (``eval.sets`` entries) whose scores the gate also requires."""
    figure_max: dict[str, float] = msgspec.field(default_factory=dict)
    """Upper bounds on the candidate's trainer figures (``WeightsPublished.figures``: e.g. ``{kl = 0.05}``, KL
    from the reference, or ``kl_rollout``); a figure the step did not report fails its bound."""
    max_mean_words: NonNegFloat = 0.0
    """Upper bound on the held-out answers' mean length in words (0: none): drift into long answers fails."""
    poll_s: PositiveFloat = 2.0
    """How often the gate reads ``weights``, ``evals`` and ``versions`` again and decides what is due."""
    restore_after: PositiveInt = 3
    """Consecutive rejected candidates after which the trainer restores the last promoted version's weights and
    optimiser state and trains on from there."""


class ConsoleConfig(_Section):
    """``turnstream console``: the web pages over a projection of the topics."""

    host: str = "127.0.0.1"
    """Where the console listens (loopback unless you put it behind your own proxy; see ``allowed_hosts``)."""
    port: Port = 8080
    """The console's port."""
    public_url: str = ""
    """Where people open the console (``http(s)://host:port``), for the login link it announces and ``turnstream run``
    prints; empty: ``http://<host>:<port>``. Compose sets it from ``CONSOLE_PORT``: in a container the console's
    own port is not the one published."""
    db_path: str = ""
    """The projection (SQLite); default: ``<cache>/console/<namespace or live>.sqlite3``. Delete it to rebuild."""
    tokenizer: str = ""
    """Folder of the policy's tokenizer, for the heat map's token texts (default: ``trainer.hf_checkpoint``)."""
    token: str = ""
    """Every route but ``/healthz`` requires it (``Authorization: Bearer <token>``, or the cookie ``/login?token=``
    sets). Empty: one kept in ``token`` beside the projection (made 0600 with a new token on first start). The
    login link is logged at start without the token, and printed whole on a terminal."""
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    """Host names the console answers to (others get a 421: DNS rebinding defence). Empty: localhost, 127.0.0.1,
    ::1 and ``host`` unless a wildcard; ``*`` for any (behind a proxy that checks them)."""

    def __post_init__(self) -> None:
        if self.public_url and not re.match(r"https?://[^/\s]+", self.public_url):
            raise ValueError(f"public_url: {self.public_url!r} is not an http(s)://host[:port] address")


class RunConfig(_Section):
    """``turnstream run``: the whole pipeline on one machine."""

    local_infra: bool = True
    """Start the local Kafka and Redis from ``scripts/`` (left running afterwards); false: use the configured ones."""
    engine_port: Port = 30000
    """The policy engine's port (``ENGINE_PORT`` for ``make run``)."""
    policy_replicas: Annotated[int, Meta(ge=1, le=8)] = 1
    """How many policy servers to start (``--policy-replicas``), the proxy routing between them: replica ``i``
    listens on ``engine_port + 100 * i``."""
    teacher_engine_port: Port = 30002
    """The judge/teacher engine's port."""
    metrics_port_base: Port = 9101
    """pairer, judge, teacher, dispatcher, trainer, simulate, eval and gate expose /metrics on this port and the
    seven after it."""
    judge_backend: str = "rules"
    """``rules`` on the CPU; ``engine`` judges with the teacher engine; or a plugin's ``package.module:Class``."""
    run_dir: str = ""
    """Where each service's log goes; empty: ``<cache>/run/<timestamp>``."""
    startup_timeout_s: PositiveFloat = 600.0
    """How long a service may take to become ready (an engine loading its model included) before the run gives up."""
    simulate: NonNegInt = 0
    """Simulated users to drive through the proxy (``turnstream simulate``); 0: none."""
    until_version: NonNegInt = 0
    """Stop cleanly once the held-out evaluation of this weight version (or a later one) is published (a learning
    run of a fixed length); 0: until Ctrl-C."""
    console: bool = True
    """Start ``turnstream console`` (on ``console.port``, loopback; its URL is in the banner)."""
    redis_users: bool = True
    """Each service logs in to Redis as an ACL user of its own, made for the run through ``redis.url`` (which must
    be allowed to: scripts/redis.sh's ``admin`` is) with the rules a deployment gets, and removed at the stop."""


class PluginsConfig(_Section):
    modules: list[str] = msgspec.field(default_factory=list)
    """Modules imported as the config loads, before anything is validated against what they register (a new
    dispatch mode); ``TURNSTREAM_PLUGINS_MODULES=my_lab.grpo,my_lab.judges``."""


class MetricsConfig(_Section):
    port: Port | None = None
    """Prometheus /metrics port for services without an HTTP server of their own."""
    host: str = "127.0.0.1"
    """Where that port listens: 0.0.0.0 for a Prometheus in another container (compose.yaml)."""


class LoggingConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """The least severe record logged."""
    format: Literal["json", "text"] = "json"
    """``json``: one object per line (for a log pipeline); ``text``: for people (``make run`` sets it)."""


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    pairer: PairerConfig = msgspec.field(default_factory=PairerConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)
    dispatcher: DispatcherConfig = msgspec.field(default_factory=DispatcherConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    console: ConsoleConfig = msgspec.field(default_factory=ConsoleConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    plugins: PluginsConfig = msgspec.field(default_factory=PluginsConfig)

    @property
    def lora_adapters(self) -> bool:
        """The policy engine serves the base model plus one LoRA adapter per version (``trainer.lora`` on, published
        as adapters): the proxy's reloader loads each with ``/load_lora_adapter`` and routes the policy's requests
        to the newest; eval asks it; requests that name no adapter (the judge's, the teacher's) get the base."""
        return self.trainer.lora.enabled and self.trainer.lora.publish == "adapter"

    def __post_init__(self) -> None:
        if not self.kafka.seal:
            self.kafka.seal_keys_url = ""
        elif not self.kafka.seal_keys_url:
            self.kafka.seal_keys_url = self.redis.url
        longest = max(self.dispatcher.dedupe_ttl_s, self.pairer.state_ttl_s)
        if self.redis.session_ttl_s <= longest:
            raise ValueError(
                f"redis.session_ttl_s ({self.redis.session_ttl_s}) must exceed dispatcher.dedupe_ttl_s and"
                f" pairer.state_ttl_s ({longest:g}): a session's numbering would restart while its old turn ids"
                " are still remembered"
            )
        if self.gate.enabled and self.gate.mechanism == "adapter" and not self.lora_adapters:
            raise ValueError(
                "gate.mechanism = 'adapter' evaluates a candidate adapter beside the promoted one: it needs"
                " trainer.lora.enabled with publish = 'adapter'; with full weights use 'serve-then-check'"
            )
        if missing := sorted(set(self.gate.sets) - set(self.eval.sets)):
            raise ValueError(f"gate.sets {missing} are not scored: add them to eval.sets")
        spec = mode_spec(self.dispatcher.mode)
        if spec.needs_eval and not spec.needs_hint and not self.judge.eval_mode:
            raise ValueError(
                f"judge.eval_mode: off, so no eval votes, and mode {spec.name!r} learns from nothing else; turn"
                " eval_mode on (OPENCLAW_EVAL_MODE=1) or choose a mode that distills (opd, combine)"
            )


SECTIONS: dict[str, type[_Section]] = {
    name: field.type.cls
    for name, field in ((f.name, f) for f in msgspec.inspect.type_info(Config).fields)  # type: ignore[attr-defined]
}

OPENCLAW_ALIASES: dict[str, tuple[str, str]] = {
    "OPENCLAW_COMBINE_W_OPD": ("trainer", "w_opd"),
    "OPENCLAW_COMBINE_W_RL": ("trainer", "w_rl"),
    "KL_LOSS_COEF": ("trainer", "kl_coef"),
    "HF_CKPT": ("trainer", "hf_checkpoint"),
    "PRM_M": ("judge", "m"),
    "PRM_TEMPERATURE": ("judge", "temperature"),
    "PRM_MAX_NEW_TOKENS": ("judge", "max_tokens"),
    "OPENCLAW_EVAL_MODE": ("judge", "eval_mode"),
    "OPENCLAW_OPD_TEACHER_LP_MAX_CONCURRENCY": ("teacher", "max_concurrency"),
    "SGLANG_API_KEY": ("engine", "api_key"),
    "SERVED_MODEL_NAME": ("proxy", "served_model_name"),
}
"""OpenClaw-RL's variable names and the fields they set. ``TURNSTREAM_*`` wins when both are set."""

# Variables under the prefix that are not config fields.
_NOT_FIELDS = {"CONFIG", "CACHE", "KEEP_SERVICES"}


def _field_kinds(section: type[msgspec.Struct]) -> dict[str, str]:
    """Field name -> 'list' for list-typed fields (comma-separated in the environment), else 'scalar'."""
    kinds: dict[str, str] = {}
    for f in msgspec.inspect.type_info(section).fields:  # type: ignore[attr-defined]
        kinds[f.name] = "list" if isinstance(f.type, msgspec.inspect.ListType) else "scalar"
    return kinds


def _nested(section: type[_Section], field: str, where: str) -> tuple[str, str, dict[str, str]] | None:
    """(sub-section field, its field, that one's kinds) when ``field`` names a field of a nested section."""
    for f in msgspec.inspect.type_info(section).fields:  # type: ignore[attr-defined]
        inner = f.type
        if isinstance(inner, msgspec.inspect.StructType) and field.startswith(f.name + "_"):
            sub = field[len(f.name) + 1 :]
            kinds = _field_kinds(inner.cls)
            if sub in kinds:
                return f.name, sub, kinds
            raise ConfigError(f"{where}: unknown field of {f.name}; known: {', '.join(sorted(kinds))}")
    return None


def _env_value(raw: str, kind: str) -> Any:
    if kind == "list":
        return [part.strip() for part in raw.split(",") if part.strip()]
    return raw


def _from_env(env: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Settings from the environment and, per dotted field, the variable it came from."""
    data: dict[str, dict[str, Any]] = {}
    source: dict[str, str] = {}
    for alias, (section, field) in OPENCLAW_ALIASES.items():
        if alias in env:
            kind = _field_kinds(SECTIONS[section])[field]
            data.setdefault(section, {})[field] = _env_value(env[alias], kind)
            source[f"{section}.{field}"] = f"${alias}"
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :]
        if rest in _NOT_FIELDS:
            continue
        section, _, field = rest.lower().partition("_")
        if section not in SECTIONS or not field:
            continue
        kinds = _field_kinds(SECTIONS[section])
        nested = _nested(SECTIONS[section], field, f"{section}.{field} (${var})")
        if nested is not None:  # TURNSTREAM_TRAINER_LORA_RANK -> trainer.lora.rank
            name, sub, sub_kinds = nested
            data.setdefault(section, {}).setdefault(name, {})[sub] = _env_value(raw, sub_kinds[sub])
            source[f"{section}.{name}.{sub}"] = f"${var}"
            continue
        if field not in kinds:
            raise ConfigError(f"{section}.{field} (${var}): unknown field; known: {', '.join(sorted(kinds))}")
        data.setdefault(section, {})[field] = _env_value(raw, kinds[field])
        source[f"{section}.{field}"] = f"${var}"
    return data, source


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _field_of(exc: msgspec.ValidationError) -> str:
    msg = str(exc)
    marker = "- at `$."
    return msg[msg.rindex(marker) + len(marker) : -1] if marker in msg else ""


def _origin(source: Mapping[str, str], field: str) -> str:
    return f" ({source[field]})" if field in source else ""


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build the validated config. ``path`` defaults to ``$TURNSTREAM_CONFIG``, then ``./turnstream.toml``."""
    env = os.environ if env is None else env
    file_data: dict[str, Any] = {}
    source: dict[str, str] = {}
    chosen = path or env.get("TURNSTREAM_CONFIG")
    if chosen is None and Path("turnstream.toml").is_file():
        chosen = "turnstream.toml"
    if chosen is not None:
        p = Path(chosen)
        try:
            file_data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        for section, values in file_data.items():
            if isinstance(values, dict):
                for field in values:
                    source[f"{section}.{field}"] = str(p)
    env_data, env_source = _from_env(env)
    source.update(env_source)
    merged = _merge(file_data, env_data)
    if env.get("TRAIN_EPOCHS", "1").strip() != "1":
        raise ConfigError(
            f"trainer ($TRAIN_EPOCHS={env['TRAIN_EPOCHS']}): turnstream trains each sample once, as it arrives;"
            " unset TRAIN_EPOCHS"
        )
    modules = merged.get("plugins", {}).get("modules", [])
    try:
        import_modules("plugins.modules", modules if isinstance(modules, list) else [modules])
    except PluginError as exc:
        raise ConfigError(f"{exc}{_origin(source, 'plugins.modules')}") from None
    mode = merged.get("dispatcher", {}).get("mode", DispatcherConfig.mode)
    if mode in MODES:  # a mode's defaults, under whatever the file or the environment set
        for key, value in MODES[mode].defaults.items():
            section, _, field = key.partition(".")
            values = merged.setdefault(section, {})
            if isinstance(values, dict):
                values.setdefault(field, value)
                source.setdefault(key, f"mode {mode}'s default")
    try:
        return msgspec.convert(merged, Config, strict=False)
    except msgspec.ValidationError as exc:
        field = _field_of(exc)
        origin = source.get(field) or source.get(field.split(".")[0], "")
        where = f" ({origin})" if origin else ""
        detail = str(exc).split(" - at `")[0]
        head, sep, tail = detail.partition(": ")
        if sep and "." not in field and field in SECTIONS and head in _field_kinds(SECTIONS[field]):
            field, detail = f"{field}.{head}", tail  # a section's own check names its field first
        elif sep and not field and head.partition(".")[0] in SECTIONS:
            field, detail = head, tail  # a check across sections (Config's) names its field first
        origin = source.get(field) or origin
        where = f" ({origin})" if origin else ""
        raise ConfigError(f"{field or 'config'}{where}: {detail}") from None


SECRET_FIELDS = ("api_key", "admin_api_key", "token", "sasl_password")


def redacted(config: Config) -> dict[str, Any]:
    """The configuration as plain data with every secret masked (API keys, the SASL password, the passwords in a
    Redis URL, a Sentinel URL's included): what ``turnstream config show`` prints, so it can be pasted into an issue."""
    data: dict[str, Any] = msgspec.to_builtins(config)
    for section in data.values():
        if isinstance(section, dict):
            for field in SECRET_FIELDS:
                if section.get(field):
                    section[field] = "***"
    for section, field in (("redis", "url"), ("kafka", "seal_keys_url")):
        data[section][field] = redacted_url(data[section][field])
    return data


def redacted_url(url: str) -> str:
    """``url`` with the password of its user and any ``*password=`` in its query masked. Read as text, not by
    ``urlsplit``: a Sentinel URL names several ``host:port`` pairs, which ``urlsplit`` cannot take apart."""
    import re

    url = re.sub(r"^([a-z+]+://[^:@/]*):[^@/]+@", r"\1:***@", url)
    return re.sub(r"([?&][a-z_]*password=)[^&]*", r"\1***", url)
