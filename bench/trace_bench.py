"""Trace analysis, whole commands: ranklens (ingest a trace set into a fresh embedded store, then
`ranklens analyze --traces --json`) against Holistic Trace Analysis on the same set (load it and
run the same analyses, bench/hta_reference.py --set), alternating, per recorded set.

    python bench/trace_bench.py --hta-python /tmp/hta/bin/python [--rounds 3] [SET_DIR ...]
    python bench/trace_bench.py --hta-python ... --server clickhouse://default@127.0.0.1:9000

With ``--server`` (a ClickHouse server started with ``RANKLENS_CH_QUERY_LOG=1 scripts/clickhouse.sh
start``) ranklens stores into a fresh database there, and its memory is the ranklens processes'
peak RSS plus the server's largest query (``system.query_log``'s ``memory_usage`` of the queries
that ran during the round: run nothing else against that server meanwhile).

Prints, per set, the median wall seconds and peak RSS of each side and the ratio ranklens / HTA.
Peak RSS is the largest single process of a side (os.wait4's ru_maxrss), as /usr/bin/time -v says.
HTA runs in its own environment (pip install holistictraceanalysis==0.5.0): never a dependency.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = ROOT / "tests" / "data" / "kineto"


def _run(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one command, run to its end."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
    if p.returncode:
        raise SystemExit(f"{' '.join(argv)} exited {p.returncode}:\n{err[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def _server_query_peak(server: str, since: float) -> int:
    """The largest memory_usage of the server's queries that finished since ``since`` (epoch s)."""
    from urllib.parse import urlparse

    import clickhouse_driver

    u = urlparse(server)
    c = clickhouse_driver.Client(host=u.hostname or "127.0.0.1", port=u.port or 9000, user=u.username or "default")
    c.execute("SYSTEM FLUSH LOGS")
    ((peak,),) = c.execute(
        f"SELECT max(memory_usage) FROM system.query_log WHERE type = 2 AND event_time >= toDateTime({int(since)})"
    )
    c.disconnect()
    return int(peak or 0)


def _ranklens(set_dir: Path, server: str | None = None) -> tuple[float, int]:
    work = Path(tempfile.mkdtemp(prefix="ranklens-trace-bench-"))
    try:
        url = f"embedded://{work / 'store'}"
        since = time.time() - 1
        if server:
            url = f"{server.rstrip('/')}/ranklens_bench_{os.getpid()}_{int(since)}"
        exe = [sys.executable, "-m", "ranklens.cli"]
        w1, m1 = _run([*exe, "ingest", "--store", url, "--format", "kineto", "--job", set_dir.name, str(set_dir)])
        w2, m2 = _run([*exe, "analyze", "--traces", "--json", "--no-save", "--store", url, "--job", set_dir.name])
        if not server:
            return w1 + w2, max(m1, m2)
        peak = max(m1, m2) + _server_query_peak(server, since)
        from ranklens.store import open_store

        open_store(url, create=False).drop_database()  # type: ignore[attr-defined]
        return w1 + w2, peak
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _hta(python: str, set_dir: Path) -> tuple[float, int]:
    return _run([python, str(ROOT / "bench" / "hta_reference.py"), "--set", str(set_dir)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sets", nargs="*", type=Path, help="trace set folders (default: tests/data/kineto/*)")
    ap.add_argument("--hta-python", required=True, help="python of an environment with holistictraceanalysis")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server", default=None, help="a ClickHouse server URL (no database) with query_log on")
    args = ap.parse_args()
    sets = args.sets or sorted(p for p in SETS.iterdir() if p.is_dir())
    print(
        f"{'set':34} {'MB json.gz':>10} {'ranklens s':>10} {'HTA s':>7} {'ratio':>6} "
        f"{'ranklens MB':>11} {'HTA MB':>7} {'ratio':>6}"
    )
    for d in sets:
        size = sum(f.stat().st_size for f in d.glob("*.json.gz")) / 1e6
        ours, theirs = [], []
        for _ in range(args.rounds):  # alternating: a drift of the machine's speed hits both sides
            ours.append(_ranklens(d, args.server))
            theirs.append(_hta(args.hta_python, d))
        ow, om = statistics.median(w for w, _ in ours), statistics.median(m for _, m in ours)
        hw, hm = statistics.median(w for w, _ in theirs), statistics.median(m for _, m in theirs)
        print(
            f"{d.name:34} {size:>10.2f} {ow:>10.2f} {hw:>7.2f} {ow / hw:>6.2f} "
            f"{om / 1e6:>11.0f} {hm / 1e6:>7.0f} {om / hm:>6.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
