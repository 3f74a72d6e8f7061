"""`ranklens ingest` and `ranklens analyze` on a ClickHouse cluster (2 shards x 2 replicas, Debian's
18.16, scripts/clickhouse_cluster.sh) next to one server (scripts/clickhouse.sh), as a user runs
them: whole processes, on the 10,240-rank x 100-step simulated 3D-parallel job of
bench/straggler_bench.py (dp 160 x pp 8 x tp 8, one slow GPU), written once by
`ranklens simulate --out` as Parquet files.

Targets, alternating in every round (a fresh database each, so every round ingests):
  server    one clickhouse-server
  rank      the cluster with the collectives sharded by cityHash64(job_id, rank) (the key before
            issue 19: a collective's members on every shard)
  pgseq     the cluster with the collectives sharded by cityHash64(job_id, pg, seq): one collective's
            members on one shard (issue 19 item 2; the key `ranklens schema --target cluster` gives)
Per target and round: ingest rows/s, `ranklens analyze` seconds, and the blame query alone
(analyzers.blame.collective_blame_sql, the GROUP BY (pg, seq) over every collective row) merged on
the initiator; on `pgseq` also shard-local (distributed_group_by_no_merge=1, correct there only
because the grouping key determines the shard), with a checksum to show it is the same answer.

    python bench/cluster_bench.py [--ranks 10240] [--steps 100] [--rounds 3] [--targets server,rank,pgseq]
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
KEYS = {"rank": "cityHash64(job_id, rank)", "pgseq": "cityHash64(job_id, pg, seq)"}


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


class Targets:
    """A throw-away single server and cluster (or the ones named), and a database on each per round."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.single_port = _free_port()
        env = dict(os.environ, RANKLENS_CH_TCP_PORT=str(self.single_port), RANKLENS_CH_HTTP_PORT=str(_free_port()))
        _run(["bash", str(ROOT / "scripts/clickhouse.sh"), "start", str(tmp / "single")], env=env)
        print(_run(["bash", str(ROOT / "scripts/clickhouse_cluster.sh"), "start", str(tmp / "cluster")]).stdout)
        ports = dict(line.split("=") for line in (tmp / "cluster/cluster.env").read_text().split())
        self.cluster_port = int(ports["CH1_TCP"])

    def port(self, target: str) -> int:
        return self.single_port if target == "server" else self.cluster_port

    def create(self, target: str, db: str) -> str:
        """Make database ``db`` on the target the way a user does (`ranklens schema | clickhouse-client`)."""
        port = str(self.port(target))
        kind = "server" if target == "server" else "cluster"
        ddl = _run(_ranklens("schema", "--target", kind, "--database", db)).stdout
        if target in KEYS:  # the collectives' Distributed table with this target's shard key
            import re

            ddl, n = re.subn(r"'collectives_local', [^;]*\);", f"'collectives_local', {KEYS[target]});", ddl)
            assert n == 1, "the collectives' Distributed table changed: update the bench"
        _run(["clickhouse-client", "--port", port, "-mn"], input=ddl)
        return f"clickhouse://default@127.0.0.1:{port}/{db}"

    def drop(self, target: str, db: str) -> None:
        on = " ON CLUSTER ranklens" if target != "server" else ""
        _run(["clickhouse-client", "--port", str(self.port(target)), "-q", f"DROP DATABASE IF EXISTS {db}{on}"])

    def stop(self) -> None:
        subprocess.run(["bash", str(ROOT / "scripts/clickhouse_cluster.sh"), "stop", str(self.tmp / "cluster")])
        subprocess.run(["bash", str(ROOT / "scripts/clickhouse.sh"), "stop", str(self.tmp / "single")])


def ingest(url: str, files: list[str]) -> float:
    t = time.perf_counter()
    _run(_ranklens("ingest", "--store", url, *files))
    return time.perf_counter() - t


def analyze(url: str, job: str) -> tuple[float, list[str]]:
    t = time.perf_counter()
    out = _run(_ranklens("analyze", "--store", url, "--job", job, "--json", "--no-save")).stdout
    wall = time.perf_counter() - t
    named = []
    for item in json.loads(out)["findings"]:
        f = item.get("finding", item)
        named.append(f"{f['kind']}:{[s['rank'] for s in f.get('suspects', [])][:3]}")
    return wall, sorted(named)


def blame_query(url: str, job: str, *, no_merge: bool) -> tuple[float, tuple]:
    """The per-collective blame (GROUP BY pg, seq over the whole job) and a checksum of its rows."""
    from urllib.parse import urlsplit

    from clickhouse_driver import Client

    from ranklens.analyzers.blame import collective_blame_sql

    sql = collective_blame_sql(job, 0, 0, step_from=0, step_to=10**9)
    u = urlsplit(url)
    client = Client(u.hostname, port=u.port, database=u.path.lstrip("/"), send_receive_timeout=600)
    try:
        t = time.perf_counter()
        row = client.execute(
            f"SELECT count(), sum(last_rank), sum(members), sum(c_step) FROM ({sql})",
            settings={"distributed_group_by_no_merge": int(no_merge)},
        )[0]
        return time.perf_counter() - t, tuple(int(x) for x in row)
    finally:
        client.disconnect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=10240)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--targets", default="server,rank,pgseq")
    args = ap.parse_args()
    targets = args.targets.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="ranklens-cluster-bench-"))
    job = "bench-cluster"
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
    print(f"simulated {args.ranks:,} ranks x {args.steps} steps: {rows:,} rows in {time.perf_counter() - t:.0f} s")
    sys.stdout.flush()
    res: dict[str, dict[str, list[float]]] = {
        x: {"ingest": [], "analyze": [], "blame": [], "local": []} for x in targets
    }
    tg = Targets(tmp)
    try:
        for r in range(args.rounds):
            for target in targets:
                db = f"rl_bench_{target}_{r}"
                url = tg.create(target, db)
                dt = ingest(url, files)
                res[target]["ingest"].append(rows / dt)
                wall, named = analyze(url, job)
                res[target]["analyze"].append(wall)
                bq, check = blame_query(url, job, no_merge=False)
                res[target]["blame"].append(bq)
                line = (
                    f"round {r + 1}/{args.rounds} {target:8s} ingest {rows / dt:9,.0f} rows/s ({dt:5.1f} s)  "
                    f"analyze {wall:6.2f} s  blame query {bq:5.2f} s {check}"
                )
                if target == "pgseq":
                    lq, lcheck = blame_query(url, job, no_merge=True)
                    res[target]["local"].append(lq)
                    line += f"  shard-local {lq:5.2f} s {'same' if lcheck == check else f'DIFFERENT {lcheck}'}"
                print(line + f"  found {named}")
                sys.stdout.flush()
                tg.drop(target, db)
    finally:
        tg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nmedians over {args.rounds} round(s), {args.ranks:,} ranks x {args.steps} steps ({rows:,} rows):")
    base = res.get("server")
    print(f"{'target':8s} {'ingest rows/s':>14s} {'x server':>9s} {'analyze s':>10s} {'x server':>9s} {'blame s':>8s}")
    for target in targets:
        m = {k: statistics.median(v) for k, v in res[target].items() if v}
        ri = f"{m['ingest'] / statistics.median(base['ingest']):.2f}" if base else "-"
        ra = f"{m['analyze'] / statistics.median(base['analyze']):.2f}" if base else "-"
        extra = f"  shard-local blame {m['local']:.2f} s" if "local" in m else ""
        print(f"{target:8s} {m['ingest']:14,.0f} {ri:>9s} {m['analyze']:10.2f} {ra:>9s} {m['blame']:8.2f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
