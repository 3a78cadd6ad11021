"""Building turns from what an engine returned: exact data when it is there, re-tokenization (counted) when
an engine returns no ids, and a counted drop, never padding, when counts disagree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from services.proxy.retokenize import Retokenizer
from services.proxy.turns import Completion, UnrecordableTurn, build_turn

BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Name a fruit."}],
    "temperature": 0.5,
    "max_tokens": 8,
    "stop": "\n",
}


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def turn_from(completion: Completion, retokenize: Any = None) -> Any:
    return build_turn(
        session_id="s",
        turn_index=3,
        body=BODY,
        completion=completion,
        model="m",
        created_at=1.7e9,
        session_done=False,
        fallback_version=4,
        retokenize=retokenize,
    )


def test_engine_data_is_recorded_as_given() -> None:
    c = Completion(
        content=["Apple"],
        token_ids=[10, 11],
        logprobs=[-0.1, -0.2],
        prompt_token_ids=[1, 2, 3],
        finish_reason="stop",
        weight_version=7,
    )
    t = turn_from(c)
    assert (t.turn_id, t.response_token_ids, t.response_logprobs, t.prompt_token_ids) == (
        "s:3",
        [10, 11],
        [-0.1, -0.2],
        [1, 2, 3],
    )
    assert t.weight_version == 7 and t.token_source == "engine"
    assert t.sampling.temperature == 0.5 and t.sampling.max_tokens == 8 and t.sampling.stop == ["\n"]


def test_a_response_without_a_version_gets_the_callers_label_and_sglangs_default_is_version_0() -> None:
    c = Completion(content=["x"], token_ids=[1], logprobs=[-0.1], prompt_token_ids=[1])
    assert turn_from(c).weight_version == 4, "a stream: labelled from the served-version history"
    data = {
        "choices": [
            {
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "stop",
                "prompt_token_ids": [1],
                "response_token_ids": [5],
                "meta_info": {"output_token_logprobs": [[-0.1, 5, "x"]]},
            }
        ],
        "metadata": {"weight_version": "default"},
    }
    assert turn_from(Completion.from_response(data)).weight_version == 0


def test_a_stream_is_collected_from_sglangs_chunks_with_the_ids_from_the_sglext_chunk() -> None:
    """SGLang 0.5.23's streamed shape: log-probs per chunk (the EOS's on a chunk without text), no ids until the
    last chunk before [DONE]."""
    c = Completion()
    lp = lambda x: {"content": [{"token": "t", "bytes": [116], "logprob": x, "top_logprobs": []}]}  # noqa: E731
    for chunk in (
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Ap"}, "logprobs": lp(-0.1)}]},
        {"choices": [{"index": 0, "delta": {"content": "ple"}, "logprobs": lp(-0.2)}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": None}, "logprobs": lp(-0.3)}]},
        {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
        {"choices": [], "usage": None, "sglext": {"input_ids": [1, 2, 3], "output_ids": [[10, 11, 2]]}},
    ):
        c.add_chunk(chunk)
    t = turn_from(c)
    assert t.prompt_token_ids == [1, 2, 3] and t.response_token_ids == [10, 11, 2]
    assert t.response_logprobs == [-0.1, -0.2, -0.3] and t.response.content == "Apple"
    assert t.finish_reason == "stop" and t.weight_version == 4


def test_missing_ids_are_retokenized_and_counted(smollm2_path: Path) -> None:
    retok = Retokenizer(str(smollm2_path))
    tok = retok.tokenizer
    text = "Apple, of course."
    ids = [*tok(text, add_special_tokens=False).input_ids, tok.eos_token_id]
    before = counter("turnstream_proxy_retokenized_total")
    c = Completion(content=[text], logprobs=[-0.5] * len(ids), finish_reason="stop")
    t = turn_from(c, retok)
    assert t.token_source == "retokenized" and t.response_token_ids == ids
    rendered = tok.apply_chat_template(BODY["messages"], add_generation_prompt=True, tokenize=False)
    assert t.prompt_token_ids == tok(rendered, add_special_tokens=False).input_ids
    assert counter("turnstream_proxy_retokenized_total") == before + 1


def test_count_mismatch_is_a_counted_drop_never_padding(smollm2_path: Path) -> None:
    c = Completion(content=["Apple"], token_ids=[10, 11, 12], logprobs=[-0.1], prompt_token_ids=[1])
    with pytest.raises(UnrecordableTurn) as info:
        turn_from(c)
    assert info.value.reason == "token_mismatch"
    with pytest.raises(UnrecordableTurn) as info:
        turn_from(Completion(content=["Apple"], logprobs=[-0.1]))
    assert info.value.reason == "no_token_ids"
