"""The README and docs/ stay true to the tree: every relative link names a file that exists (and a heading that
exists, for ``#anchors``), and every command they show in a code block is one that parses: ``turnstream``
command lines with turnstream's own argument parser, ``make`` targets against the Makefile, scripts and
benchmarks against the files, and every option shown for one of our Python scripts (in a code block or inline)
against that script's own ``--help``. Cheap, so it runs on every commit; what a command *does* is the other tests'
job."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import _parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "RESULTS.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    out: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, broken


def commands(page: Path) -> list[list[str]]:
    """The command lines of the page's bash code blocks, continuation lines joined, comments and variables off."""
    out = []
    for lang, body in FENCE.findall(page.read_text()):
        if lang not in ("bash", "sh", ""):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"\s(?:&&|\|\||;)\s", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words.pop(0)
                if words:
                    out.append(words)
    return out


MAKE_TARGETS = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_shown_parses(page: Path) -> None:
    bad = []
    for words in commands(page):
        head = words[0]
        if head.endswith("turnstream") and (head == "turnstream" or head.endswith("/turnstream")):
            args = [w for w in words[1:] if w not in ("...",)]
            if any(w.startswith(("<", "[")) or "|" in w for w in args):
                continue  # a template line (placeholders), not a runnable one
            try:
                _parser().parse_args(args)
            except SystemExit:
                bad.append(" ".join(words))
        elif head == "make":
            bad += [f"make {t}" for t in words[1:] if not t.startswith("-") and t not in MAKE_TARGETS]
        elif head in ("bash", "python", ".venv/bin/python") and len(words) > 1:
            script = next((w for w in words[1:] if not w.startswith("-")), "")
            if script.endswith((".sh", ".py")) and not (REPO / script).exists():
                bad.append(" ".join(words))
    assert not bad, bad


SCRIPT_SPAN = re.compile(r"`(?:\.venv/bin/python |python3? )?((?:bench|scripts)/[\w/.-]+\.py)((?: [^`]*)?)`")


def script_flags() -> dict[str, set[str]]:
    """The options the pages show for our Python scripts, in code blocks and in inline code, by script."""
    out: dict[str, set[str]] = {}
    for page in PAGES:
        spans = [(m.group(1), m.group(2)) for m in SCRIPT_SPAN.finditer(page.read_text())]
        spans += [(w[1], " ".join(w[2:])) for w in commands(page) if len(w) > 1 and w[1].endswith(".py")]
        for script, rest in spans:
            if script.startswith(("bench/", "scripts/")):
                out.setdefault(script, set()).update(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest))
    return {script: flags for script, flags in out.items() if flags}


@pytest.mark.parametrize(("script", "flags"), sorted(script_flags().items()), ids=lambda v: str(v)[:40])
def test_every_option_shown_for_a_script_is_in_its_help(script: str, flags: set[str]) -> None:
    """Runs the script's ``--help`` (it parses before doing anything) and finds each option the docs show."""
    assert (REPO / script).exists(), script
    out = subprocess.run(
        [sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    missing = {f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", out.stdout)}
    assert not missing, f"{script}: the docs show {sorted(missing)}, which its --help does not know"


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[gone](missing.md), [no heading](#nowhere), [fine](#title)\n\n"
        "```bash\nTURNSTREAM_X=1 turnstream run --no-such-flag\nmake no-such-target\n```\n"
    )
    assert links(page) == ["missing.md", "#nowhere", "#title"]
    assert anchors(page) == {"title"}
    assert commands(page) == [["turnstream", "run", "--no-such-flag"], ["make", "no-such-target"]]
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--no-such-flag"])
    assert "no-such-target" not in MAKE_TARGETS and "test" in MAKE_TARGETS
