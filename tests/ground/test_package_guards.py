"""The top-level folders (tracing/, collector/, ...) import only under their installed names.

From the repository root ``import tracing`` would otherwise load tracing/__init__.py a second
time as a different module, with its own tracer singleton (issue 13).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ["tracing", "collector", "analyzers", "dashboards"]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # cwd = the repository root and sys.path[0] = '' (python -c): the bare folder names resolve
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("folder", FOLDERS)
def test_bare_folder_import_fails_naming_the_installed_package(folder: str) -> None:
    proc = _run(
        f"import importlib.util, sys\n"
        f"spec = importlib.util.find_spec({folder!r})\n"
        f"assert spec is not None and spec.origin.endswith('{folder}/__init__.py'), spec\n"
        f"import {folder}\n"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:"), proc.stderr
    assert f"import ranklens.{folder}`" in last
    assert f"{folder}/ is the package ranklens.{folder}" in last


def test_installed_names_import_and_the_tracer_is_one_singleton() -> None:
    proc = _run(
        "import ranklens.tracing, ranklens.collector, ranklens.analyzers, ranklens.dashboards, sys\n"
        "import ranklens.tracing as a\n"
        "from ranklens import tracing as b\n"
        "assert a is b and 'tracing' not in sys.modules\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
