"""Storage capacity of ranklens' tables (issue 19): rows and bytes per rank per step, measured.

Makes one simulated job with `ranklens simulate` (default 1,024 ranks x 50 steps, dp 16 x pp 8 x
tp 8, 8 microbatches and 4 tensor-parallel all_reduces per stage per microbatch: ~93 collectives
per rank per step, near the issue's 100), writes it into (a) a throw-away ClickHouse 18.16 server
(scripts/clickhouse.sh, free ports, stopped at the end) and (b) chDB (a current ClickHouse, MergeTree
tables from the same DDL, loaded from the same job's Parquet files), merges every table into one part
(OPTIMIZE ... FINAL) and reads system.parts / system.columns (active parts); and (c) the embedded
store (`ranklens ingest` of those files: Parquet + zstd parts, sizes from its manifest). Prints per table:
rows per rank per step, compressed / uncompressed / on-disk bytes per row, the compression ratio,
and the extrapolation to a 10,240-rank job at 2 s per step per day and per week.

On chDB only, the ledger (`collectives`) is copied into experimental tables with the codecs and
LowCardinality strings the issue proposes (not the shipped schema: 18.16 has neither CODEC nor, by
default, LowCardinality) and the bytes per row before/after are printed, per variant and per column.

    python bench/capacity_bench.py [--ranks 1024] [--steps 50] [--microbatches 8] [--tp-collectives 4]
                                   [--target-ranks 10240] [--step-s 2] [--collectives-per-step 100]
                                   [--no-server] [--no-chdb] [--no-embedded]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import free_port

from ranklens.schema import TABLES, render_server_ddl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKLENS = os.path.join(os.path.dirname(sys.executable), "ranklens")
SIM_TABLES = ("collectives", "phases", "steps", "ranks", "process_groups")
PER_STEP = ("collectives", "phases", "steps")  # one row per rank x step (x call / phase)
DB = "ranklens_capacity"
NS_COLS = ("enter_ns", "start_ns", "end_ns")
LC_COLS = ("job_id", "pg", "op", "dtype", "clock")
WIDE = "SETTINGS min_bytes_for_wide_part = 0"  # per-column sizes (compact parts report none)


def _ranklens(*args: str) -> list[str]:
    return [RANKLENS, *args] if os.path.exists(RANKLENS) else [sys.executable, "-m", "ranklens.cli", *args]


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x < 1e12 else f"{x / 1e12:,.2f} TB"


# ---------------------------------------------------------------- measuring


def sizes(query, db: str) -> dict[str, dict]:
    """Per table of ``db``: active parts' rows and bytes (compressed, uncompressed, on disk), and
    per column compressed / uncompressed bytes. ``query(sql)`` returns rows as tuples."""
    out: dict[str, dict] = {}
    for t, parts, rows, comp, uncomp, disk in query(
        "SELECT table, count(), sum(rows), sum(data_compressed_bytes), sum(data_uncompressed_bytes), "
        f"sum(bytes_on_disk) FROM system.parts WHERE database = '{db}' AND active GROUP BY table"
    ):
        out[t] = dict(parts=int(parts), rows=int(rows), comp=int(comp), uncomp=int(uncomp), disk=int(disk), cols={})
    for t, name, type_, comp, uncomp in query(
        "SELECT table, name, type, data_compressed_bytes, data_uncompressed_bytes FROM system.columns "
        f"WHERE database = '{db}'"
    ):
        if t in out:
            out[t]["cols"][name] = (type_, int(comp), int(uncomp))
    return out


def report(name: str, got: dict[str, dict], rank_steps: int, args: argparse.Namespace, coll_per_step: float) -> None:
    """Print the per-table table and the extrapolation for one store."""
    print(f"\n### {name}: per table (active parts after OPTIMIZE FINAL)\n")
    print("| table | rows | rows / rank / step | compressed B/row | uncompressed B/row | ratio | on disk B/row |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t in SIM_TABLES:
        s = got.get(t)
        if not s or not s["rows"]:
            continue
        r = s["rows"]
        per = f"{r / rank_steps:,.2f}" if t in PER_STEP else f"{r:,} per job"
        print(
            f"| {t} | {r:,} | {per} | {s['comp'] / r:.2f} | {s['uncomp'] / r:.2f} | "
            f"{s['uncomp'] / max(1, s['comp']):.1f}x | {s['disk'] / r:.2f} |"
        )
    steps_day = 86400 / args.step_s
    rank_steps_day = args.target_ranks * steps_day
    print(
        f"\n### {name}: a {args.target_ranks:,}-rank job at {args.step_s:g} s/step "
        f"({steps_day:,.0f} steps/day; collectives at {args.collectives_per_step:g} per rank per step, "
        f"the simulated job had {coll_per_step:.1f})\n"
    )
    print("| table | rows / day | on disk / day | on disk / week | uncompressed / day |")
    print("|---|---:|---:|---:|---:|")
    tot_disk = tot_unc = 0.0
    for t in PER_STEP:
        s = got.get(t)
        if not s or not s["rows"]:
            continue
        per_rs = s["rows"] / rank_steps
        if t == "collectives":
            per_rs = args.collectives_per_step
        rows_day = rank_steps_day * per_rs
        disk_day = rows_day * s["disk"] / s["rows"]
        unc_day = rows_day * s["uncomp"] / s["rows"]
        tot_disk += disk_day
        tot_unc += unc_day
        print(f"| {t} | {rows_day:,.3g} | {_gb(disk_day)} | {_gb(7 * disk_day)} | {_gb(unc_day)} |")
    print(f"| **all three** | | **{_gb(tot_disk)}** | **{_gb(7 * tot_disk)}** | {_gb(tot_unc)} |")


def columns_table(name: str, got: dict[str, dict], tables: tuple[str, ...] = ("collectives",)) -> None:
    for t in tables:
        s = got.get(t)
        if not s or not s["rows"]:
            continue
        r = s["rows"]
        print(f"\n### {name}: `{t}` per column\n")
        print("| column | type | compressed B/row | uncompressed B/row | ratio |")
        print("|---|---|---:|---:|---:|")
        for col, (type_, comp, unc) in sorted(s["cols"].items(), key=lambda kv: -kv[1][1]):
            print(f"| {col} | {type_} | {comp / r:.3f} | {unc / r:.2f} | {unc / max(1, comp):.1f}x |")


# ---------------------------------------------------------------- the two stores


def simulate(args: argparse.Namespace, job: str, out_dir: str, store_url: str | None) -> dict[str, int]:
    cmd = _ranklens("simulate", "--ranks", str(args.ranks), "--steps", str(args.steps), "--pp", "8", "--tp", "8")
    cmd += ["--microbatches", str(args.microbatches), "--tp-collectives", str(args.tp_collectives)]
    cmd += ["--seed", "1", "--job", job, "--out", out_dir, "--truth", os.devnull]
    if store_url:
        cmd += ["--store", store_url]
    t = time.perf_counter()
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = {}
    for line in res.stdout.splitlines():
        name, sep, n = line.strip().partition(": ")
        if sep and name in SIM_TABLES:
            rows[name] = int(n.replace(",", ""))
    where = f"{out_dir} and {store_url}" if store_url else out_dir
    print(
        f"simulated {job}: {args.ranks:,} ranks x {args.steps} steps -> {rows} into {where} in "
        f"{time.perf_counter() - t:.1f} s"
    )
    return rows


def run_server(args: argparse.Namespace, job: str, out_dir: str, tmp: str) -> dict[str, dict] | None:
    """Start a ClickHouse 18.16 server, simulate into it (and into out_dir), measure, stop it."""
    from clickhouse_driver import Client

    ch_dir = os.path.join(tmp, "clickhouse")
    tcp, http = free_port(), free_port()
    env = {**os.environ, "RANKLENS_CH_TCP_PORT": str(tcp), "RANKLENS_CH_HTTP_PORT": str(http)}
    script = os.path.join(ROOT, "scripts", "clickhouse.sh")
    subprocess.run([script, "start", ch_dir], check=True, env=env)
    try:
        simulate(args, job, out_dir, f"clickhouse://default@127.0.0.1:{tcp}/{DB}")
        c = Client("127.0.0.1", port=tcp, send_receive_timeout=1800)
        version = c.execute("SELECT version()")[0][0]
        t = time.perf_counter()
        for name in SIM_TABLES:
            c.execute(f"OPTIMIZE TABLE {DB}.{name} FINAL")
        print(f"server {version}: OPTIMIZE FINAL of {len(SIM_TABLES)} tables in {time.perf_counter() - t:.1f} s")
        got = sizes(c.execute, DB)
        got["_version"] = version
        c.disconnect()
        return got
    finally:
        subprocess.run([script, "stop", ch_dir], check=False, env=env)


def _chdb(tmp: str):
    cwd = os.getcwd()
    os.chdir(tmp)  # `import chdb` reads a config.xml in the current directory: be somewhere without one
    try:
        from chdb import session as chdb_session
    finally:
        os.chdir(cwd)
    return chdb_session.Session(os.path.join(tmp, "chdb"))


def _rows(sess, sql: str) -> list[tuple]:
    text = str(sess.query(sql, "TSV")).strip("\n")
    return [tuple(line.split("\t")) for line in text.splitlines()] if text else []


def run_chdb(args: argparse.Namespace, out_dir: str, tmp: str) -> tuple[dict[str, dict], list[dict], str]:
    """Load the job's Parquet files into chDB MergeTree tables (the server DDL), measure; then the
    codec / LowCardinality variants of `collectives`."""
    sess = _chdb(tmp)
    version = _rows(sess, "SELECT version()")[0][0]
    for stmt in render_server_ddl(DB).split(";\n"):
        stmt = "\n".join(x for x in stmt.splitlines() if not x.startswith("--")).strip()
        if stmt.startswith("CREATE TABLE"):
            stmt += f" {WIDE}"
        if stmt:
            sess.query(stmt)
    t = time.perf_counter()
    for name in SIM_TABLES:
        tab = TABLES[name]
        cols = ", ".join(tab.column_names)
        path = os.path.join(out_dir, f"{name}.parquet")
        sess.query(f"INSERT INTO {DB}.{name} ({cols}) SELECT {cols} FROM file('{path}', Parquet, '{tab.structure()}')")
        sess.query(f"OPTIMIZE TABLE {DB}.{name} FINAL")
    print(f"chDB {version}: loaded and merged {len(SIM_TABLES)} tables in {time.perf_counter() - t:.1f} s")
    got = sizes(lambda sql: _rows(sess, sql), DB)
    variants = codec_variants(sess)
    sess.close()
    return got, variants, version


def run_embedded(out_dir: str, tmp: str) -> dict[str, dict]:
    """`ranklens ingest` the job's Parquet files into an embedded store (Parquet + zstd parts, in the
    order the files hold the rows) and read each table's parts from its manifest."""
    root = os.path.join(tmp, "embedded")
    files = [os.path.join(out_dir, f"{t}.parquet") for t in SIM_TABLES]
    t = time.perf_counter()
    subprocess.run(_ranklens("ingest", *files, "--store", f"embedded://{root}"), check=True, capture_output=True)
    with open(os.path.join(root, "manifest.json")) as f:
        manifest = json.load(f)
    out = {}
    for name in SIM_TABLES:
        parts = manifest["tables"].get(name, [])
        disk = sum(os.path.getsize(os.path.join(root, "parts", name, p[0])) for p in parts)
        out[name] = dict(parts=len(parts), rows=sum(p[1] for p in parts), disk=disk)
    print(f"\nembedded store: ingested {len(files)} files in {time.perf_counter() - t:.1f} s")
    return out


def report_embedded(got: dict[str, dict], rank_steps: int, args: argparse.Namespace) -> None:
    rank_steps_day = args.target_ranks * 86400 / args.step_s
    print("\n### embedded store (Parquet parts, zstd): per table, and the 10,240-rank job per day / week\n")
    print("| table | rows | parts | rows / rank / step | Parquet B/row | on disk / day | on disk / week |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    tot = 0.0
    for t in SIM_TABLES:
        s = got[t]
        if not s["rows"]:
            continue
        r = s["rows"]
        per_rs = r / rank_steps
        if t in PER_STEP:
            rows_day = rank_steps_day * (args.collectives_per_step if t == "collectives" else per_rs)
            day = rows_day * s["disk"] / r
            tot += day
            cells = f"{per_rs:,.2f} | {s['disk'] / r:.2f} | {_gb(day)} | {_gb(7 * day)}"
        else:
            cells = f"{r:,} per job | {s['disk'] / r:.2f} | | "
        print(f"| {t} | {r:,} | {s['parts']} | {cells} |")
    print(f"| **collectives + phases + steps** | | | | | **{_gb(tot)}** | **{_gb(7 * tot)}** |")


def _variant_structure(lc: bool, ns_codec: str | None, rest_codec: str | None, seq_codec: str | None) -> str:
    cols = []
    for c in TABLES["collectives"].columns:
        type_ = f"LowCardinality({c.type})" if lc and c.name in LC_COLS else c.type
        codec = ns_codec if c.name in NS_COLS else (seq_codec if c.name in SEQ_COLS else None) or rest_codec
        cols.append(f"{c.name} {type_}" + (f" CODEC({codec})" if codec else ""))
    return ", ".join(cols)


SEQ_COLS = ("seq", "step")
VARIANTS = (
    # (label, LowCardinality strings, codec of the *_ns columns, codec of every other column,
    #  codec of seq and step when not the rest's)
    ("v0 as shipped (String, LZ4 default)", False, None, None, None),
    ("v1 LowCardinality strings only", True, None, None, None),
    ("v2 LC + Delta, ZSTD on *_ns", True, "Delta, ZSTD", None, None),
    ("v3 LC + T64, ZSTD on *_ns", True, "T64, ZSTD", None, None),
    ("v4 LC + DoubleDelta, ZSTD on *_ns", True, "DoubleDelta, ZSTD", None, None),
    ("v5 ZSTD on every column (no LC, no Delta)", False, "ZSTD", "ZSTD", None),
    ("v6 LC + Delta, ZSTD on *_ns + ZSTD on the rest", True, "Delta, ZSTD", "ZSTD", None),
    ("v7 LC + T64, ZSTD on *_ns + Delta, ZSTD on seq, step", True, "T64, ZSTD", None, "Delta, ZSTD"),
)


def codec_variants(sess) -> list[dict]:
    """Copy `collectives` into one table per variant (same ORDER BY), merge, measure; and time a scan
    of the ns columns (median of 3: the cost of reading them back)."""
    order = ", ".join(TABLES["collectives"].order_by)
    cols = ", ".join(TABLES["collectives"].column_names)
    out = []
    for i, (label, lc, ns_codec, rest_codec, seq_codec) in enumerate(VARIANTS):
        name = f"coll_v{i}"
        sess.query(
            f"CREATE TABLE {DB}.{name} ({_variant_structure(lc, ns_codec, rest_codec, seq_codec)}) "
            f"ENGINE = MergeTree() ORDER BY ({order}) {WIDE}"
        )
        t = time.perf_counter()
        sess.query(f"INSERT INTO {DB}.{name} ({cols}) SELECT {cols} FROM {DB}.collectives")
        sess.query(f"OPTIMIZE TABLE {DB}.{name} FINAL")
        load_s = time.perf_counter() - t
        scans = []
        for _ in range(3):
            t = time.perf_counter()
            sess.query(
                f"SELECT pg, seq, max(enter_ns) - min(enter_ns), max(end_ns) - min(start_ns) FROM {DB}.{name} "
                "GROUP BY pg, seq FORMAT Null"
            )
            scans.append(time.perf_counter() - t)
        got = sizes(lambda sql: _rows(sess, sql), DB)[name]
        out.append(dict(label=label, load_s=load_s, scan_s=statistics.median(scans), **got))
        sess.query(f"DROP TABLE {DB}.{name}")
    return out


def print_variants(variants: list[dict], args: argparse.Namespace) -> None:
    base = variants[0]
    r = base["rows"]
    rows_day = args.target_ranks * 86400 / args.step_s * args.collectives_per_step
    print(f"\n### chDB: `collectives` codec / LowCardinality variants ({r:,} rows, one part each)\n")
    print(
        "| variant | compressed B/row | on disk B/row | vs shipped | on disk / day (10,240 ranks) | on disk / week | "
        "insert+merge s | blame-style scan s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        day = rows_day * v["disk"] / r
        print(
            f"| {v['label']} | {v['comp'] / r:.2f} | {v['disk'] / r:.2f} | {v['disk'] / base['disk']:.0%} | "
            f"{_gb(day)} | {_gb(7 * day)} | {v['load_s']:.1f} | {v['scan_s']:.2f} |"
        )
    print("\n### chDB: `collectives` compressed B/row per column and variant\n")
    print("| column | " + " | ".join(v["label"].split()[0] for v in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for col in sorted(base["cols"], key=lambda c: -base["cols"][c][1]):
        print(f"| {col} | " + " | ".join(f"{v['cols'][col][1] / r:.3f}" for v in variants) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--tp-collectives", type=int, default=4)
    ap.add_argument("--target-ranks", type=int, default=10240)
    ap.add_argument("--step-s", type=float, default=2.0)
    ap.add_argument("--collectives-per-step", type=float, default=100.0, help="per rank, for the extrapolation")
    ap.add_argument("--no-server", action="store_true", help="skip the ClickHouse 18.16 server")
    ap.add_argument("--no-chdb", action="store_true", help="skip chDB")
    ap.add_argument("--no-embedded", action="store_true", help="skip the embedded store (Parquet parts)")
    args = ap.parse_args()
    if args.ranks % 64:
        ap.error("--ranks must be a multiple of 64 (pp 8 x tp 8)")
    print("command: python bench/capacity_bench.py " + " ".join(sys.argv[1:]))
    tmp = tempfile.mkdtemp(prefix="ranklens-capacity-")
    out_dir = os.path.join(tmp, "parquet")
    job = f"capacity-{uuid.uuid4().hex[:6]}"
    rank_steps = args.ranks * args.steps
    try:
        server = None
        if not args.no_server:
            server = run_server(args, job, out_dir, tmp)
        else:
            simulate(args, job, out_dir, None)
        results = []
        if server:
            results.append((f"ClickHouse {server.pop('_version')} server", server))
        variants = []
        if not args.no_chdb:
            got, variants, version = run_chdb(args, out_dir, tmp)
            results.append((f"chDB (ClickHouse {version})", got))
        for name, got in results:
            coll = got["collectives"]["rows"] / rank_steps
            report(name, got, rank_steps, args, coll)
            columns_table(name, got)
        if variants:
            print_variants(variants, args)
        if not args.no_embedded:
            report_embedded(run_embedded(out_dir, tmp), rank_steps, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
