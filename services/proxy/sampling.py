"""The sampling values a main turn is served with when its client gave none.

SGLang 0.5.23 fills a chat request's missing temperature, top_p, top_k, min_p and repetition_penalty from the model's
generation_config.json (``--sampling-defaults model``, its default), then from OpenAI's defaults. The proxy resolves
the same values once at start-up and sends them explicitly on every main turn: the engine then samples with exactly
what the Turn records, whatever its own defaults are.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("turnstream.proxy.sampling")

OPENAI_SAMPLING: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
"""SGLang's ``_DEFAULT_SAMPLING_PARAMS`` (protocol.py), the values when neither request nor model sets one."""


def model_sampling(model_path: str) -> dict[str, Any] | None:
    """The sampling keys SGLang takes from ``generation_config.json``, or None when the file cannot be read here."""
    try:
        config = json.loads((Path(model_path) / "generation_config.json").read_text())
    except FileNotFoundError:
        return {}  # SGLang too: no file, no model defaults
    except (OSError, ValueError):
        return None
    return {k: config[k] for k in OPENAI_SAMPLING if config.get(k) is not None}


def resolve_sampling_defaults(mode: str, model_info: dict[str, Any]) -> dict[str, Any]:
    """``mode`` as SGLang's ``--sampling-defaults``; ``model_info`` is the engine's ``/model_info``."""
    if mode != "model":
        return dict(OPENAI_SAMPLING)
    path = model_info.get("model_path")
    found = model_sampling(str(path)) if path and Path(str(path)).is_dir() else None
    if found is None:
        log.warning(
            "cannot read the served model's generation_config.json from here; main turns are sampled with "
            "OpenAI's defaults where the client gives none (set proxy.sampling_defaults = 'openai' to say so)",
            extra={"model_path": path},
        )
        found = {}
    return {**OPENAI_SAMPLING, **found}
