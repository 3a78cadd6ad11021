"""Publish -> served on every policy replica: the time from a ``WeightsPublished`` record to the moment the last
replica serves that version, through ``turnstream proxy`` and its reloaders, for one and two replicas, full
weights and LoRA adapters, side by side in one run. Prints one JSON object.

    .venv/bin/python bench/replica_versions.py [--rounds 3] [--modes full,lora]

Two SmolLM2 SGLang servers per mode (``turnstream engine``; ``--lora`` for adapters), Kafka and Redis
(bench/infra.py). For each replica count a proxy of its own serves the first N servers from a fresh namespace;
each round publishes the next version (full weights: SmolLM2 and a copy with scaled MLP down-projections in turn,
so the weights really change; LoRA: a PEFT adapter as the trainer writes it) and polls every server (full weights:
``/model_info``'s ``weight_version``; LoRA: the adapter listed in ``/v1/models``) every 20 ms until all serve it.
The ratio is two replicas over one: each replica has its own reloader, so the loads run side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from infra import Started, stop_started
from proxy import bench_kafka, start_proxy
from reload import perturbed_copy
from routing import wait_ready

from runtime.configuration.config import KafkaConfig
from runtime.engine.client import ADAPTER_PREFIX, adapter_name
from runtime.engine.model_store import fetch_smollm2
from runtime.messaging.bus import EventProducer
from runtime.messaging.topics import create_topics
from schemas import WeightsPublished
from schemas.topics import WEIGHTS
from services.engine.launch import EngineProcess


def adapters(model: Path, root: Path, count: int) -> list[Path]:
    """``count`` adapter versions as the trainer writes them (services/trainer/checkpoints.py)."""
    import torch

    from runtime.configuration.config import LoraConfig, TrainerConfig
    from services.trainer.checkpoints import TrainerStore
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    config = TrainerConfig(precision="fp32", lora=LoraConfig(enabled=True), hf_checkpoint=str(model))
    policy = Policy.from_hf(model, config)
    store = TrainerStore(root)
    return [
        store.write_version(v, policy.entries(), policy.hf_stream(), model, policy.version_files())[0]
        for v in range(1, count + 1)
    ]


async def serves(http: httpx.AsyncClient, url: str, version: int, lora: bool) -> bool:
    if lora:
        data = (await http.get(url + "/v1/models")).json()["data"]
        return any(m["id"] == adapter_name(version) for m in data)
    return str((await http.get(url + "/model_info")).json()["weight_version"]) == str(version)


async def publish_to_served(
    kafka: KafkaConfig, urls: list[str], version: int, path: Path, lora: bool
) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=60) as http:
        began = time.perf_counter()
        async with EventProducer(kafka) as producer:
            event = WeightsPublished(
                version=version,
                path=str(path),
                base_model="smollm2",
                step=version,
                created_at=time.time(),
                format="peft-lora" if lora else "hf-safetensors",
            )
            await producer.send(WEIGHTS, event, "policy")
        each: dict[str, float] = {}
        while len(each) < len(urls):
            for url in urls:
                if url not in each and await serves(http, url, version, lora):
                    each[url] = round(time.perf_counter() - began, 3)
            if time.perf_counter() - began > 300:
                raise TimeoutError(f"version {version} never reached {set(urls) - set(each)}")
            await asyncio.sleep(0.02)
    return {"all_s": max(each.values()), "first_s": min(each.values())}


def run_mode(mode: str, model: Path, rounds: int, logs: Path, started: Started) -> dict[str, object]:
    lora = mode == "lora"
    root = Path(tempfile.mkdtemp(prefix=f"turnstream-versions-{mode}-"))
    if lora:
        paths = adapters(model, root / "versions", rounds)
    else:  # both under the proxy's weights root (it loads nothing from elsewhere)
        paths = [Path(shutil.copytree(model, root / "base")), perturbed_copy(model, root / "perturbed")]
    flags = ["--lora"] if lora else []
    env = {"TURNSTREAM_TRAINER_LORA_ENABLED": "true"} if lora else {}
    engines = [
        EngineProcess(model, *flags, log=open(logs / f"{mode}-{i}.log", "w"), env=env, wait=False)
        for i in range(2)
    ]
    figures: dict[str, object] = {}
    try:
        for engine in engines:
            engine.wait_ready(engine.ready_path)
        bootstrap, redis_url, _, _ = bench_kafka(started)
        for n in (1, 2):
            urls = [e.url for e in engines[:n]]
            namespace = f"bench-versions-{mode}-{n}-{time.monotonic_ns()}."
            kafka = KafkaConfig(bootstrap=bootstrap, namespace=namespace)
            asyncio.run(create_topics(kafka))
            proc, port = start_proxy(
                urls[0],
                bootstrap,
                redis_url,
                namespace,
                {
                    "TURNSTREAM_ENGINE_REPLICAS": ",".join(urls) if n > 1 else "",
                    "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(root),
                    "TURNSTREAM_PROXY_VERSION_PROBE_S": "0.5",
                    **env,
                },
            )
            try:
                wait_ready(port)
                runs = [
                    asyncio.run(publish_to_served(kafka, urls, v, paths[(v - 1) % len(paths)], lora))
                    for v in range(1, rounds + 1)
                ]
            finally:
                proc.terminate()
                proc.wait(60)
            figures[f"{n}_replica{'s' if n > 1 else ''}"] = {
                "runs": runs,
                "median_all_s": round(statistics.median(r["all_s"] for r in runs), 3),
            }
            for engine in engines:  # the next proxy starts from the servers' starting weights (no adapter)
                if lora:
                    for entry in httpx.get(engine.url + "/v1/models", timeout=60).json()["data"]:
                        if entry["id"].startswith(ADAPTER_PREFIX):
                            httpx.post(
                                engine.url + "/unload_lora_adapter",
                                json={"lora_name": entry["id"]},
                                timeout=60,
                            ).raise_for_status()
                else:
                    httpx.post(
                        engine.url + "/update_weights_from_disk",
                        json={"model_path": str(model), "weight_version": "0"},
                        timeout=600,
                    ).raise_for_status()
    finally:
        for engine in engines:
            engine.stop()
    one, two = figures["1_replica"], figures["2_replicas"]
    assert isinstance(one, dict) and isinstance(two, dict)
    figures["ratio_two_over_one"] = round(two["median_all_s"] / one["median_all_s"], 3)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="full,lora")
    args = ap.parse_args()
    model = fetch_smollm2()
    logs = Path(tempfile.mkdtemp(prefix="turnstream-replica-versions-"))
    started: Started = []
    results: dict[str, object] = {"settings": vars(args)}
    try:
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, model, args.rounds, logs, started)
    finally:
        stop_started(started)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
