"""A larger trace of the same job: a recorded Kineto trace repeated K times end to end (times
shifted by the trace's span, correlation / external ids and ProfilerStep numbers offset), to see
how ingest and analysis scale with trace size (bench/trace_bench.py on its folder).

    python bench/trace_repeat.py tests/data/kineto/hta_recsys_a100_rank3_of8/control.json.gz \\
        /tmp/big/x8/control.json.gz 8
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

_STEP = re.compile(r"ProfilerStep#(\d+)")


def repeat(src: Path, dst: Path, k: int) -> int:
    with gzip.open(src) as f:
        d = json.load(f)
    events = d["traceEvents"]
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(ts) - min(ts) + 1000
    out = []
    for i in range(k):
        for e in events:
            e2 = dict(e)
            if isinstance(e2.get("ts"), (int, float)):
                e2["ts"] = e2["ts"] + i * span
            args = e2.get("args")
            if isinstance(args, dict):
                args = dict(args)
                for key in ("correlation", "External id"):
                    if isinstance(args.get(key), int) and args[key] >= 0:
                        args[key] += i * 10**8
                e2["args"] = args
            m = _STEP.match(str(e2.get("name", "")))
            if m:
                e2["name"] = f"ProfilerStep#{int(m.group(1)) + i * 100}"
            out.append(e2)
    d["traceEvents"] = out
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dst, "wt") as f:
        json.dump(d, f)
    return len(out)


if __name__ == "__main__":
    n = repeat(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
    print(f"{sys.argv[2]}: {n} events")
