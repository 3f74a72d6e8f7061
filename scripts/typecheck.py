#!/usr/bin/env python3
"""Type-check every ranklens package under its REAL module name (``make typecheck``).

The repository's top-level folders are installed as subpackages (``tracing/`` is
``ranklens.tracing``, see ``[tool.setuptools] package-dir`` in pyproject.toml). Plain ``mypy``
finds them by path, so it names them ``tracing.*`` / ``analyzers.*`` and cannot follow
``from ranklens.analyzers.findings import Finding`` into ``analyzers/findings.py``: with
``ignore_missing_imports`` every such name would silently become ``Any``. Here each file is given
to mypy as a ``BuildSource`` with its installed module name, so cross-package imports resolve to
the real definitions and ``tracing/`` is checked too.

Options (per-module strictness included) come from ``[tool.mypy]`` in pyproject.toml; the ground
floor (``ranklens.errors``, ``config``, ``schema``, ``records``, ``ranklens.formats.*``) is strict
there.

Usage: ``python scripts/typecheck.py [--root DIR] [EXTRA_FILE.py ...]``. Extra files are checked
as top-level modules beside the tree (tests/test_typecheck.py uses that for ``reveal_type``).
Exit status: 0 clean, 1 type errors, 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

# folder (relative to the repository root) -> the package it is installed as
PACKAGE_DIRS: dict[str, str] = {
    "ranklens": "ranklens",
    "tracing": "ranklens.tracing",
    "collector": "ranklens.collector",
    "analyzers": "ranklens.analyzers",
    "dashboards": "ranklens.dashboards",
}


def iter_modules(root: Path) -> Iterator[tuple[Path, str]]:
    """Every ``.py`` file of every package folder with the module name it is installed under, and
    every ``.pyi`` stub of a compiled module (``collector/_lines.pyi``: its C source's types).

    A folder without ``__init__.py`` (``ranklens/_bootstrap``: a sitecustomize copied into a
    site directory, never imported as ``ranklens._bootstrap``) is checked as a top-level module.
    """
    for folder, package in PACKAGE_DIRS.items():
        base = root / folder
        stubs = [p for p in base.rglob("*.pyi") if not p.with_suffix(".py").exists()]
        for path in sorted([*base.rglob("*.py"), *stubs]):
            rel = path.relative_to(base)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            parent_parts = rel.parts[:-1]
            folders = [base.joinpath(*parent_parts[: i + 1]) for i in range(len(parent_parts))]
            if not all((folder / "__init__.py").exists() for folder in folders):
                yield path, path.stem
                continue
            parts = [package, *parent_parts]
            if rel.name != "__init__.py":
                parts.append(rel.stem)
            yield path, ".".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("extra", nargs="*", type=Path, help="extra files, checked as top-level modules")
    args = parser.parse_args(argv)

    from mypy import build
    from mypy.main import process_options
    from mypy.modulefinder import BuildSource

    root: Path = args.root.resolve()
    config = root / "pyproject.toml"
    if not config.is_file():
        print(f"typecheck: no pyproject.toml under {root}", file=sys.stderr)
        return 2
    # The options exactly as `mypy` would read them from pyproject.toml; the sources are ours.
    _, options = process_options(["--config-file", str(config), str(root / "ranklens" / "__init__.py")])
    options.files = None
    sources = [BuildSource(str(path), module, None) for path, module in iter_modules(root)]
    for extra in args.extra:
        sources.append(BuildSource(str(extra.resolve()), extra.stem, None))

    messages: list[str] = []

    def flush(*args: object) -> None:
        # mypy calls flush_errors(new_messages, serious) or, since 1.x, (filename, new_messages, serious)
        new = args[-2]
        assert isinstance(new, list)
        messages.extend(new)
        for line in new:
            print(line)

    try:
        build.build(sources, options, flush_errors=flush, stdout=sys.stdout, stderr=sys.stderr)
    except Exception as exc:  # mypy's CompileError: the messages were already flushed
        if not messages:
            print(f"typecheck: mypy failed: {exc}", file=sys.stderr)
            return 2
    errors = [m for m in messages if ": error:" in m]
    n_files = len(sources)
    if errors:
        print(f"typecheck: {len(errors)} error(s) in {n_files} files", file=sys.stderr)
        return 1
    print(f"typecheck: no errors in {n_files} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
