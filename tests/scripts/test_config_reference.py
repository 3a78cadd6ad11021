"""docs/configuration.md is what scripts/config_reference.py generates from runtime/configuration/config.py: every field
documented, every environment variable it names one that really sets that field."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import msgspec

from runtime.configuration.config import SECTIONS, ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `(\w+)` \| `(.+?)` \| (.+?) \| `(TURNSTREAM_\w+)`")


def test_the_committed_reference_is_what_the_classes_generate() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr


def test_every_field_of_every_section_is_documented() -> None:
    # Loaded from its file: scripts/ on sys.path would make its sglang/ folder the package `import sglang` finds.
    spec = importlib.util.spec_from_file_location(
        "config_reference", REPO / "scripts" / "config_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    SOURCE, classes = module.SOURCE, module.classes

    parsed = classes(SOURCE.read_text())
    undocumented = [
        f"{cls.__name__}.{f.name}"
        for cls in {
            *SECTIONS.values(),
            *(type(getattr(c(), n)) for c in SECTIONS.values() for n in _nested(c)),
        }
        for f in parsed[cls.__name__][1]
        if not f.doc.strip() and not f.annotation.endswith("Config")
    ]
    assert undocumented == []


def _nested(cls: type) -> list[str]:
    return [
        f.name
        for f in msgspec.inspect.type_info(cls).fields  # type: ignore[attr-defined]
        if isinstance(f.type, msgspec.inspect.StructType)
    ]


def test_each_variable_the_reference_names_sets_its_field() -> None:
    rows = [
        m.groups()
        for line in (REPO / "docs/configuration.md").read_text().splitlines()
        if (m := ROW.match(line))
    ]
    fields = sum(len(msgspec.inspect.type_info(c).fields) for c in SECTIONS.values())  # type: ignore[attr-defined]
    assert len(rows) >= fields - 1  # every field a row (the nested section is a table of its own)
    checked = 0
    for name, annotation, _, variable in rows:
        if annotation not in ("str", "PositiveInt", "NonNegInt", "PositiveFloat", "NonNegFloat", "Port"):
            continue
        value = {"str": "x-set", "Port": "1234"}.get(annotation, "7")
        section, _, rest = variable.removeprefix("TURNSTREAM_").lower().partition("_")
        dotted = f"{section}.{rest.removesuffix('_' + name)}.{name}" if rest != name else f"{section}.{name}"
        try:
            config = load_config(env={variable: value})
        except ConfigError as exc:  # refused by the field's own check: it reached the field
            assert dotted in str(exc), (variable, exc)
            checked += 1
            continue
        target = getattr(config, section)
        if rest != name:  # a nested section: TURNSTREAM_TRAINER_LORA_RANK
            target = getattr(target, rest.removesuffix("_" + name))
        assert value in str(getattr(target, name)), variable
        checked += 1
    assert checked > 100
