"""``turnstream engine`` and what turnstream relies on in the real SGLang 0.5.23 server it starts: the CPU
launch, the import-only kernel stand-in, the refusal that made the proxy change, the streamed ``sglext`` ids and
log-probs (complete up to the final EOS), and the version and parser report of ``/model_info``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from runtime.engine.client import EXACT_NON_STREAMED, EXACT_STREAMED
from services.engine.launch import CPU_FLAGS, STANDIN, EngineOptions, EngineProcess, sglang_command

QUESTION = [{"role": "user", "content": "Say just the word yes."}]


def test_the_cpu_command_has_the_cpu_flags_and_the_standin_and_the_gpu_command_neither() -> None:
    cpu, cpu_env = sglang_command(EngineOptions(model="/models/m", device="cpu", port=31234), python="py")
    gpu, gpu_env = sglang_command(EngineOptions(model="/models/m", device="cuda", port=31234), python="py")
    for argv, env in ((cpu, cpu_env), (gpu, gpu_env)):
        assert argv[:3] == ["py", "-m", "sglang.launch_server"]
        joined = " ".join(argv)
        assert "--model-path /models/m" in joined and "--port 31234" in joined
        assert (
            "--weight-version 0" in joined
            and "--enable-metrics" in joined
            and "--enable-cache-report" in joined
        )
        assert "--tool-call-parser qwen" in joined and "--served-model-name m" in joined
        assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert " ".join(CPU_FLAGS) in " ".join(cpu) and "--max-total-tokens 16384" in " ".join(cpu)
    assert cpu_env["SGLANG_USE_CPU_ENGINE"] == "1" and cpu_env["PYTHONPATH"].split(":")[0] == str(STANDIN)
    assert not {flag for flag in CPU_FLAGS if flag.startswith("--")} & set(gpu)
    assert "--max-total-tokens" not in gpu
    assert "SGLANG_USE_CPU_ENGINE" not in gpu_env and "PYTHONPATH" not in gpu_env


def test_the_engine_takes_both_keys_and_refuses_to_listen_beyond_loopback_without_them() -> None:
    """Issue 32, item 3: an engine reachable without keys lets anyone load weights from any path, load adapters or
    pause generation, bypassing the proxy's checks."""
    env = {**os.environ, "TURNSTREAM_SGLANG_PYTHON": sys.executable}
    for key in ("TURNSTREAM_ENGINE_API_KEY", "TURNSTREAM_ENGINE_ADMIN_API_KEY", "SGLANG_API_KEY"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "services.cli", "engine", "--model", "/models/m", "--print-command"]
    for extra in ([], ["--api-key", "k" * 20]):  # an API key alone leaves the admin routes on it
        out = subprocess.run([*cmd, "--host", "0.0.0.0", *extra], env=env, capture_output=True, text=True)
        assert out.returncode == 2 and "engine.admin_api_key" in out.stderr, out.stderr
    keys = {"TURNSTREAM_ENGINE_API_KEY": "a" * 20, "TURNSTREAM_ENGINE_ADMIN_API_KEY": "b" * 20}
    out = subprocess.run([*cmd, "--host", "0.0.0.0"], env={**env, **keys}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    argv = out.stdout.split()
    assert f"--api-key={'a' * 20}" in argv and f"--admin-api-key={'b' * 20}" in argv
    local = subprocess.run([*cmd, "--host", "127.0.0.1"], env=env, capture_output=True, text=True)
    assert local.returncode == 0 and "--api-key" not in local.stdout, local.stderr


def test_keys_that_start_with_a_dash_reach_sglangs_own_parser_whole() -> None:
    """token_urlsafe starts one key in 32 with "-": passed as two arguments, SGLang's argparse read it as an option
    and the engine refused to start (seen in the compose rehearsal: ``--admin-api-key: expected one argument``)."""
    api, admin = "-k" + "a" * 20, "--" + "b" * 20
    argv, env = sglang_command(
        EngineOptions(model="/models/m", device="cpu", api_key=api, admin_api_key=admin)
    )
    parse = (
        "import argparse, sys; from sglang.srt.server_args import ServerArgs; p = argparse.ArgumentParser();"
        " ServerArgs.add_cli_args(p); a = p.parse_args(sys.argv[1:]); print(a.api_key, a.admin_api_key)"
    )
    out = subprocess.run(
        [argv[0], "-c", parse, *argv[3:]],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [api, admin]


def test_the_kernel_standin_imports_anything_and_refuses_every_call() -> None:
    code = (
        "import sgl_kernel\n"
        "from sgl_kernel import silu_and_mul\n"
        "from sgl_kernel.kvcacheio import transfer_kv_direct\n"
        "from sgl_kernel.scalar_type import scalar_types\n"
        "assert scalar_types.uint4b8 is not None\n"
        "for f in (silu_and_mul, transfer_kv_direct):\n"
        "    try:\n"
        "        f(1, 2)\n"
        "    except sgl_kernel.StandInCalled as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(STANDIN)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 2
    assert "sgl_kernel.silu_and_mul" in out[0] and "sgl_kernel.kvcacheio.transfer_kv_direct" in out[1]
    assert all("cannot run it" in line for line in out)


def _chat(engine: EngineProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)


def test_sglang_refuses_token_ids_on_a_stream_and_the_proxy_never_asks_for_them(
    engine: EngineProcess,
) -> None:
    for flag in ("return_token_ids", "return_prompt_token_ids", "return_meta_info"):
        resp = _chat(engine, {"messages": QUESTION, "max_tokens": 2, "stream": True, flag: True})
        assert resp.status_code == 400, resp.text
        err = resp.json()
        assert (
            err["object"] == "error"
            and err["code"] == 400
            and "not supported with streaming" in err["message"]
        )
        assert flag not in EXACT_STREAMED


def _stream(engine: EngineProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_stream_gives_the_exact_ids_and_a_logprob_for_every_token_up_to_eos(engine: EngineProcess) -> None:
    """The last chunk before [DONE] has the ids (``sglext``); with a tool-call parser set (as ``turnstream engine``
    does) the final EOS keeps its log-prob. Both equal the non-streamed answer's."""
    body = {"messages": QUESTION, "max_tokens": 40, "temperature": 0}
    chunks = _stream(engine, {**body, "stream": True, **EXACT_STREAMED})
    full = _chat(engine, {**body, **EXACT_NON_STREAMED}).json()["choices"][0]
    assert full["finish_reason"] == "stop", "the question is answered before max_tokens: the EOS is sampled"
    ext = [c["sglext"] for c in chunks if "sglext" in c]
    assert (len(ext) == 1 and chunks[-1].get("sglext")) or chunks[-2].get("sglext")
    assert all(not c["choices"] for c in chunks if "sglext" in c)
    assert ext[0]["input_ids"] == full["prompt_token_ids"]
    assert ext[0]["output_ids"] == [full["response_token_ids"]]
    streamed = [
        e["logprob"]
        for c in chunks
        for ch in c["choices"]
        for e in (ch.get("logprobs") or {}).get("content", [])
    ]
    expected = [e[0] for e in full["meta_info"]["output_token_logprobs"]]
    assert len(streamed) == len(full["response_token_ids"]) == len(expected)
    assert max(abs(a - b) for a, b in zip(streamed, expected, strict=True)) < 1e-4
    assert all("metadata" not in c for c in chunks), "stream chunks carry no weight version"


def test_model_info_reports_the_version_and_parsers_and_metrics_are_served(engine: EngineProcess) -> None:
    info = httpx.get(engine.url + "/model_info", timeout=10).json()
    assert info["weight_version"] == "0" and info["tool_call_parser"] == "qwen"
    assert info["is_generation"] is True
    models = httpx.get(engine.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == info["served_model_name"]
    metrics = httpx.get(engine.url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "sglang:" in metrics.text


def test_smollm2_template_renders_as_transformers_does(engine: EngineProcess, smollm2_path: Path) -> None:
    data = _chat(engine, {"messages": QUESTION, "max_tokens": 1, "return_prompt_token_ids": True}).json()
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    expected = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert data["choices"][0]["prompt_token_ids"] == list(expected)


# What clients send: content-part lists (the OpenClaw app), a developer message.
PARTS = [
    {"role": "developer", "content": "Answer tersely."},
    {"role": "user", "content": [{"type": "text", "text": "Look at"}, {"type": "text", "text": "this:"}]},
    {"role": "assistant", "content": "Which file?"},
    {"role": "user", "content": [{"type": "text", "text": "the log,"}, {"type": "text", "text": "please"}]},
]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def test_turnstream_renders_content_parts_and_developer_messages_as_the_engine_does(
    engine: EngineProcess, smollm2_path: Path
) -> None:
    """The teacher, the proxy's re-tokenizer and replay import render prompts with ``render_prompt_ids``; the
    engine renders what the proxy forwards (``for_engine``). They must agree token for token. An image sent to
    a text-only model is refused by SGLang itself (400, which the proxy passes on): no such turn is recorded."""
    from runtime.engine.chat_template import for_engine, render_prompt_ids

    forwarded = for_engine(PARTS)
    assert [m["role"] for m in forwarded] == ["system", "user", "assistant", "user"]
    data = _chat(engine, {"messages": forwarded, "max_tokens": 1, "return_prompt_token_ids": True}).json()
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert render_prompt_ids(tok, PARTS) == data["choices"][0]["prompt_token_ids"]
    text = tok.decode(data["choices"][0]["prompt_token_ids"])
    assert "system\nAnswer tersely." in text and "Look at this:" in text and "user\nthe log, please" in text
    refused = _chat(engine, {"messages": [{"role": "user", "content": [IMAGE, PARTS[1]["content"][0]]}]})
    assert refused.status_code == 400 and "only supports text" in refused.json()["message"]
