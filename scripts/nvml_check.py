"""Check the real NVML path on a GPU machine: sample every GPU a few times through
:class:`ranklens.collector.nvml.GpuSampler` with the real ``pynvml`` and print what came back.

Usage: ``python scripts/nvml_check.py [--samples 3] [--interval 1.0]``. Exit 0 when GPUs were
sampled, 3 when NVML is not usable here (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from ranklens.collector.nvml import GpuSampler
from ranklens.records import to_arrow


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0)
    args = ap.parse_args(argv)
    s = GpuSampler()
    if not s.start():
        print(json.dumps({"available": False, "reason": s.reason}))
        return 3
    try:
        for i in range(args.samples):
            t0 = time.perf_counter()
            r = s.sample()
            took_ms = (time.perf_counter() - t0) * 1e3
            to_arrow("gpu_samples", r.samples)  # the rows fit the schema
            if r.events:
                to_arrow("gpu_events", r.events)
            clean = [
                {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                for row in r.samples
            ]
            print(
                json.dumps(
                    {"sample": i, "took_ms": round(took_ms, 2), "rows": clean, "extras": r.extras, "events": r.events}
                )
            )
            time.sleep(args.interval)
        unsupported = {g.index: sorted(g.unsupported) for g in s._gpus}
        print(json.dumps({"available": True, "gpus": s.gpu_count, "unsupported_fields": unsupported}))
    finally:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
