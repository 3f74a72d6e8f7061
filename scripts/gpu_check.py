"""The prepared GPU check (run it on a machine with an NVIDIA GPU; CI has none).

    python scripts/gpu_check.py [--out DIR]

Checks for real what the CPU test suite can only check behind interfaces:
1. NCCL (1 rank per GPU visible; world size 1 on a single-GPU machine): traced all_reduce on a
   CUDA tensor lands in the ledger with clock = "cuda", arrival/completion from CUDA events mapped
   to host time, and the calibration error is reported;
2. the tracer never synchronises the device on the hot path: the time to *issue* a traced
   collective stays near the untraced one while the GPU is busy;
3. tracer overhead per collective with NCCL (ns/op traced vs untraced).
Prints one line per number; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="ranklens-gpu-"))
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    x = torch.ones(1 << 20, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")

    def issue(n: int) -> float:
        torch.cuda.synchronize()
        for _ in range(3):
            busy @ busy  # keep the GPU busy so a hidden sync would show
        t = time.perf_counter_ns()
        for _ in range(n):
            dist.all_reduce(x)
        dt = (time.perf_counter_ns() - t) / n
        torch.cuda.synchronize()
        return dt

    base = issue(args.calls)
    import ranklens.tracing as rlt

    tracer = rlt.init(job_id="gpu-check", spool_dir=args.out)
    traced = issue(args.calls)
    print(f"issue time per all_reduce (4 MiB, GPU busy): untraced {base:,.0f} ns, traced {traced:,.0f} ns")
    time.sleep(1.0)
    assert tracer is not None
    timer = tracer._cuda_timer
    ok = timer is not None
    print(
        f"cuda timer used: {ok}; pending {timer.pending() if timer else '-'}; "
        f"clock mapping error {tracer.clock_error_ns} ns"
    )
    rlt.shutdown()
    from ranklens.collector import Shipper
    from ranklens.store import open_store

    store = open_store(f"embedded://{args.out}/store")
    Shipper(args.out, store).ship_once()
    rows = store.query("SELECT clock, count(), quantileExact(0.5)(end_ns - enter_ns) FROM collectives GROUP BY clock")
    print("ledger by clock (clock, calls, median device time ns):", rows.rows())
    cuda_rows = dict((c, n) for c, n, _ in rows.rows()).get("cuda", 0)
    ok = ok and cuda_rows >= args.calls
    dist.destroy_process_group()
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
