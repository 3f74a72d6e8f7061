"""Holistic Trace Analysis' own numbers for the recorded trace sets, the reference that
tests/analyzers/test_traces_hta.py holds ranklens' trace analyses to.

Runs in a scratch environment with HTA installed, never in ranklens' own (HTA is not a dependency):

    python3 -m venv /tmp/hta && /tmp/hta/bin/pip install holistictraceanalysis==0.5.0
    /tmp/hta/bin/python bench/hta_reference.py ../shared/data/kineto tests/data/kineto_hta

(`--set DIR` analyses one set and prints its temporal breakdown: what bench/trace_bench.py times.)

One JSON file per trace set: HTA's temporal breakdown, communication/computation overlap,
kernel-type and kernel breakdowns and idle-time breakdown, with HTA's defaults (every rank).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import tempfile
import warnings
from pathlib import Path


def _clean(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


def _records(df):
    return [{k: _clean(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def reference(trace_dir: Path) -> dict:
    from importlib.metadata import version

    from hta.trace_analysis import TraceAnalysis

    with tempfile.TemporaryDirectory() as d:
        for f in sorted(trace_dir.glob("*.json.gz")):
            shutil.copy(f, d)
        ta = TraceAnalysis(trace_dir=d)
        ranks = ta.t.get_ranks()
        kernel_type, kernels = ta.get_gpu_kernel_breakdown(visualize=False)
        idle = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)[0]
        launches = {}
        for rank, df in ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False).items():
            launches[str(rank)] = {
                "launches": len(df),
                "cpu_duration_us": _clean(df["cpu_duration"].sum()),
                "gpu_duration_us": _clean(df["gpu_duration"].sum()),
                "launch_delay_us": _clean(df["launch_delay"].sum()),
                "short_gpu_kernels": int((df["gpu_duration"] < df["cpu_duration"]).sum()),
                "long_runtime_calls": int((df["cpu_duration"] > 50).sum()),
                "long_launch_delays": int((df["launch_delay"] > 100).sum()),
            }
        queue = ta.get_queue_length_summary(ranks=ranks)
        queue_rows = []
        if queue is not None:
            for (rank, stream), row in queue.iterrows():
                d = {k[1]: _clean(v) for k, v in row.items()}
                queue_rows.append({"rank": int(rank), "stream": int(stream), **d})
        return {
            "cuda_kernel_launch_stats": launches,
            "queue_length_summary": queue_rows,
            "hta_version": version("holistictraceanalysis"),
            "trace_set": trace_dir.name,
            "ranks": [int(r) for r in ranks],
            "temporal_breakdown": _records(ta.get_temporal_breakdown(visualize=False)),
            "comm_comp_overlap": _records(ta.get_comm_comp_overlap(visualize=False)),
            "kernel_type_breakdown": _records(kernel_type),
            "kernel_breakdown": _records(kernels),
            "idle_time_breakdown": _records(idle),
        }


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if argv[1] == "--set":  # one set, nothing written (bench/trace_bench.py times this)
        ref = reference(Path(argv[2]))
        print(json.dumps(ref["temporal_breakdown"]))
        return 0
    src, out = Path(argv[1]), Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for d in sorted(p for p in src.iterdir() if p.is_dir() and any(p.glob("*.json.gz"))):
        ref = reference(d)
        (out / f"{d.name}.json").write_text(json.dumps(ref, indent=1, sort_keys=True) + "\n")
        print(f"{d.name}: ranks {ref['ranks']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
