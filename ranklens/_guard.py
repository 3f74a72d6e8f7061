"""The guard of the repository's top-level package folders (``tracing/``, ``collector/``, ...).

Those folders are installed as ``ranklens.tracing``, ``ranklens.collector``, ... (see
``[tool.setuptools] package-dir``). From the repository root Python can also import them under
their bare folder names, which loads the same files a second time as different modules: a second
tracer singleton, a second registry, isinstance checks that fail across the two copies. Each
folder's ``__init__`` calls :func:`require_installed_name` so that doing so fails at once, naming
the right import.
"""

from __future__ import annotations

__all__ = ["require_installed_name"]


def require_installed_name(name: str, installed: str) -> None:
    """Raise ImportError unless the package module ``name`` is ``installed`` (its real name).

    Args:
        name: the importing package's ``__name__``.
        installed: the name it is installed as, e.g. ``"ranklens.tracing"``.

    Raises:
        ImportError: when ``name`` is anything else (e.g. ``"tracing"``).
    """
    if name != installed:
        raise ImportError(
            f"the folder {name.rsplit('.', 1)[-1]}/ is the package {installed}: use `import {installed}` "
            f"(importing it as {name!r} loads a second copy of its modules, with their own state)",
            name=name,
        )
