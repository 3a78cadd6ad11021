"""The live view's ordering: status.json is the commit point, so a reader that sees a status there can already
read the same progress line in ``turnstream run``'s output (the race behind a flaky CI run)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import load_config
from services.run import main
from services.run.progress import Progress


class _NoServices:
    services: tuple[object, ...] = ()

    def dead(self) -> list[tuple[str, int]]:
        return []


def test_each_status_is_written_after_its_line_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = asyncio.Event()
    turns = iter(range(1, 100))
    checked: list[int] = []

    async def scrape(
        http: httpx.AsyncClient, ports: dict[str, int], batch_size: int, headers: dict[str, dict[str, str]]
    ) -> Progress:
        assert headers["proxy"] == {"Authorization": "Bearer key-0123456789abcdef"}  # the proxy's key
        progress = Progress(turns=next(turns), batch_size=batch_size)
        if progress.turns == 3:
            stop.set()
        return progress

    real_write = main._write_status

    def write_status(path: Path, progress: Progress) -> None:
        real_write(path, progress)
        # What a reader polling status.json sees now, and what it reads in the output at that moment.
        seen = json.loads(path.read_text())
        assert f"turns {seen['turns']} |" in capsys.readouterr().err
        checked.append(seen["turns"])

    monkeypatch.setattr(main, "scrape", scrape)
    monkeypatch.setattr(main, "_write_status", write_status)
    monkeypatch.setattr(main.sys.stderr, "isatty", lambda: False)
    config = load_config(env={"TURNSTREAM_PROXY_API_KEY": "key-0123456789abcdef"})
    asyncio.run(asyncio.wait_for(main._watch(config, _NoServices(), tmp_path, stop), 30))  # type: ignore[arg-type]
    assert checked == [1, 2, 3]
