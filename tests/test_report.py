"""The suite's bill (tests/report.py): how an SGLang server's command line is read, and how a restart is told from
a start."""

from __future__ import annotations

import pytest

from tests import report


def test_a_server_is_named_by_its_model_and_flags_and_other_processes_are_not_servers() -> None:
    argv = [
        "/x/python", "-m", "sglang.launch_server", "--model-path", "/m", "--port", "12001",
        "--served-model-name", "policy", "--api-key=k", "--enable-lora", "--reasoning-parser", "qwen3",
    ]  # fmt: skip
    assert report.engine_config(argv) == ("12001", "policy+enable-lora+reasoning-parser+api-key")
    assert report.engine_config(["/x/python", "-m", "services.cli", "proxy", "--port", "12001"]) is None


def test_a_configuration_started_again_on_its_port_is_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    bill = report.Bill()
    bill.starts = [
        report.EngineStart(1.0, "1", "a", "f"),
        report.EngineStart(2.0, "2", "a", "f"),
        report.EngineStart(3.0, "1", "a", "g"),
        report.EngineStart(4.0, "1", "b", "g"),
    ]
    monkeypatch.setattr(report, "BILL", bill)
    out = report.summary()
    assert [s["restart"] for s in out["engine_starts"]] == [False, False, True, False]
    assert out["engines"] == {"a": {"starts": 2, "restarts": 1}, "b": {"starts": 1, "restarts": 0}}
