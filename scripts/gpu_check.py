"""The prepared GPU check (run it on a machine with an NVIDIA GPU; CI has none).

    python scripts/gpu_check.py [--out DIR]

Checks for real what the CPU test suite can only check behind interfaces:
1. NCCL (1 rank per GPU visible; world size 1 on a single-GPU machine): traced all_reduce on a
   CUDA tensor lands in the ledger with clock = "cuda", arrival/completion from CUDA events mapped
   to host time, and the calibration error is reported;
2. the tracer never synchronises the device on the hot path: the time to *issue* a traced
   collective stays near the untraced one while the GPU is busy;
3. tracer overhead per collective with NCCL (ns/op traced vs untraced);
4. ``ranklens preflight``'s GPU checks (``gpu.*``) with the real pynvml: every result is printed;
   gpu.count, gpu.driver, gpu.ecc_uncorrected, gpu.temperature and gpu.pcie_link must have run for
   real (not skip/error) and gpu.compute_burn must give TFLOPS > 0 on every GPU. It runs first and on
   its own: its failure is reported and the other checks still run (and the other way round);
5. a torch.profiler window of traced NCCL all_reduces: its kernels carry ``Process Group Name`` and
   ``Seq`` (torch 2.5+) and every one of them pairs with its ledger row (analyzers/trace_ledger.py);
   the seq shift found (trace seq minus ledger seq; 0 expected) is printed.
Prints one line per number; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
import traceback

# the gpu.* checks that must run for real on a GPU machine (not skip, not error)
PREFLIGHT_REAL = ("gpu.count", "gpu.driver", "gpu.ecc_uncorrected", "gpu.temperature", "gpu.pcie_link")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preflight_check(burn_s: float) -> bool:
    """``ranklens preflight``'s GPU group on this machine, with the real pynvml; True when it passes."""
    from ranklens.collector.preflight import Context, Status, resolve_checks, run_node

    report = run_node(Context(node=socket.gethostname(), burn_s=burn_s), resolve_checks("gpu"))
    for r in report.results:
        extra = f" [threshold {r.threshold}]" if r.threshold else ""
        extra += f" -> fix: {r.fix}" if r.fix else ""
        print(f"  {r.status.value:5} {r.check:22} {r.subject:6} {r.message}{extra}")
    print("  facts:", {k: report.facts.get(k) for k in ("software", "gpu_count", "gpu_models", "gpu_tflops")})
    ok = True
    for name in PREFLIGHT_REAL:
        got = [r for r in report.results if r.check == name]
        bad = [r for r in got if r.status in (Status.SKIP, Status.ERROR)]
        if not got or bad:
            print(f"preflight: {name} did not run for real: {[(r.status.value, r.message) for r in got]}")
            ok = False
    burns = [r for r in report.results if r.check == "gpu.compute_burn"]
    if not burns or any(r.status is not Status.PASS or not r.value > 0 for r in burns):
        print(f"preflight: gpu.compute_burn gave no TFLOPS: {[(r.status.value, r.message) for r in burns]}")
        ok = False
    tflops = report.facts.get("gpu_tflops", {})
    if len(tflops) != len(burns):
        print(f"preflight: gpu_tflops facts {tflops} do not match the {len(burns)} burn result(s)")
        ok = False
    if not any("GPU-" in r.message for r in burns):  # the CUDA device was matched to NVML by uuid
        print("preflight: note: the burn's CUDA devices were not matched to NVML's by uuid (numbered by CUDA)")
    print(f"preflight: node status {report.status.value} (a fail/warn here is the machine's state, not a bug)")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="ranklens-gpu-"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--burn", type=float, default=2.0, help="seconds of matmul per GPU in gpu.compute_burn")
    args = ap.parse_args()
    print("== ranklens preflight: gpu checks with the real NVML")
    try:
        preflight_ok = preflight_check(args.burn)
    except Exception:  # report it and carry on: the other checks are independent
        traceback.print_exc()
        print("preflight: the GPU pre-flight section crashed (traceback above)")
        preflight_ok = False
    print("PREFLIGHT GPU CHECK", "PASSED" if preflight_ok else "FAILED")
    print("== tracer with NCCL")
    try:
        tracer_ok = tracer_check(args)
    except Exception:
        traceback.print_exc()
        print("tracer: the NCCL tracer section crashed (traceback above)")
        tracer_ok = False
    if tracer_ok is None:
        return 2  # no CUDA device: this machine cannot run the check
    ok = preflight_ok and tracer_ok
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def tracer_check(args: argparse.Namespace) -> bool | None:
    """The NCCL tracer checks (1-3 of the module doc); True when they pass, None without CUDA."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return None
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
    prof_dir = os.path.join(args.out, "prof")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
    os.makedirs(prof_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(prof_dir, "rank0.pt.trace.json"))
    rlt.shutdown()
    from ranklens.analyzers.trace_ledger import collective_kernels
    from ranklens.collector import Shipper
    from ranklens.collector.kineto import ingest_kineto
    from ranklens.store import open_store

    store = open_store(f"embedded://{args.out}/store")
    Shipper(args.out, store).ship_once()
    ingest_kineto(store, [prof_dir], job_id="gpu-check", rank=0)
    print(
        "profiler kernels with pg/seq:",
        store.query(
            "SELECT collective, pg, min(seq), max(seq), count() FROM trace_events WHERE cat = 'kernel' "
            "AND collective != '' GROUP BY collective, pg"
        ).rows(),
    )
    joined = collective_kernels(store, "gpu-check")
    if joined is None:
        print("trace join: no kernel carries Process Group Name + Seq (torch < 2.5?), or no ledger")
        ok = False
    else:
        print(
            f"trace join: {joined.consistent} of {joined.with_seq} kernels paired, seq shift {joined.seq_shift}, "
            f"per rank {[r.to_json() for r in joined.per_rank]}"
        )
        ok = ok and joined.consistent == joined.with_seq >= 20
    rows = store.query("SELECT clock, count(), quantileExact(0.5)(end_ns - enter_ns) FROM collectives GROUP BY clock")
    print("ledger by clock (clock, calls, median device time ns):", rows.rows())
    cuda_rows = dict((c, n) for c, n, _ in rows.rows()).get("cuda", 0)
    ok = ok and cuda_rows >= args.calls
    dist.destroy_process_group()
    print("TRACER GPU CHECK", "PASSED" if ok else "FAILED")
    return ok


if __name__ == "__main__":
    sys.exit(main())
