"""The `collective_arrivals` rollup (issue 19) on one ClickHouse server (Debian's 18.16), as a user
runs ranklens: whole processes, on the 10,240-rank x 100-step simulated 3D-parallel job of
bench/straggler_bench.py (dp 160 x pp 8 x tp 8, 8 ranks per host, one slow GPU), written once by
`ranklens simulate --out` as Parquet files.

Two databases on one throw-away server: ``view`` (the schema as shipped: the materialised view
fills the rollup as rows are inserted) and ``noview`` (the same without the view: what ingest cost
before it). Per round, alternating:
  ingest      `ranklens ingest` into a fresh database of each kind (rows/s; the view's cost)
  analyze     `ranklens analyze` with the rollup, and with RANKLENS_ROLLUPS=0 (the raw ledger)
  blame       the blame query alone (analyzers.blame.blame_sql) from the rollup and from the raw ledger,
              with a checksum of its rows to show both answer the same
and the rows each holds.

    python bench/rollup_bench.py [--ranks 10240] [--steps 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANKLENS = os.path.join(os.path.dirname(sys.executable), "ranklens")


def _ranklens(*args: str) -> list[str]:
    return [RANKLENS, *args] if os.path.exists(RANKLENS) else [sys.executable, "-m", "ranklens.cli", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def create(port: int, db: str, *, view: bool) -> str:
    """Database ``db`` made the way a user does (`ranklens schema | clickhouse-client`), without the
    rollup's view when ``view`` is False."""
    ddl = _run(_ranklens("schema", "--target", "server", "--database", db)).stdout
    if not view:
        ddl = "\n".join(line for line in ddl.splitlines() if "MATERIALIZED VIEW" not in line) + "\n"
    _run(["clickhouse-client", "--port", str(port), "-mn"], input=ddl)
    return f"clickhouse://default@127.0.0.1:{port}/{db}"


def ingest(url: str, files: list[str]) -> float:
    t = time.perf_counter()
    _run(_ranklens("ingest", "--store", url, *files))
    return time.perf_counter() - t


def analyze(url: str, job: str, *, rollup: bool) -> tuple[float, list[str]]:
    env = dict(os.environ, RANKLENS_ROLLUPS="1" if rollup else "0")
    t = time.perf_counter()
    out = _run(_ranklens("analyze", "--store", url, "--job", job, "--json", "--no-save"), env=env).stdout
    wall = time.perf_counter() - t
    named = []
    for item in json.loads(out)["findings"]:
        f = item.get("finding", item)
        named.append(f"{f['kind']}:{[s['rank'] for s in f.get('suspects', [])][:3]}")
    return wall, sorted(named)


def blame(url: str, job: str, *, rollup: bool) -> tuple[float, tuple]:
    """The blame query of `ranklens analyze` (aligned clocks) and a checksum of its rows."""
    from ranklens.analyzers.blame import blame_offsets, blame_source, blame_sql
    from ranklens.store import open_store

    store = open_store(url, create=False)
    try:
        offsets = blame_offsets(store, job, 0)
        source = blame_source(store, job, 0, offsets) if rollup else None
        if rollup and source is None:
            raise SystemExit("the rollup does not serve this job")
        sql = blame_sql(job, 0, 0, offsets=offsets, rollup_host_offsets=source)
        t = time.perf_counter()
        row = store.query(
            f"SELECT count(), sum(last_rank), sum(at_step), sum(collectives), round(sum(arraySum(delays)) / 1e6) "
            f"FROM ({sql})"
        ).rows()[0]
        return time.perf_counter() - t, tuple(int(x) for x in row)
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=10240)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ranklens-rollup-bench-"))
    job = "bench-rollup"
    culprit = args.ranks // 2 + 3
    t = time.perf_counter()
    _run(
        _ranklens(
            "simulate", "--ranks", str(args.ranks), "--steps", str(args.steps), "--pp", "8", "--tp", "8",
            "--fault", f"slow_gpu:{culprit}:1.2@{args.steps * 2 // 5}", "--seed", "1", "--job", job,
            "--out", str(tmp / "sim"),
        )
    )  # fmt: skip
    files = sorted(str(p) for p in (tmp / "sim").glob("*.parquet"))
    import pyarrow.parquet as pq

    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    ledger = sum(pq.ParquetFile(f).metadata.num_rows for f in files if Path(f).name.startswith("collectives"))
    print(f"simulated {args.ranks:,} ranks x {args.steps} steps: {rows:,} rows in {time.perf_counter() - t:.0f} s")
    port = _free_port()
    env = dict(os.environ, RANKLENS_CH_TCP_PORT=str(port), RANKLENS_CH_HTTP_PORT=str(_free_port()))
    _run(["bash", str(ROOT / "scripts/clickhouse.sh"), "start", str(tmp / "server")], env=env)
    res: dict[str, list[float]] = {k: [] for k in ("ingest_view", "ingest_noview", "analyze_rollup", "analyze_raw")}
    res.update({"blame_rollup": [], "blame_raw": []})
    try:
        for r in range(args.rounds):
            urls = {}
            for kind in ("view", "noview") if r % 2 == 0 else ("noview", "view"):
                urls[kind] = create(port, f"rl_rollup_{kind}_{r}", view=kind == "view")
                dt = ingest(urls[kind], files)
                res[f"ingest_{kind}"].append(rows / dt)
                print(f"round {r + 1} ingest {kind:6s} {rows / dt:9,.0f} rows/s ({dt:5.1f} s)")
                sys.stdout.flush()
            url = urls["view"]
            if r == 0:
                client = ["clickhouse-client", "--port", str(port), "-q"]
                _run([*client, "OPTIMIZE TABLE rl_rollup_view_0.collective_arrivals FINAL"])
                n = _run([*client, "SELECT count() FROM rl_rollup_view_0.collective_arrivals"]).stdout.strip()
                print(f"rows: collectives {ledger:,}, collective_arrivals {int(n):,} once merged")
            for rollup in (True, False) if r % 2 == 0 else (False, True):
                name = "rollup" if rollup else "raw"
                wall, named = analyze(url, job, rollup=rollup)
                res[f"analyze_{name}"].append(wall)
                bq, check = blame(url, job, rollup=rollup)
                res[f"blame_{name}"].append(bq)
                print(f"round {r + 1} {name:6s} analyze {wall:6.2f} s  blame query {bq:5.2f} s {check}  found {named}")
                sys.stdout.flush()
            for u in urls.values():
                _run(["clickhouse-client", "--port", str(port), "-q", f"DROP DATABASE {u.rsplit('/', 1)[1]}"])
    finally:
        subprocess.run(["bash", str(ROOT / "scripts/clickhouse.sh"), "stop", str(tmp / "server")])
        shutil.rmtree(tmp, ignore_errors=True)
    m = {k: statistics.median(v) for k, v in res.items()}
    print(f"\nmedians over {args.rounds} round(s), {args.ranks:,} ranks x {args.steps} steps ({rows:,} rows):")
    print(
        f"ingest with the view {m['ingest_view']:,.0f} rows/s, without {m['ingest_noview']:,.0f} rows/s "
        f"(x{m['ingest_view'] / m['ingest_noview']:.2f})"
    )
    print(
        f"analyze from the rollup {m['analyze_rollup']:.2f} s, raw {m['analyze_raw']:.2f} s "
        f"(x{m['analyze_rollup'] / m['analyze_raw']:.2f})"
    )
    print(
        f"blame query from the rollup {m['blame_rollup']:.2f} s, raw {m['blame_raw']:.2f} s "
        f"(x{m['blame_rollup'] / m['blame_raw']:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
