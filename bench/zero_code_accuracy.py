"""The zero-code accuracy matrix: real 4-rank gloo jobs from an unmodified script
(tests/zero_code_job.py, no ranklens import) under ``ranklens run``; a rank slowed in forward,
backward or data loading at 50 ms and 200 ms per step, and a healthy run; on a quiet host and with
two CPU hogs (``python -c 'while True: pass'``). Prints per run what ``ranklens analyze --json``
named, then precision/recall of the named ranks, phase accuracy and onset errors.

    python bench/zero_code_accuracy.py [--quiet-only] [--loaded-only] [--steps 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.zero_code_helpers import matrix, run_case, score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet-only", action="store_true")
    ap.add_argument("--loaded-only", action="store_true")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    modes = [False] if args.quiet_only else [True] if args.loaded_only else [False, True]
    root = Path(tempfile.mkdtemp(prefix="zc-bench-"))
    for loaded in modes:
        outcomes = []
        for case in matrix():
            case = dataclasses.replace(case, steps=args.steps)
            t = time.perf_counter()
            o = run_case(case, root / f"{case.name}-{int(loaded)}", loaded=loaded)
            outcomes.append(o)
            print(
                f"{'loaded' if loaded else 'quiet':6s} {case.name:14s} steps={o.report['step_source']:8s} "
                f"named={sorted(o.named_ranks)} phase={o.phase_named or '-':9s} onset_err={o.onset_error} "
                f"({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
        s = score(outcomes)
        print(
            f"{'loaded' if loaded else 'quiet'}: precision {s['precision']:.2f} recall {s['recall']:.2f} "
            f"(tp {s['tp']} fp {s['fp']} fn {s['fn']}), phase accuracy {s['phase_accuracy']}, "
            f"onset errors {s['onset_errors']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
