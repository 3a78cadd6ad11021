from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.launch import EngineProcess
from services.model_store import fetch_qwen3_tokenizer, make_tiny_qwen3


@pytest.fixture(scope="session")
def qwen3_tokenizer_path() -> Path:
    return fetch_qwen3_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_path: Path) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


__all__ = ["EngineProcess"]
