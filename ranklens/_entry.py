"""The ``ranklens`` console script: a one-shot ``ranklens logs classify`` runs without the click
application; every other command line goes to :func:`ranklens.cli.main`.

Importing ``ranklens.cli`` (click and every command's options) is ~30 ms of a one-shot
``ranklens logs classify`` that otherwise takes ~0.2 s for 128 MB (issue 18). The fast path takes
only the plain forms of that command (``logs classify [--json] [--rules FILE] FILE...``, each file
there and not a directory) and writes exactly what the click command writes, with the same exit
codes; anything else (``--help``, an unknown option, a missing file, ``--``) is handed to click, so
every message and usage error is click's own.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = ["classify_output", "main"]


def classify_output(files: Iterable[str], rules_file: str | None, as_json: bool) -> Iterator[str]:
    """The lines ``ranklens logs classify`` prints on stdout, one per kept event."""
    from ranklens.collector.logfilter import classify_paths

    for ev in classify_paths(list(files), rules_file):
        d = ev.to_json()
        if as_json:
            yield json.dumps(d, default=str)
        else:
            first = str(d.get("message", "")).splitlines()[0][:160] if d.get("message") else ""
            rep = f" (x{d['repeat_count']})" if d.get("repeat_count", 1) > 1 else ""
            yield f"{d.get('severity', ''):8s} {d.get('klass', d.get('class', '')):18s} {first}{rep}"


def kept_note(n: int) -> str:
    """The line ``ranklens logs classify`` prints on stderr after its events (text output)."""
    return f"({n} event{'s' if n != 1 else ''} kept)"


def _usable_file(p: str) -> bool:
    # what click.Path(exists=True, dir_okay=False) accepts
    return os.path.exists(p) and not os.path.isdir(p)


def fast_logs_classify_args(argv: Sequence[str]) -> tuple[list[str], str | None, bool] | None:
    """``(files, rules_file, as_json)`` when ``argv`` (without the program name) is a plain
    ``logs classify`` command line the fast path runs exactly as click would; None otherwise."""
    if list(argv[:2]) != ["logs", "classify"]:
        return None
    files: list[str] = []
    rules: str | None = None
    as_json = False
    i = 2
    while i < len(argv):
        a = argv[i]
        if a == "--json" and not as_json:
            as_json = True
        elif a == "--rules" and rules is None and i + 1 < len(argv):
            rules = argv[i + 1]
            i += 1
        elif a.startswith("--rules=") and rules is None:
            rules = a[len("--rules=") :]
        elif a.startswith("-"):
            return None  # help, an unknown or repeated option, "--", "-": click's to answer
        else:
            files.append(a)
        i += 1
    if not files or not all(_usable_file(p) for p in files) or (rules is not None and not _usable_file(rules)):
        return None
    return files, rules, as_json


def _utf8(stream: Any) -> bool:
    enc = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
    return enc == "utf8"


def main() -> None:
    """The console script."""
    args = fast_logs_classify_args(sys.argv[1:])
    # click rewraps a stream whose encoding cannot take every character: leave those to it
    if args is None or not (_utf8(sys.stdout) and _utf8(sys.stderr)):
        from ranklens.cli import main as cli_main

        cli_main()
        return
    from ranklens.errors import RanklensError

    files, rules_file, as_json = args
    out = sys.stdout
    strip = not as_json and not out.isatty()
    n = 0
    try:
        for line in classify_output(files, rules_file, as_json):
            n += 1
            if strip and "\x1b" in line:  # click.echo strips ANSI styles from piped output
                import click

                out.flush()
                click.echo(line)
            else:
                out.write(line + "\n")
        if not as_json:
            out.flush()
            print(kept_note(n), file=sys.stderr)
        out.flush()
        sys.stderr.flush()
    except RanklensError as e:
        out.flush()
        print(f"ranklens: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except BrokenPipeError:  # `| head`: quietly, with click's exit code for it (1)
        os._exit(1)
    # all is written and every thread joined: skip the interpreter's teardown of the modules and
    # the compiled rules (~10 ms), as a one-shot command may
    os._exit(0)


if __name__ == "__main__":
    main()
