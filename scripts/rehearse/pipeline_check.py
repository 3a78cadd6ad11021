"""The rehearsal's checks of the pipeline itself, run inside turnstream's image on the compose network (Kafka
advertises ``kafka:9092``, which only that network resolves).

    python pipeline_check.py flow VERSION [--within S]   # turns recorded, paired, judged, taught, sampled, and
                                                          # weight versions up to VERSION published
    python pipeline_check.py lineage                      # every published version trained distinct samples
    python pipeline_check.py gate VERSION [--within S]   # with GATE_ENABLED: the gate decided VERSION (or a newer
                                                          # one) from its evaluation, and what users are served
    python pipeline_check.py counts                       # the topics' record counts as JSON (for down/up)
    python pipeline_check.py engine                       # every policy server holds the newest published
                                                          # version (or one published since)
                                                          # (with LoRA: as an adapter beside the base)
    python pipeline_check.py replicas PREFIX [HOST...]    # the turns of sessions named PREFIX* were answered by
                                                          # every policy replica (or only HOST...), each
                                                          # session by one
    python pipeline_check.py topics                       # every topic has the copies the brokers can give
    python pipeline_check.py kafka                        # no login reaches nothing; the judge's user may not
                                                          # write samples or read turns; a wrong password fails

Every check prints ``PASS <what>`` or ``FAIL <what>: <why>``; a failure exits 1. Settings come from the environment
compose gives turnstream's services (TURNSTREAM_KAFKA_*).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from runtime.configuration.config import load_config
from runtime.engine.client import adapter_name
from runtime.messaging.bus import read_topic
from runtime.pipeline.promotion import fold
from schemas.topics import (
    DEADLETTER,
    EVALS,
    JUDGMENTS,
    SAMPLES,
    TEACHER,
    TURNS,
    TURNS_PAIRED,
    VERSIONS,
    WEIGHTS,
    TopicSpec,
)
from services.proxy.reloader import gated_target

FLOW = (("turns recorded", TURNS), ("turns paired", TURNS_PAIRED), ("turns judged", JUDGMENTS))
failed = False


def check(ok: bool, what: str, why: str = "") -> None:
    global failed
    print(f"{'PASS' if ok else 'FAIL'} {what}" + ("" if ok else f": {why}"), flush=True)
    failed |= not ok


async def events(spec: TopicSpec) -> list[Any]:
    return [r.event async for r in read_topic(load_config().kafka, spec, skip_undecodable=True)]


async def counts() -> dict[str, int]:
    specs = (TURNS, TURNS_PAIRED, JUDGMENTS, TEACHER, SAMPLES, WEIGHTS, DEADLETTER)
    return {spec.base: len(await events(spec)) for spec in specs}


async def flow(version: int, within_s: float) -> None:
    """Wait (up to ``within_s``) until every stage has records and ``version`` is published, then report each."""
    deadline = time.monotonic() + within_s
    while True:
        seen = await counts()
        published = max((w.version for w in await events(WEIGHTS)), default=0)
        teacher_or_rl = seen[TEACHER.base] > 0 or all(s.kind == "rl" for s in await events(SAMPLES))
        done = all(seen[spec.base] for _, spec in FLOW) and seen[SAMPLES.base] and published >= version
        if (done and teacher_or_rl) or time.monotonic() > deadline:
            break
        await asyncio.sleep(5)
    for what, spec in FLOW:
        check(seen[spec.base] > 0, f"{what} ({seen[spec.base]})", "none within the time")
    kinds = sorted({s.kind for s in await events(SAMPLES)})
    check(seen[TEACHER.base] > 0, f"turns scored by the teacher ({seen[TEACHER.base]})", "none")
    check(seen[SAMPLES.base] > 0, f"samples dispatched ({seen[SAMPLES.base]}, kinds {kinds})", "none")
    check(published >= version, f"trained: weight version {published} published (wanted {version})", "")
    check(seen[DEADLETTER.base] == 0, "no dead letters", f"{seen[DEADLETTER.base]} records dead-lettered")


async def lineage() -> None:
    turns = [t.turn_id for t in await events(TURNS)]
    check(
        len(turns) == len(set(turns)) > 0,
        f"every turn recorded once ({len(turns)} turns)",
        f"{len(turns) - len(set(turns))} recorded twice",
    )
    published = await events(WEIGHTS)
    versions = [w.version for w in published]
    trained = [sid for w in published for sid in w.sample_ids]
    check(
        versions == list(range(1, len(versions) + 1)),
        f"versions announced once each, in order ({versions})",
        "a gap or a repeat",
    )
    check(
        len(trained) == len(set(trained)) > 0,
        f"no sample trained twice ({len(trained)} samples over {len(versions)} versions)",
        f"{len(trained) - len(set(trained))} repeated",
    )


async def gate(version: int, within_s: float) -> None:
    """The gate's verdict on ``version`` (or a newer candidate), from a held-out evaluation of that version, and
    the version users are served by the fold of every decision (the proxy's reloader reads the same fold)."""
    config = load_config()
    if not config.gate.enabled:
        check(True, "the gate stands by (GATE_ENABLED is not true): every version is served")
        return
    verdicts = ("promoted", "rejected", "rolled_back")
    deadline = time.monotonic() + within_s
    while True:
        decisions = await events(VERSIONS)
        decided = [d for d in decisions if d.by == "gate" and d.state in verdicts and d.version >= version]
        if decided or time.monotonic() > deadline:
            break
        await asyncio.sleep(5)
    if not decided:
        states = [(d.version, d.state) for d in decisions]
        check(False, f"the gate decided version {version} or a newer one", f"none within the time: {states}")
        return
    first = decided[0]
    evaluated = {e.version for e in await events(EVALS)}
    check(
        first.version in evaluated,
        f"the gate decided version {first.version} ({config.gate.mechanism}): {first.state}, {first.reason}",
        "no held-out evaluation of that version is on the evals topic",
    )
    promotion = fold(decisions)
    want_promoted = config.gate.margin >= 1.0  # no score can fall further: every evaluated candidate passes
    check(
        promotion.promoted >= version or not want_promoted,
        f"users are served version {promotion.serving} (promoted {promotion.promoted}, margin {config.gate.margin})",
        f"with margin {config.gate.margin} version {version} should have been promoted",
    )


async def replicas(prefix: str, only: list[str]) -> None:
    """Which replica answered each turn of the sessions named ``prefix*`` (``Turn.replica``): every one, or only
    the hosts named (the others down)."""
    from runtime.configuration.config import replica_name

    config = load_config()
    names = [replica_name(url) for url in config.engine.urls]
    wanted = [n for n in names if not only or n.split(":")[0] in only]
    turns = [t for t in await events(TURNS) if t.session_id.startswith(prefix)]
    answered = {name: sum(t.replica == name for t in turns) for name in names}
    by = "every policy replica" if not only else " and ".join(only)
    check(
        all(answered[n] for n in wanted) and sum(answered[n] for n in wanted) == len(turns) > 0,
        f"the turns of {prefix}* were answered by {by} ({answered})",
        f"{len(turns)} turns",
    )
    homes = {t.session_id: {u.replica for u in turns if u.session_id == t.session_id} for t in turns}
    moved = sorted(sid for sid, where in homes.items() if len(where) > 1)
    check(not moved, f"each of the {len(homes)} sessions stayed on one replica", f"moved: {moved}")


async def topics() -> None:
    """The copies each topic is kept in and its min.insync.replicas, as ``turnstream topics describe`` reads them."""
    from runtime.messaging.topics import describe_topics

    states = await describe_topics(load_config().kafka)
    copies = sorted({(s.replicas, s.configs.get("min.insync.replicas")) for s in states})
    check(
        len(states) > 0 and copies == [(3, "2")],
        f"{len(states)} topics, each kept in 3 copies, 2 in sync ({copies})",
        "a topic kept otherwise",
    )


async def kafka() -> None:
    """Kafka as deployed (docs/security.md): a client without a login reaches nothing; the judge's user may neither
    write ``samples`` (training past the dispatcher) nor read ``turns``; a wrong password is refused at once."""
    import os

    import msgspec
    from aiokafka.errors import TopicAuthorizationFailedError

    from runtime.messaging.bus import EventProducer, KafkaLoginRefused

    base = load_config().kafka
    judge = msgspec.structs.replace(
        base, sasl_username="judge", sasl_password=os.environ["KAFKA_PASSWORD_JUDGE"], connect_wait_s=20
    )
    anonymous = msgspec.structs.replace(
        base, security_protocol="PLAINTEXT", sasl_mechanism=None, sasl_username=None, sasl_password=None,
        connect_wait_s=10,
    )  # fmt: skip
    try:
        async with EventProducer(anonymous) as producer:
            await producer.send_raw(SAMPLES.name(base.namespace), b"{}", b"x")
        check(False, "Kafka refuses a client without a login", "it wrote to samples")
    except Exception as exc:
        check(True, f"Kafka refuses a client without a login ({type(exc).__name__})")
    async with EventProducer(judge) as producer:
        try:
            await producer.send_raw(SAMPLES.name(base.namespace), b"{}", b"x")
            check(False, "Kafka refuses the judge's user a write to samples", "written")
        except TopicAuthorizationFailedError:
            check(True, "Kafka refuses the judge's user a write to samples")
    try:
        n = len([r async for r in read_topic(judge, TURNS, skip_undecodable=True)])
        check(False, "Kafka refuses the judge's user the conversations in turns", f"it read {n} records")
    except TopicAuthorizationFailedError:
        check(True, "Kafka refuses the judge's user the conversations in turns")
    started = time.monotonic()
    try:
        async with EventProducer(msgspec.structs.replace(judge, sasl_password="not-the-password")):
            pass
        check(False, "Kafka refuses a wrong password at once", "logged in")
    except KafkaLoginRefused:
        took = time.monotonic() - started
        check(took < 15, f"Kafka refuses a wrong password at once ({took:.1f} s)", "it waited")


async def engine() -> None:
    """What the reloader made of the newest version, asked of every policy server itself."""
    config = load_config()
    for url in config.engine.urls:
        await engine_at(url)


async def engine_at(url: str) -> None:
    import httpx

    config = load_config()
    published = await events(WEIGHTS)
    if not published:
        check(False, "the policy server loaded a published version", "none published")
        return
    newest = max(published, key=lambda w: w.version)
    want = "peft-lora" if config.lora_adapters else "hf-safetensors"
    check(
        {w.format for w in published} == {want},
        f"versions are published as {want} ({newest.path})",
        str({w.format for w in published}),
    )
    auth = {
        "Authorization": f"Bearer {config.engine.api_key}"
    }  # compose gives the proxy the engine's API key
    async with httpx.AsyncClient(timeout=30, headers=auth) as http:
        deadline = time.monotonic() + 300
        while True:
            # the trainer goes on publishing: the newest asked for, or one published since, counts; under a gate
            # also the version its decisions say is served now (the gate tries one candidate at a time)
            gated = (
                gated_target(fold(await events(VERSIONS)), newest.version, config.gate.mechanism).serve
                if config.gate.enabled
                else newest.version
            )
            if config.lora_adapters:
                served = [m["id"] for m in (await http.get(url + "/v1/models")).json()["data"]]
                later = range(newest.version, newest.version + 1000)
                ok = any(adapter_name(v) in served for v in later) or (
                    gated > 0 and adapter_name(gated) in served
                )
            else:
                served = (await http.get(url + "/model_info")).json().get("weight_version")
                ok = served is not None and (
                    int(served) >= newest.version or (gated > 0 and int(served) == gated)
                )
            if ok or time.monotonic() > deadline:
                break
            await asyncio.sleep(3)
    what = "as a LoRA adapter beside the base" if config.lora_adapters else "from the shared volume"
    gate = f" (or version {gated}, which the gate has it serve)" if config.gate.enabled else ""
    check(ok, f"{url} holds version {newest.version} or newer{gate} {what} ({served})", "")
    # Its admin routes take the admin key alone, which only the proxy's reloader sends (issue 32, item 3).
    async with httpx.AsyncClient(timeout=30) as http:
        update = {"model_path": "/models", "weight_version": "999"}
        codes = [
            (await http.post(url + "/update_weights_from_disk", json=update, headers=headers)).status_code
            for headers in ({}, {"Authorization": f"Bearer {config.engine.api_key}"})
        ]
    check(codes == [401, 401], f"{url} refuses a weight update without its admin key", str(codes))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["flow"]:
        within = float(args[args.index("--within") + 1]) if "--within" in args else 900.0
        asyncio.run(flow(int(args[1]), within))
    elif args[:1] == ["gate"]:
        within = float(args[args.index("--within") + 1]) if "--within" in args else 900.0
        asyncio.run(gate(int(args[1]), within))
    elif args[:1] == ["lineage"]:
        asyncio.run(lineage())
    elif args[:1] == ["engine"]:
        asyncio.run(engine())
    elif args[:1] == ["replicas"]:
        asyncio.run(replicas(args[1], args[2:]))
    elif args[:1] == ["topics"]:
        asyncio.run(topics())
    elif args[:1] == ["kafka"]:
        asyncio.run(kafka())
    elif args[:1] == ["counts"]:
        print(json.dumps(asyncio.run(counts())))
    else:
        sys.exit(__doc__)
    sys.exit(1 if failed else 0)
