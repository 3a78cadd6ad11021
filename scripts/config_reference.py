"""docs/configuration.md's reference, generated from the config classes (runtime/configuration/config.py), so
it cannot drift.

    .venv/bin/python scripts/config_reference.py            # rewrite docs/configuration.md
    .venv/bin/python scripts/config_reference.py --check    # exit 1 when it differs (tests/scripts)

The page's text above the marker is written by hand and kept. Below it, every field of every section: its type, its
default (and the modes that change it), its environment variable and the docstring written under it in
runtime/configuration/config.py. The docstrings are read from the source (Python keeps no attribute docstrings at
run time); the defaults from the classes themselves."""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime.configuration.config import ENV_PREFIX, OPENCLAW_ALIASES, SECTIONS  # noqa: E402
from schemas.modes import MODES  # noqa: E402

SOURCE = REPO / "runtime" / "configuration" / "config.py"
TARGET = REPO / "docs" / "configuration.md"
MARKER = (
    "<!-- Generated below by scripts/config_reference.py from runtime/configuration/config.py (tests/scripts checks"
    " it): edit the docstrings there, then run .venv/bin/python scripts/config_reference.py."
    " Above: written by hand. -->"
)


class Field(msgspec.Struct, frozen=True):
    name: str
    annotation: str
    doc: str


def classes(source: str) -> dict[str, tuple[str, list[Field]]]:
    """Class name -> (its docstring, its annotated fields in order with the docstring under each)."""
    out: dict[str, tuple[str, list[Field]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: list[Field] = []
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                after = body[i + 1] if i + 1 < len(body) else None
                doc = (
                    after.value.value
                    if isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                    else ""
                )
                fields.append(Field(stmt.target.id, ast.unparse(stmt.annotation), doc))
        out[node.name] = (ast.get_docstring(node) or "", fields)
    return out


def one_line(text: str) -> str:
    """A docstring as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def shown(value: Any) -> str:
    if value == "" or value == [] or value == {}:
        return "(empty)" if value == "" else f"`{json.dumps(value)}`"
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (int, float, str)):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def mode_defaults() -> dict[str, list[str]]:
    """``section.field`` -> "mode value" for each built-in mode that sets it."""
    out: dict[str, list[str]] = {}
    for mode in MODES.values():
        for key, value in mode.defaults.items():
            out.setdefault(key, []).append(f"{mode.name} {shown(value)}")
    return out


def render() -> str:
    """The generated part, from ``MARKER`` on."""
    parsed = classes(SOURCE.read_text())
    by_mode = mode_defaults()
    aliases = {f"{s}.{f}": alias for alias, (s, f) in OPENCLAW_ALIASES.items()}
    lines = [
        MARKER,
        "",
        "## Reference",
        "",
        "Every setting, where it comes from and what it does. A setting is read, latest winning, from its default,",
        "the dispatch mode's default (`dispatcher.mode`: the modes that change a field are named beside its default),",
        "a TOML file (`--config`, `$TURNSTREAM_CONFIG`, else `./turnstream.toml`; one `[section]` per heading below,",
        "`[trainer.lora]` for the nested one) and the environment: `TURNSTREAM_<SECTION>_<FIELD>` in capitals, a list",
        "comma-separated. OpenClaw-RL's own variable names are read too (named beside their field); a `TURNSTREAM_`",
        "variable wins over them. `turnstream config show` validates the whole and prints what a service would run",
        "with, secrets masked.",
        "",
    ]
    for section, cls in SECTIONS.items():
        doc, fields = parsed[cls.__name__]
        lines += [f"## `[{section}]`", ""]
        if doc:
            lines += [one_line(doc), ""]
        lines += ["| field | type | default | environment | what |", "| --- | --- | --- | --- | --- |"]
        defaults = msgspec.to_builtins(cls())
        for f in fields:
            nested = SECTIONS.get(section) and parsed.get(f.annotation)
            if nested and f.annotation.endswith("Config"):
                continue  # a nested section: its own table below
            lines.append(row(section, f, defaults.get(f.name), by_mode, aliases))
        for f in fields:
            if f.annotation.endswith("Config") and f.annotation in parsed:
                sub_doc, sub_fields = parsed[f.annotation]
                sub = getattr(cls(), f.name)
                sub_defaults = msgspec.to_builtins(sub)
                lines += ["", f"### `[{section}.{f.name}]`", ""]
                if f.doc or sub_doc:
                    lines += [one_line(f.doc or sub_doc), ""]
                lines += [
                    "| field | type | default | environment | what |",
                    "| --- | --- | --- | --- | --- |",
                ]
                for g in sub_fields:
                    lines.append(row(f"{section}.{f.name}", g, sub_defaults.get(g.name), by_mode, aliases))
        lines.append("")
    return "\n".join(lines)


def row(section: str, f: Field, default: Any, by_mode: dict[str, list[str]], aliases: dict[str, str]) -> str:
    key = f"{section}.{f.name}"
    env = f"`{ENV_PREFIX}{key.replace('.', '_').upper()}`"
    if key in aliases:
        env += f", `{aliases[key]}`"
    value = shown(default)
    if key in by_mode:
        value += " (mode " + ", ".join(by_mode[key]) + ")"
    return (
        f"| `{f.name}` | `{f.annotation.replace('|', chr(92) + '|')}` | {value} | {env} | {one_line(f.doc)} |"
    )


def page(current: str) -> str:
    """The page: its hand-written part (above ``MARKER``) kept, the rest generated."""
    head = current.split(MARKER, 1)[0] if MARKER in current else "# Configuration\n\n"
    return head + render()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="exit 1 when docs/configuration.md is not what it generates"
    )
    args = ap.parse_args()
    current = TARGET.read_text() if TARGET.exists() else ""
    text = page(current)
    if not args.check:
        TARGET.write_text(text)
        print(f"wrote {TARGET.relative_to(REPO)}")
        return 0
    if current == text:
        return 0
    sys.stdout.writelines(
        difflib.unified_diff(
            current.splitlines(keepends=True), text.splitlines(keepends=True), str(TARGET), "generated"
        )
    )
    print(
        f"\n{TARGET.relative_to(REPO)} is stale: run .venv/bin/python scripts/config_reference.py",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
