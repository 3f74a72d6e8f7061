"""The floor plan holds: every import between ranklens' subsystems runs down a floor, never up or
sideways, and no two subsystems import each other.

The floors (lowest first) are in ``FLOORS``; docs/architecture.md draws the same plan. The test reads
every module's imports with ``ast`` (the ones inside functions too: a lazy import is still a
dependency), maps the source folders to their ``ranklens.*`` names as pyproject's package-dir does,
and fails naming each import that breaks the plan.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# folder -> the package it is installed as (pyproject.toml [tool.setuptools] package-dir)
FOLDERS = {
    "ranklens": "ranklens",
    "tracing": "ranklens.tracing",
    "collector": "ranklens.collector",
    "analyzers": "ranklens.analyzers",
    "dashboards": "ranklens.dashboards",
}

# Subsystem -> floor. A module belongs to the longest prefix listed here. A subsystem may import its
# own modules and any subsystem on a lower floor; nothing on its own floor or above.
FLOORS: dict[str, int] = {
    # 0, the ground: formats, records and small shared machinery (stdlib and third-party only)
    "ranklens.errors": 0,
    "ranklens.config": 0,
    "ranklens.schema": 0,
    "ranklens.records": 0,
    "ranklens.formats": 0,
    "ranklens._worker": 0,
    "ranklens._metrics_http": 0,
    "ranklens._guard": 0,
    "ranklens.otel": 0,
    # 1: what stands on the formats alone
    "ranklens.store": 1,
    "ranklens.tracing": 1,
    # 2: the node agent, the analyses and the record simulator
    "ranklens.collector": 2,
    "ranklens.analyzers": 2,
    "ranklens.simulate": 2,
    "ranklens._simulate_engine": 2,
    # 3: what acts on the analyses' findings, or draws them
    "ranklens.analyzers.recovery": 3,
    "ranklens.dashboards": 3,
    # 4: the application: CLI, launcher, live service, demo
    "ranklens": 4,
}

# Ground-floor modules that are one subsystem each but may import each other (errors is imported by
# config, records by schema users ...): the ground counts as one room.
GROUND_ROOM = "ground"


def _module_name(folder: str, path: Path) -> str:
    rel = path.relative_to(ROOT / folder).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([FOLDERS[folder], *parts])


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[_module_name(folder, path)] = path
    return found


def _subsystem(module: str) -> str:
    best = ""
    for prefix in FLOORS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return GROUND_ROOM if FLOORS.get(best) == 0 else best


def _floor(subsystem: str) -> int:
    return 0 if subsystem == GROUND_ROOM else FLOORS[subsystem]


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
        for name in names:
            # the module itself, or the package it names a member of
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def _edges() -> dict[tuple[str, str], set[str]]:
    known = _modules()
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for module, path in known.items():
        for target in _imports(module, path, known):
            a, b = _subsystem(module), _subsystem(target)
            if a != b:
                edges[(a, b)].add(f"{module} imports {target}")
    return edges


def test_every_module_is_on_a_floor() -> None:
    unplaced = [m for m in _modules() if not _subsystem(m)]
    assert not unplaced, f"modules outside the floor plan (add them to FLOORS): {unplaced}"


def test_imports_run_down_the_floors() -> None:
    wrong = []
    for (a, b), why in sorted(_edges().items()):
        if _floor(b) >= _floor(a):
            wrong.extend(sorted(why))
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(wrong)


def test_no_two_subsystems_import_each_other() -> None:
    edges = _edges()
    loops = sorted({tuple(sorted((a, b))) for (a, b) in edges if (b, a) in edges})
    assert not loops, f"subsystems that import each other: {loops}"


@pytest.mark.parametrize(
    ("module", "floor"),
    [("ranklens.formats", 0), ("ranklens.store.api", 1), ("ranklens.analyzers.blame", 2), ("ranklens.cli", 4)],
)
def test_the_plan_places_known_modules(module: str, floor: int) -> None:
    # the mapping above is what the two tests before rely on: pin a few of its answers
    assert _floor(_subsystem(module)) == floor


def test_the_reader_sees_lazy_imports(tmp_path: Path) -> None:
    # an import inside a function is a dependency too; the reader must not miss it
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from ranklens.store.api import Store\n    return Store\n")
    known = {"ranklens.store.api": source, "ranklens.x": source}
    assert _imports("ranklens.x", source, known) == {"ranklens.store.api"}
