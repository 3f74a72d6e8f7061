"""Score the built-in log rules on the labelled tuning lines and on the held-out lines.

Per class: recall and precision by example (a standalone line or a multi-line block) and by line;
per-line accuracy over every line (benign ``noise`` lines included). See
``ranklens.collector.logscore`` for the definitions.

Usage::

    .venv/bin/python bench/logrules_score.py [--engine auto] [--errors] [FILE.jsonl ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ranklens.collector.logfilter import LogFilter
from ranklens.collector.logscore import load_labelled, score_rows

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "tests" / "data" / "logs_heldout"
SPLITS: dict[str, list[Path]] = {
    "tuning (tests/data/logs)": [ROOT / "tests" / "data" / "logs" / "real_log_lines.jsonl"],
    "held-out, all parts (tests/data/logs_heldout)": sorted(HELDOUT.glob("heldout*_log_lines.jsonl")),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="labelled JSON Lines files (default: both splits)")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--errors", action="store_true", help="list every misclassified line")
    args = ap.parse_args()
    splits = {f: [Path(f)] for f in args.files} if args.files else SPLITS
    lf = LogFilter(engine=args.engine)
    print(f"engine {lf.engine}, {len(lf.rules.rules)} rules")
    for title, paths in splits.items():
        # the files one after the other, as one stream (each ends with benign lines)
        rows = [r for p in paths for r in load_labelled(p)]
        sc = score_rows(rows, lf)
        print(sc.format(title))
        if args.errors:
            for i, lab, p, line in sc.errors:
                print(f"    row {i + 1}: label {lab}, got {p}: {line[:140]}")
        print()


if __name__ == "__main__":
    main()
