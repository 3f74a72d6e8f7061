"""The node blacklist file that schedulers read: one node name a line (``sbatch
--exclude=$(paste -sd, FILE)``), or, for a ``.json`` path, ``{"nodes": [...], "reasons": {...}}``
(plus any other keys its writer keeps, e.g. pre-flight's ``run_id``). Written by ``ranklens
preflight --blacklist`` and by the Slurm executor; always replaced atomically, so a prolog reading
it never sees half of it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["read_blacklist", "write_blacklist"]


def read_blacklist(path: str) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The nodes, their reasons and the JSON's other keys of the file at ``path`` (all empty when
    it is missing or empty). A plain file's ``#`` lines are comments. A reason is kept as written
    (pre-flight writes a list of failed checks, the Slurm executor a line)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return [], {}, {}
    if not text.strip():
        return [], {}, {}
    if path.endswith(".json"):
        data = json.loads(text)
        nodes = [str(n) for n in data.get("nodes", [])]
        reasons = {str(k): v for k, v in (data.get("reasons") or {}).items()}
        return nodes, reasons, {k: v for k, v in data.items() if k not in ("nodes", "reasons")}
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")], {}, {}


def write_blacklist(
    path: str, nodes: Sequence[str], reasons: Mapping[str, Any], extra: Mapping[str, Any] | None = None
) -> None:
    """Replace the file at ``path`` atomically: JSON when it ends in .json (``extra``'s keys first),
    else one node name a line. Written even when ``nodes`` is empty."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        if path.endswith(".json"):
            json.dump({**(extra or {}), "nodes": list(nodes), "reasons": dict(reasons)}, f, indent=2)
            f.write("\n")
        else:
            f.write("".join(f"{n}\n" for n in nodes))
    os.replace(tmp, path)
