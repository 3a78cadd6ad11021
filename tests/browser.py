"""The console in a real browser: Playwright for Python driving Debian's Chromium (``scripts/chromium.sh``
installs it; PyPI's Playwright browser download needs hosts these machines cannot reach).

``check_console`` is what a person would check on a live pipeline: the overview shows non-zero rates, a session
opens, a turn shows its votes, its hint and a heat map with one cell per response token in the colour of that
token's teacher - rollout gap (computed here from the recorded events, not by the console's code), the versions
page draws its curve, unknown ids give 404 pages, and no page raises a JavaScript error. With
``TURNSTREAM_SCREENSHOTS=<dir>`` it also saves the screenshots docs/console.md shows.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import quote

from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright

from schemas import Judgment, TeacherScores, Turn

FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium keeps dialling Google's hosts, which this machine's closed network refuses.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    found = (
        os.environ.get("TURNSTREAM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    assert found, "no Chromium: run scripts/chromium.sh install (the test command does)"
    return found


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), args=FLAGS)
        try:
            yield browser
        finally:
            await browser.close()


def expected_rgba(gap: float) -> tuple[int, int, int, float]:
    """The heat map's colour for a teacher - rollout gap, as docs/console.md states it: green where
    the teacher prefers the token, red where it avoids it, opacity |gap| / 2 nats, saturating at 2."""
    alpha = round(min(abs(gap), 2.0) / 2.0, 2)
    return (0, 160, 0, alpha) if gap >= 0 else (200, 0, 0, alpha)


def parse_rgba(css: str) -> tuple[int, int, int, float]:
    numbers = [float(x) for x in re.findall(r"[\d.]+", css)]
    r, g, b = (int(n) for n in numbers[:3])
    return r, g, b, numbers[3] if len(numbers) > 3 else 1.0


class Visit:
    """One tab that records every JavaScript error of every page it opens."""

    def __init__(self, page: Page, base: str) -> None:
        self.page, self.base, self.errors = page, base, list[str]()
        self.expected_missing: set[str] = set()
        page.on("pageerror", lambda exc: self.errors.append(f"{page.url}: {exc}"))
        page.on("console", self._console)

    def _console(self, message: ConsoleMessage) -> None:
        # Chromium logs a 404 document as a failed resource: an error only where the test did not ask for one.
        if message.type == "error" and message.location.get("url") not in self.expected_missing:
            self.errors.append(f"{self.page.url}: {message.text} ({message.location.get('url')})")

    async def open(self, path: str, status: int = 200) -> None:
        if status in (401, 404):
            self.expected_missing.add(self.base + path)
        resp = await self.page.goto(self.base + path)
        assert resp is not None and resp.status == status, (path, resp and resp.status)


async def check_console(
    base: str,
    token: str,
    turn: Turn,
    teacher: TeacherScores,
    judgments: list[Judgment],
    screenshots: Path | None = None,
    within_s: float = 120,
) -> None:
    """``turn`` is a recorded turn with teacher scores (``teacher``) and its ``judgments``, all on the topics."""
    async with chromium() as browser:
        visit = Visit(await browser.new_page(viewport={"width": 1280, "height": 900}), base)
        page = visit.page
        page.set_default_timeout(90_000)  # a CI machine busy with the whole pipeline (page times: bench/)
        # No page without the token; the login link sets the cookie and lands on the overview.
        await visit.open("/", status=401)
        await visit.open(f"/login?token={token}")
        assert page.url == base + "/", page.url
        # Overview: every stage has records and the turns arrive at a non-zero rate.
        await visit.open("/")
        for stage in ("turns", "paired", "judged", "teacher", "samples", "versions"):
            total = await page.locator(f'[data-stage="{stage}"] .n').inner_text()
            assert int(total) > 0, (stage, total)
        rate = await page.locator('[data-stage="turns"] .muted').nth(1).inner_text()
        assert float(rate.split("/")[0]) > 0, rate
        if screenshots:
            await page.screenshot(path=str(screenshots / "console-overview.png"), full_page=True)
        # Sessions -> the session -> the turn, by clicking, as a person would. The projection may trail the
        # topics by a moment: the session list is reloaded until the turn's teacher scores are in.
        link = page.locator(f'a[href="/sessions/{quote(turn.session_id, safe="")}"]')
        deadline = time.monotonic() + within_s
        while True:
            await visit.open(f"/sessions?q={quote(turn.session_id)}")
            if await link.count():
                await link.first.click()
                await page.locator(f'a[href="/turns/{quote(turn.turn_id, safe="")}"]').click()
                if await page.locator(".heat .tok").count():
                    break
            assert time.monotonic() < deadline, f"{turn.turn_id} never showed its teacher scores"
            await page.wait_for_timeout(1000)
        assert page.url.endswith(f"/turns/{quote(turn.turn_id, safe='')}")
        # Each judge's votes, with their raw text, and the chosen hint.
        body = await page.locator("main").inner_text()
        for j in judgments:
            for v in j.votes:
                assert v.raw.strip()[:40] in body, (j.judge_id, v.raw[:80])
        assert f"Chosen hint ({teacher.judge_id}): {teacher.hint}" in body
        # The heat map: one cell per response token, each in its gap's colour.
        cells = page.locator(".heat").first.locator(".tok")
        assert await cells.count() == len(turn.response_token_ids)
        colours = await cells.evaluate_all("cells => cells.map(c => getComputedStyle(c).backgroundColor)")
        gaps = [t - r for t, r in zip(teacher.teacher_logprobs, turn.response_logprobs, strict=True)]
        for i, (css, gap) in enumerate(zip(colours, gaps, strict=True)):
            got, want = parse_rgba(css), expected_rgba(gap)
            assert got[:3] == want[:3] and abs(got[3] - want[3]) < 0.006, (i, gap, css, want)
        assert any(g > 0 for g in gaps) or any(g < 0 for g in gaps)
        if screenshots:
            await page.screenshot(path=str(screenshots / "console-turn.png"), full_page=True)
        # Versions: the held-out curve and the table.
        await visit.open("/versions")
        assert await page.locator('svg[aria-label="held-out score per version"]').count() == 1
        if screenshots:
            await page.screenshot(path=str(screenshots / "console-versions.png"), full_page=True)
        # Unknown ids are 404 pages, not errors.
        for missing in ("/turns/no-such-session:1", "/sessions/no-such-session", "/no/such/page"):
            await visit.open(missing, status=404)
            assert "Not found" in await page.locator("h1").inner_text()
        assert visit.errors == [], visit.errors
