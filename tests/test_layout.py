"""The layout is the architecture (README, Layout): checked on the source, so a shortcut shows up as a failing test.

- ``schemas/`` is the contract and imports nothing of ours;
- ``runtime/`` is what every service shares (messaging, configuration, engine access, process management,
  observability, security, the pipeline's shared rules): it imports ``schemas`` and itself, never a service;
- ``services/`` holds one folder per deployable service and the command-line entry point (``services/cli.py``,
  which starts them); a service imports ``schemas``, ``runtime`` and itself, never another service;
- no two of our modules import each other, directly or round a longer loop, imports only a type checker follows
  (under ``if TYPE_CHECKING:``) included: a reader follows them too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("schemas", "runtime", "services")
ENTRY_POINT = "services.cli"


def _modules() -> dict[str, Path]:
    out = {}
    for top in OURS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "standin" in parts:  # the sgl_kernel stand-in is SGLang's import, not ours
                continue
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
SERVICES = {name.split(".")[1] for name, path in MODULES.items() if path.parent.parent == ROOT / "services"}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imports(name: str, typing: bool = False) -> set[str]:
    """Our modules that ``name`` imports, at module level or inside functions (``typing``: and under
    ``if TYPE_CHECKING:``)."""
    tree = ast.parse(MODULES[name].read_text())
    skipped = set() if typing else _type_checking_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import module`` imports the module; ``from module import name`` the module.
            targets = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            targets = targets or [node.module]
        else:
            continue
        out |= {t for t in targets if t.split(".")[0] in OURS and t in MODULES and t != name}
    return out


GRAPH = {name: imports(name) for name in MODULES}
READ = {name: imports(name, typing=True) for name in MODULES}
"""What a reader follows: the imports, type-only ones included."""


def service_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 2 and parts[1] in SERVICES else None


def test_the_contract_imports_nothing_of_ours() -> None:
    bad = {(a, b) for a, bs in GRAPH.items() if a.startswith("schemas.") or a == "schemas" for b in bs}
    bad = {(a, b) for a, b in bad if not b.startswith("schemas")}
    assert not bad


def test_the_runtime_imports_no_service() -> None:
    bad = {
        (a, b)
        for a, bs in GRAPH.items()
        if a.split(".")[0] == "runtime"
        for b in bs
        if b.startswith("services")
    }
    assert not bad, "the shared runtime imports a service"


def test_services_import_no_other_service() -> None:
    assert {
        "proxy",
        "pairer",
        "judge",
        "teacher",
        "dispatcher",
        "trainer",
        "gate",
    } <= SERVICES  # the check sees them
    bad = set()
    for a, bs in GRAPH.items():
        if a.split(".")[0] != "services" or a == ENTRY_POINT:
            continue
        for b in bs:
            owner, target = service_of(a), service_of(b)
            if target is not None and target != owner:
                bad.add((a, b))
    assert not bad, "a service imports another service"


def test_services_holds_services_and_the_entry_point_only() -> None:
    """Anything shared lives in runtime/: at services/ root only the command line sits beside the service folders,
    and every service folder is a package."""
    loose = {p.name for p in (ROOT / "services").iterdir() if p.is_file()} - {"__init__.py", "cli.py"}
    assert not loose, f"shared code belongs in runtime/, not services/: {sorted(loose)}"
    folders = {p.name for p in (ROOT / "services").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == SERVICES, folders ^ SERVICES


def test_no_import_cycles() -> None:
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(READ[name]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_a_violation() -> None:
    """The graph is built from the real source: the shared runtime's known edges are there."""
    assert "runtime.transport.http_pool" in GRAPH["runtime.engine.client"]
    assert "runtime.configuration.config" in GRAPH["services.proxy.app"]
    assert "services.trainer.spec" in GRAPH["services.trainer.parallel"]
    assert "services.trainer.parallel" not in GRAPH["services.trainer.spec"]
    # a type-only import: followed by the cycle check, not by the import rules
    assert "services.trainer.batch" in READ["services.trainer.terms"]
    assert "services.trainer.batch" not in GRAPH["services.trainer.terms"]
