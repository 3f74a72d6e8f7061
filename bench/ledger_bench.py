"""Cost of reading torch's flight-recorder ring into the ledger (tracing/_ledger.py).

    python bench/ledger_bench.py [--reads 10]

In a 1-rank gloo group with a full ring (2000 entries, torch's default): the CPU time of one read
(the dump through the ``fr_trace_json`` handler plus parsing only the half that is new), of the
status read that decides when to dump, and how long the training thread is kept from running
Python while a read runs on another thread, for the handler (GIL released) and for
``_dump_fr_trace_json`` (GIL held).
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stall_ms(read, seconds: float = 1.5) -> float:
    """Longest gap between iterations of a pure-Python loop while ``read`` runs in a loop on
    another thread."""
    stop = threading.Event()

    def bg() -> None:
        while not stop.is_set():
            read()

    th = threading.Thread(target=bg, daemon=True)
    th.start()
    worst = 0.0
    end = time.perf_counter() + seconds
    last = time.perf_counter()
    while last < end:
        x = 0
        for i in range(200):
            x += i
        now = time.perf_counter()
        worst = max(worst, now - last)
        last = now
    stop.set()
    th.join()
    return worst * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=10)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
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
        reader.enqueued()
    print(f"status read (decides when to dump; every 50 ms): {(time.perf_counter() - s) * 1e3:.3f} us")
    print(f"training-thread stall while reading, fr_trace_json handler: {_stall_ms(one_read):.1f} ms max")
    print(
        "training-thread stall while reading, _dump_fr_trace_json (GIL held): "
        f"{_stall_ms(lambda: new_entries(c10d._dump_fr_trace_json(), last_id)):.1f} ms max"
    )
    print(f"(no read at all: {_stall_ms(lambda: time.sleep(0.01)):.1f} ms max)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
