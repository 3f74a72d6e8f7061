"""Cost of reading torch's flight-recorder ring into the ledger (tracing/_ledger.py).

    python bench/ledger_bench.py [--reads 10]

In a 1-rank gloo group with a full ring (2000 entries, torch's default): the CPU time of one read
(the dump through the ``fr_trace_json`` handler plus parsing only the half that is new), of the
status read that decides when to dump, and how long the training thread is kept from running
Python while reads run on another thread (its throughput relative to just before), for the
handler (GIL released) and for ``_dump_fr_trace_json`` (GIL held). On a 2-core machine the
reader also competes for the CPU, so even a GIL-free read costs the training thread something.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from _common import free_port


def _python_loop(until) -> int:
    n = 0
    while until():
        x = 0
        for i in range(200):
            x += i
        n += 1
    return n


def _throughput_during(read, reads: int) -> float:
    """The training thread's pure-Python throughput while ``reads`` reads run on another thread,
    as a fraction of its throughput just before (1.0: not slowed at all)."""
    end = time.perf_counter() + 0.5
    base = _python_loop(lambda: time.perf_counter() < end) / 0.5
    th = threading.Thread(target=lambda: [read() for _ in range(reads)])
    start = time.perf_counter()
    th.start()
    n = _python_loop(th.is_alive)
    return n / (time.perf_counter() - start) / base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=10)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    from ranklens.tracing._fr_ring import RingReader, new_entries

    dist.init_process_group("gloo")
    t = torch.ones(16)
    for _ in range(2000):
        dist.all_reduce(t)
    reader = RingReader.create()
    assert reader is not None
    handler = reader._dumps[0]
    data = handler()
    last_id = new_entries(data, -1)[0][-1]["record_id"] - 1000  # half of the ring is new

    def one_read() -> None:
        new_entries(handler(), last_id)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(args.reads):
        one_read()
    cpu, wall = (time.process_time() - cpu0) / args.reads, (time.perf_counter() - wall0) / args.reads
    print(
        f"read of a full ring (2000 entries, 1000 new): {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU "
        f"-> {cpu * 1e6 / 1000:.0f} us CPU per new collective"
    )
    s = time.perf_counter()
    for _ in range(1000):
        reader.status()
    print(f"status read (decides when to dump; every 50 ms): {(time.perf_counter() - s) * 1e3:.3f} us")
    direct = lambda: new_entries(c10d._dump_fr_trace_json(), last_id)  # noqa: E731
    for name, read in (("fr_trace_json handler (GIL released)", one_read), ("_dump_fr_trace_json (GIL held)", direct)):
        frac = _throughput_during(read, args.reads)
        print(f"training thread's Python throughput while reads run, {name}: {100 * frac:.0f}% of baseline")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
