"""Ingest benchmark: the whole ``ranklens ingest`` command (process start to exit) against its peer
on the same file, in the same run, alternating A/B, medians of ``--rounds`` rounds (issue 18).

    python bench/ingest_bench.py [--rows 200000] [--rounds 3] [--server clickhouse://default@127.0.0.1:19000]

* embedded: a headerless ``collectives.jsonl`` into an embedded store, against chDB reading the
  same file as JSONEachRow (the table's types given) and writing it as Parquet, the embedded
  store's part format.
* server (with --server or $RANKLENS_BENCH_CLICKHOUSE): the JSONL file against ``clickhouse-client
  ... FORMAT JSONEachRow``, and the same rows as Parquet against clickhouse-driver's
  ``insert_dataframe`` of ``pandas.read_parquet``; each round into a scratch database of its own,
  dropped at the end (no other database is touched).

The stores (and scratch databases) are created before the timed command, as a user ingesting
into an existing store has them. Ratio = peer seconds / ranklens seconds (>= 0.7: the goal);
peak memory is the process's max RSS (``getrusage`` of the child).
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
import uuid
from collections.abc import Callable
from pathlib import Path

# the console script users run (pyproject's [project.scripts]), next to this interpreter
_SCRIPT = Path(sys.executable).with_name("ranklens")
Run = Callable[[int], tuple[float, float]]  # round number -> (seconds, peak RSS MB)
ROWS = 0
RANKLENS = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ranklens.cli"]

CHDB_PEER = """
import sys, chdb
src, dst, structure = sys.argv[1:4]
chdb.query(f"INSERT INTO FUNCTION file('{dst}', Parquet, '{structure}') "
           f"SELECT * FROM file('{src}', JSONEachRow, '{structure}')")
"""

DATAFRAME_PEER = """
import sys, pandas, clickhouse_driver
host, port, db, src, columns = sys.argv[1:6]
df = pandas.read_parquet(src, columns=columns.split(","))
c = clickhouse_driver.Client(host=host, port=int(port), database=db, settings={"use_numpy": True})
c.insert_dataframe(f"INSERT INTO collectives ({columns}) VALUES", df)
"""


def write_jsonl(path: Path, rows: int, ranks: int = 64, seed: int = 0) -> None:
    """``rows`` collective records of a ``ranks``-rank job, one JSON object a line, no header."""
    import numpy as np

    rng = np.random.default_rng(seed)
    i = np.arange(rows)
    seq = i // ranks
    enter = 1_790_000_000_000_000_000 + seq * 20_000_000 + rng.integers(0, 2_000_000, rows)
    with open(path, "w") as f:
        for r, s, e in zip((i % ranks).tolist(), seq.tolist(), enter.tolist()):
            f.write(
                f'{{"job_id":"bench","attempt":0,"rank":{r},"pg":"0","seq":{s},"op":"all_reduce",'
                f'"nbytes":1048576,"dtype":"bfloat16","peer":-1,"step":{s // 16},"enter_ns":{e},'
                f'"start_ns":0,"end_ns":{e + 500_000},"clock":"cpu","async_op":0}}\n'
            )


def _run_rusage(argv: list[str], stdin: Path | None = None) -> tuple[float, float]:
    """(seconds, peak RSS MB) of ``argv`` run to its exit. The peak comes from GNU time's ``%M``:
    a child spawned straight from this (large) process would report this process's RSS as its own
    floor (Linux carries the pre-exec memory's high-water mark into the child's ``ru_maxrss``)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as rep, tempfile.TemporaryFile() as err:
        with open(stdin or os.devnull, "rb") as inp:
            t = time.perf_counter()
            code = subprocess.call(
                ["/usr/bin/time", "-f", "%M", "-o", rep.name, *argv], stdin=inp, stdout=subprocess.DEVNULL, stderr=err
            )
            dt = time.perf_counter() - t
        if code:
            err.seek(0)
            raise SystemExit(f"{' '.join(argv[:4])} ... exited {code}: {err.read().decode(errors='replace')[-2000:]}")
        return dt, int(rep.read().split()[-1]) / 1024


def rounds(
    name: str,
    a: tuple[str, Callable[[int], tuple[float, float]]],
    b: tuple[str, Callable[[int], tuple[float, float]]],
    n: int,
) -> None:
    """Run ``a`` and ``b`` ``n`` times each, alternating which goes first; print medians and the ratio."""
    res: dict[str, list[tuple[float, float]]] = {a[0]: [], b[0]: []}
    for i in range(n):
        for label, fn in (a, b) if i % 2 == 0 else (b, a):
            res[label].append(fn(i))
            print(f"  {name} round {i + 1}: {label:>22s} {res[label][-1][0]:6.2f} s {res[label][-1][1]:7.0f} MB")
    (ta, ma), (tb, mb) = (
        (statistics.median(x[0] for x in res[k]), statistics.median(x[1] for x in res[k])) for k in (a[0], b[0])
    )
    print(
        f"{name}: ranklens {ta:.2f} s ({ROWS / ta:,.0f} rows/s, {ma:.0f} MB) | {b[0]} {tb:.2f} s "
        f"({ROWS / tb:,.0f} rows/s, {mb:.0f} MB) | ratio peer/ranklens {tb / ta:.2f} (goal >= 0.70), "
        f"memory ranklens/peer {ma / mb:.2f} (goal <= 1)"
    )


STRUCTURE = (
    "job_id String, attempt Int32, rank Int32, pg String, seq Int64, op String, nbytes Int64, dtype String, "
    "peer Int32, step Int64, enter_ns Int64, start_ns Int64, end_ns Int64, clock String, async_op UInt8"
)


def main() -> int:
    global ROWS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server", default=os.environ.get("RANKLENS_BENCH_CLICKHOUSE"))
    p.add_argument(
        "--ranklens-cmd",
        help="the command timed as ranklens (default: this environment's console script), e.g. "
        "another checkout's for a before/after comparison",
    )
    args = p.parse_args()
    if args.rounds < 1 or args.rows < 1:
        p.error("--rows and --rounds must be at least 1")
    ROWS = args.rows
    if args.ranklens_cmd:
        RANKLENS[:] = args.ranklens_cmd.split()
    from ranklens.store import open_store

    tmp = Path(tempfile.mkdtemp(prefix="ranklens-ingest-bench-"))
    scratch: list = []
    try:
        src = tmp / "collectives.jsonl"
        t = time.perf_counter()
        write_jsonl(src, args.rows)
        print(
            f"{args.rows:,} headerless collective rows, {src.stat().st_size / 1e6:.0f} MB of JSONL, written in "
            f"{time.perf_counter() - t:.1f} s ({os.cpu_count()} CPUs, python {sys.version.split()[0]})"
        )

        def ranklens_embedded(i: int) -> tuple[float, float]:
            url = f"embedded://{tmp}/store{i}"
            open_store(url).close()
            return _run_rusage([*RANKLENS, "ingest", "--store", url, str(src)])

        def chdb_peer(i: int) -> tuple[float, float]:
            return _run_rusage([sys.executable, "-c", CHDB_PEER, str(src), str(tmp / f"peer{i}.parquet"), STRUCTURE])

        rounds("embedded JSONL", ("ranklens", ranklens_embedded), ("chDB JSONEachRow", chdb_peer), args.rounds)
        if not args.server:
            print("server: skipped (pass --server clickhouse://... or set RANKLENS_BENCH_CLICKHOUSE)")
            return 0
        base = args.server.rstrip("/")
        pq_src = tmp / "collectives.parquet"
        import pyarrow.parquet as pq

        from ranklens.formats.rows import read_jsonl

        pq.write_table(read_jsonl(src)[1].drop_columns(["ingest_id"]), pq_src)
        columns = ",".join(s.split()[0] for s in STRUCTURE.split(", "))

        def database(tag: str) -> tuple[str, object]:
            db = f"ranklens_bench_{uuid.uuid4().hex[:8]}_{tag}"
            store = open_store(f"{base}/{db}")
            scratch.append(store)
            return db, store

        def count(store: object) -> None:
            n = store.query("SELECT count() FROM collectives").scalar()  # type: ignore[attr-defined]
            if n != args.rows:
                raise SystemExit(f"{store}: {n} rows, expected {args.rows}")

        def ranklens_server(path: Path) -> Run:
            def run(i: int) -> tuple[float, float]:
                db, store = database("r")
                res = _run_rusage([*RANKLENS, "ingest", "--store", f"{base}/{db}", str(path)])
                count(store)
                return res

            return run

        from ranklens.store.server import ServerConfig

        sc = ServerConfig.from_url(f"{base}/default")

        def client_peer(i: int) -> tuple[float, float]:
            db, store = database("c")
            argv = [
                "clickhouse-client", "--host", sc.host, "--port", str(sc.port), "--user", sc.user,
                "--database", db, "--query", f"INSERT INTO collectives ({columns}) FORMAT JSONEachRow",
            ]  # fmt: skip
            if sc.password:
                argv += ["--password", sc.password]
            res = _run_rusage(argv, stdin=src)
            count(store)
            return res

        def dataframe_peer(i: int) -> tuple[float, float]:
            db, store = database("d")
            res = _run_rusage([sys.executable, "-c", DATAFRAME_PEER, sc.host, str(sc.port), db, str(pq_src), columns])
            count(store)
            return res

        rounds("server JSONL", ("ranklens", ranklens_server(src)), ("clickhouse-client", client_peer), args.rounds)
        rounds(
            "server Parquet", ("ranklens", ranklens_server(pq_src)), ("insert_dataframe", dataframe_peer), args.rounds
        )
    finally:
        for store in scratch:
            store.drop_database()  # type: ignore[attr-defined]
            store.close()  # type: ignore[attr-defined]
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
