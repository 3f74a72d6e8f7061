"""Every RANKLENS_* environment variable is a named constant in ranklens/config.py (issue 13).

The rule, checked over every module of every package (ranklens/, tracing/, collector/,
analyzers/, dashboards/):

- code names a variable only through a ``ranklens.config`` constant: a string literal that is
  exactly a variable name (``"RANKLENS_SPOOL"``, also a prefix such as ``"RANKLENS_COLLECTOR_"``)
  appears in ranklens/config.py and nowhere else;
- prose (docstrings, ``--help`` text, error messages) may mention variables inside longer text,
  but every name it mentions is one that config.py defines (no stale or misspelled names);
- the one exception is ranklens/_bootstrap/sitecustomize.py, which runs in every Python process
  that ``ranklens run`` starts and imports nothing of ranklens there; its literal must equal the
  constant.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from ranklens import config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ["ranklens", "tracing", "collector", "analyzers", "dashboards"]
CONFIG = ROOT / "ranklens" / "config.py"
BOOTSTRAP = ROOT / "ranklens" / "_bootstrap" / "sitecustomize.py"
NAME = re.compile(r"RANKLENS_[A-Z0-9_]*")
MENTION = re.compile(r"RANKLENS_[A-Z0-9][A-Z0-9_]*")  # in prose; "RANKLENS_*" names the family


def _package_files() -> list[Path]:
    files = []
    for folder in PACKAGE_FOLDERS:
        files += [p for p in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts]
    return files


def _env_constants() -> dict[str, str]:
    return {k: v for k, v in vars(config).items() if k.startswith("ENV_") and isinstance(v, str)}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _literal_names(path: Path) -> list[tuple[int, str]]:
    """(line, literal) for every string literal that is exactly an environment variable name."""
    tree = _tree(path)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)
    ]


def test_no_module_outside_config_spells_a_variable_name() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {value!r}"
        for path in _package_files()
        if path not in (CONFIG, BOOTSTRAP)
        for line, value in _literal_names(path)
    ]
    assert not offenders, "use the ranklens.config constant instead of the literal:\n" + "\n".join(offenders)


def test_the_rule_catches_a_literal(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('import os\nx = os.environ.get("RANKLENS_SPOOL")\n"""Docs may say RANKLENS_SPOOL."""\n')
    assert _literal_names(bad) == [(2, "RANKLENS_SPOOL")]  # the docstring's mention is prose


def test_config_defines_every_name_it_is_asked_for() -> None:
    constants = _env_constants()
    assert constants, "ranklens.config defines no ENV_* constants"
    for name, value in constants.items():
        assert NAME.fullmatch(value), f"config.{name} = {value!r} is not a RANKLENS_* name"
    values = list(constants.values())
    assert len(values) == len(set(values)), f"two constants name the same variable: {sorted(values)}"
    assert sorted(set(constants) - set(config.__all__)) == [], "ENV_* constants missing from config.__all__"


def test_every_variable_the_code_mentions_is_defined_in_config() -> None:
    values = set(_env_constants().values())
    prefixes = tuple(v for v in values if v.endswith("_"))
    unknown = []
    for path in _package_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in MENTION.findall(line):
                if name not in values and not name.startswith(prefixes):
                    unknown.append(f"{path.relative_to(ROOT)}:{lineno}: {name}")
    assert not unknown, "not a ranklens.config constant (add it there, or fix the name):\n" + "\n".join(unknown)


def test_bootstrap_literals_are_the_constants() -> None:
    # the bootstrap's own spellings (it must not import ranklens in every process) are the constants'
    found = {value for _, value in _literal_names(BOOTSTRAP)}
    assert found == {config.ENV_DISABLE, config.ENV_DRILL, config.ENV_ELASTIC_STORE}


def test_config_reads_nothing_at_import_time() -> None:
    tree = ast.parse(CONFIG.read_text(encoding="utf-8"))
    for node in tree.body:  # module level only: functions read when they are called
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        reads = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")]
        assert not reads, f"config.py reads the environment at import time: {ast.unparse(node)}"


def _module_level_reads(path: Path) -> list[int]:
    """Lines of module- or class-level statements (run at import) that touch os.environ/getenv."""
    out = []
    stack = list(_tree(path).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.ClassDef):
            stack.extend(node.body)
            continue
        if any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv") for n in ast.walk(node)):
            out.append(node.lineno)
    return out


def test_no_package_module_reads_the_environment_at_import() -> None:
    # the bootstrap is the exception by design: it is the interpreter's startup hook
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in _package_files()
        if path != BOOTSTRAP
        for line in _module_level_reads(path)
    ]
    assert not offenders, "read it when the component is built, not at import:\n" + "\n".join(offenders)
