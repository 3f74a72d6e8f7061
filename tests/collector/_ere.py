"""The built-in rules translated to POSIX ERE and run by ``grep -E``, against Python's own matching."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ranklens.collector.logfilter import LogFilter
from ranklens.collector.rules import BUILTIN_RULES, pattern_to_ere


def grep_and_python_matches(tmp_path: Path, lines: list[str], *, lc_all: str) -> tuple[set[int], set[int]]:
    """The 1-based numbers of the lines ``grep -E -f RULES.ere`` matches (under ``LC_ALL=lc_all``), and
    of the lines ``LogFilter().classify_line`` gives a class."""
    f = tmp_path / "lines.log"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ere = tmp_path / "rules.ere"
    ere.write_text("\n".join(pattern_to_ere(r.pattern, ignore_case=r.ignore_case) for r in BUILTIN_RULES) + "\n")
    out = subprocess.run(
        [shutil.which("grep") or "grep", "-n", "-E", "-f", str(ere), str(f)],
        capture_output=True,
        text=True,
        env={"LC_ALL": lc_all},
        check=False,
    ).stdout
    by_grep = {int(line.split(":", 1)[0]) for line in out.splitlines()}
    lf = LogFilter()
    return by_grep, {i + 1 for i, line in enumerate(lines) if lf.classify_line(line) is not None}
