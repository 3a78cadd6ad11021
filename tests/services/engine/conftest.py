from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engine.launch import EngineProcess
from services.model_store import fetch_qwen3_tokenizer, fetch_smollm2, make_tiny_qwen3


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return fetch_smollm2(log=False)


@pytest.fixture(scope="session")
def qwen3_tokenizer_path() -> Path:
    return fetch_qwen3_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_path: Path) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def engine(smollm2_path: Path) -> Iterator[EngineProcess]:
    """One shared SmolLM2 engine for tests that do not change its weights."""
    proc = EngineProcess(smollm2_path)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def hf_model(smollm2_path: Path):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


__all__ = ["EngineProcess"]
