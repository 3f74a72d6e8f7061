"""The fault simulator: ledger invariants, what each fault changes, ground truth, determinism, CLI."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from ranklens.errors import ConfigError
from ranklens.simulate import Fault, FaultKind, Layout, SimParams, check_job, parse_fault, simulate
from ranklens.simulate_cli import simulate_command

T0 = 1_790_000_000_000_000_000
JOB = dict(ranks=32, steps=20, pp=2, tp=4, start_ns=T0)  # dp = 4; 4 nodes of 8 ranks
LEAVE_NS = SimParams().leave_jitter_ns


def _rows(store, sql: str) -> list[tuple]:
    return store.query(sql).rows()


def _compute_ms(store, job: str) -> dict[tuple[int, int], float]:
    """(rank, step) -> forward + backward compute: those phases minus the time spent inside collectives."""
    sql = f"""
        SELECT rank, step, fb - coll FROM
          (SELECT rank, step, sum(end_ns - start_ns) AS fb FROM phases
           WHERE job_id = '{job}' AND phase IN ('forward', 'backward') GROUP BY rank, step) AS p
        ALL INNER JOIN
          (SELECT rank, step, sum(end_ns - enter_ns) AS coll FROM collectives
           WHERE job_id = '{job}' GROUP BY rank, step) AS c
        USING (rank, step)"""
    return {(r, s): v / 1e6 for r, s, v in _rows(store, sql)}


def _ratio(compute: dict[tuple[int, int], float], ranks: list[int], peers: list[int], steps: range) -> float:
    mine = np.median([compute[r, s] for r in ranks for s in steps])
    theirs = np.median([compute[r, s] for r in peers for s in steps])
    return float(mine / theirs)


def _same(a, b) -> bool:
    """Arrow tables equal, NaN equal to NaN."""
    if a.schema != b.schema or a.num_rows != b.num_rows:
        return False
    for x, y in zip(a.columns, b.columns):
        if x.type == "double":
            if not np.array_equal(x.to_numpy(), y.to_numpy(), equal_nan=True):
                return False
        elif not x.equals(y):
            return False
    return True


# -- layout, tables ---------------------------------------------------------------------
def test_tables_layout_and_groups(embedded_store):
    res = simulate(embedded_store, job_id="j", seed=1, **JOB)
    assert res.rows == {
        "ranks": 32,
        "process_groups": 1 + 8 + 8 + 16,
        "collectives": 4480,
        "phases": 2560,
        "steps": 640,
    }
    assert res.truth["layout"]["dp"] == 4 and res.truth["layout"]["nodes"] == 4 and res.truth["healthy"]
    layout = Layout(dp=4, pp=2, tp=4)
    got = _rows(embedded_store, "SELECT rank, host, local_rank, pp, dp, tp, world_size FROM ranks ORDER BY rank")
    assert got == [(r, f"node{r // 8:04d}", r % 8, *layout.coords(r), 32) for r in range(32)]
    groups = dict(_rows(embedded_store, "SELECT name, arraySort(ranks) FROM process_groups"))
    assert groups["default_pg"] == list(range(32))
    assert groups["tp_5"] == [20, 21, 22, 23]  # tp fastest
    assert groups["dp_1"] == [1, 5, 9, 13]  # pp 0, tp 1: dp varies
    assert groups["pp_3"] == [3, 19]  # dp 0, tp 3: stages
    assert {b for (b,) in _rows(embedded_store, "SELECT DISTINCT backend FROM process_groups")} == {"nccl"}


def test_collective_invariants(embedded_store):
    simulate(embedded_store, job_id="j", seed=2, **JOB)
    members = {
        pg: sorted(r)
        for pg, r in _rows(embedded_store, "SELECT pg, ranks FROM process_groups WHERE name != 'default_pg'")
    }
    per_call = _rows(
        embedded_store,
        """SELECT pg, seq, arraySort(groupArray(rank)), uniqExact(op), uniqExact(nbytes), uniqExact(step),
                  max(end_ns) - min(end_ns), min(end_ns - enter_ns), any(clock), max(start_ns), max(async_op)
           FROM collectives WHERE pg NOT LIKE '%/p2p:%' GROUP BY pg, seq""",
    )
    assert len(per_call) == 20 * (8 * 4 + 8)  # per step: 4 TP all_reduces x 8 groups, 1 DP all_reduce x 8 groups
    for pg, _seq, ranks, ops, sizes, steps, spread, min_dur, clock, start, async_op in per_call:
        assert ranks == members[pg]
        assert (ops, sizes, steps) == (1, 1, 1)
        assert spread <= LEAVE_NS and min_dur > 0
        assert (clock, start, async_op) == ("cuda", 0, 0)
    # seq runs 1..n without gaps on every group, and the same seq is the same call on every member
    for pg, lo, hi, n in _rows(
        embedded_store, "SELECT pg, min(seq), max(seq), uniqExact(seq) FROM collectives GROUP BY pg"
    ):
        assert lo == 1 and hi == n, pg
    ops = dict(_rows(embedded_store, "SELECT op, count() FROM collectives GROUP BY op"))
    assert ops == {"all_reduce": 20 * 32 * 5, "send": 20 * 16 * 2, "recv": 20 * 16 * 2}


def test_p2p_pairs_line_up(embedded_store):
    simulate(embedded_store, job_id="j", seed=3, **JOB)
    pp_groups = {
        pg: sorted(r) for pg, r in _rows(embedded_store, "SELECT pg, ranks FROM process_groups WHERE name LIKE 'pp_%'")
    }
    pairs = _rows(
        embedded_store,
        """SELECT pg, seq, groupArray(op), groupArray(rank), groupArray(peer), groupArray(end_ns), groupArray(enter_ns)
           FROM collectives WHERE pg LIKE '%/p2p:%' GROUP BY pg, seq""",
    )
    assert len(pairs) == 20 * 16 * 2  # per step and pair: forward and backward direction
    for pg, seq, ops, ranks, peers, ends, enters in pairs:
        base, pair = pg.split("/p2p:")
        src, dst = map(int, pair.split("->"))
        row = dict(zip(ops, zip(ranks, peers)))
        assert sorted(ops) == ["recv", "send"] and row["send"] == (src, dst) and row["recv"] == (dst, src)
        assert sorted([src, dst]) == pp_groups[base] and 1 <= seq <= 20
        assert abs(ends[0] - ends[1]) <= LEAVE_NS and min(ends) > max(enters)
    # forward (stage 0 -> 1) completes before the same step's backward (1 -> 0) starts on the pair
    done = {(pg, seq): (min(enters), min(ends)) for pg, seq, _, _, _, ends, enters in pairs}
    for (pg, seq), (_, fwd_end) in done.items():
        base, pair = pg.split("/p2p:")
        src, dst = map(int, pair.split("->"))
        if src < dst:
            assert fwd_end <= done[f"{base}/p2p:{dst}->{src}", seq][0]


def test_phases_partition_steps_and_hold_their_collectives(embedded_store):
    simulate(embedded_store, job_id="j", seed=4, **JOB)
    bad = _rows(
        embedded_store,
        """SELECT count() FROM
             (SELECT rank, step, min(start_ns) AS a, max(end_ns) AS b, sum(end_ns - start_ns) AS d, count() AS n,
                     groupArray(phase) AS ph FROM phases GROUP BY rank, step) AS p
           ALL INNER JOIN (SELECT rank, step, start_ns, end_ns FROM steps) AS s USING (rank, step)
           WHERE a != start_ns OR b != end_ns OR d != end_ns - start_ns OR n != 4
              OR arraySort(ph) != ['backward', 'data', 'forward', 'optimizer']""",
    )
    assert bad == [(0,)]
    outside = _rows(
        embedded_store,
        """SELECT count() FROM collectives AS c
           ALL INNER JOIN (SELECT rank, step, start_ns AS s0, end_ns AS s1 FROM steps) AS s USING (rank, step)
           WHERE enter_ns < s0 OR end_ns > s1 OR enter_ns > end_ns""",
    )
    assert outside == [(0,)]
    # steps follow each other on every rank, and a healthy step takes about step_ms
    rows = _rows(embedded_store, "SELECT rank, step, start_ns, end_ns FROM steps ORDER BY rank, step")
    for (r0, _, _, end), (r1, _, start, _) in itertools.pairwise(rows):
        assert r0 != r1 or 0 < start - end < 1_000_000
    (mean_ms,) = _rows(embedded_store, "SELECT avg(end_ns - start_ns) / 1e6 FROM steps")[0]
    assert 400 < mean_ms < 650


# -- faults -----------------------------------------------------------------------------
def test_slow_gpu_slows_that_rank_and_others_wait_for_it(embedded_store):
    res = simulate(embedded_store, job_id="j", seed=5, faults=["slow_gpu:5:1.3@8"], **JOB)
    compute = _compute_ms(embedded_store, "j")
    stage0 = [r for r in range(16) if r != 5]
    assert _ratio(compute, [5], stage0, range(8, 20)) == pytest.approx(1.3, abs=0.03)
    assert _ratio(compute, [5], stage0, range(0, 8)) == pytest.approx(1.0, abs=0.03)
    # its TP group (4..7) and DP group (1, 5, 9, 13) wait for it: rank 5 arrives last
    last = dict(
        _rows(
            embedded_store,
            """SELECT name, avg(last5) FROM
                 (SELECT pg, seq, argMax(rank, enter_ns) = 5 AS last5 FROM collectives
                  WHERE step >= 8 GROUP BY pg, seq) AS c
               ALL INNER JOIN (SELECT pg, name FROM process_groups WHERE has(ranks, 5)) AS g USING (pg)
               GROUP BY name""",
        )
    )
    assert last["tp_1"] > 0.9 and last["dp_1"] > 0.9
    waits = dict(
        _rows(
            embedded_store,
            """SELECT step >= 8, avg(end_ns - enter_ns) / 1e6 FROM collectives
               WHERE rank IN (4, 6, 7) AND op = 'all_reduce'
                 AND pg IN (SELECT pg FROM process_groups WHERE name = 'tp_1')
               GROUP BY step >= 8""",
        )
    )
    assert waits[1] > 3 * waits[0]
    f = res.truth["faults"][0]
    assert f["ranks"] == [5] and f["nodes"] == ["node0000"] and f["onset_step"] == 8 and f["is_fault"]
    assert f["phases"] == ["forward", "backward"] and res.truth["culprit_ranks"] == [5]
    assert f["onset_ns"] >= T0 and not res.truth["healthy"]


def test_slow_node_slows_every_rank_of_the_node(embedded_store):
    res = simulate(embedded_store, job_id="j", seed=6, faults=["slow_node:node0001:1.25"], **JOB)
    compute = _compute_ms(embedded_store, "j")
    node1 = list(range(8, 16))
    assert _ratio(compute, node1, list(range(8)), range(20)) == pytest.approx(1.25, abs=0.03)
    assert res.truth["culprit_ranks"] == node1 and res.truth["culprit_nodes"] == ["node0001"]


def test_slow_data_lengthens_that_ranks_data_phase(embedded_store):
    res = simulate(embedded_store, job_id="j", seed=7, faults=["slow_data:20:0.2@10"], **JOB)
    data = dict(
        _rows(
            embedded_store,
            """SELECT (rank = 20) * 10 + (step >= 10), avg(end_ns - start_ns) / 1e6 FROM phases
               WHERE phase = 'data' GROUP BY (rank = 20) * 10 + (step >= 10)""",
        )
    )
    assert data[11] - data[1] == pytest.approx(200, abs=2) and abs(data[10] - data[0]) < 2
    assert res.truth["faults"][0]["phases"] == ["data"] and res.truth["culprit_ranks"] == [20]


def test_slow_link_slows_transfers_across_the_node_only(embedded_store):
    res = simulate(embedded_store, job_id="j", seed=8, faults=["slow_link:node0002:3"], **JOB)
    xfer = _rows(
        embedded_store,
        """SELECT pg, any(name), max(has_node) , median(x) / 1e6 FROM
             (SELECT pg, seq, min(end_ns) - max(enter_ns) AS x, max(intDiv(rank, 8) = 2) AS has_node,
                     uniqExact(intDiv(rank, 8)) > 1 AS multi
              FROM collectives GROUP BY pg, seq
              HAVING multi OR pg IN (SELECT pg FROM process_groups WHERE name LIKE 'tp_%')) AS c
           ALL LEFT JOIN (SELECT pg, name FROM process_groups) AS g USING (pg) GROUP BY pg""",
    )
    dp = {pg: (h, x) for pg, name, h, x in xfer if name.startswith("dp_")}
    slow = [x for h, x in dp.values() if h]
    fast = [x for h, x in dp.values() if not h]
    assert slow and fast and np.median(slow) / np.median(fast) == pytest.approx(3.0, rel=0.1)
    tp = {pg: (h, x) for pg, name, h, x in xfer if name.startswith("tp_")}  # inside one node: NVLink, unaffected
    assert np.median([x for h, x in tp.values() if h]) / np.median([x for h, x in tp.values() if not h]) < 1.2
    p2p = [(h, x) for pg, name, h, x in xfer if "/p2p:" in pg]
    ratio = np.median([x for h, x in p2p if h]) / np.median([x for h, x in p2p if not h])
    assert ratio == pytest.approx(3.0, rel=0.1)
    f = res.truth["faults"][0]
    assert f["phases"] == [] and res.truth["culprit_ranks"] == [] and res.truth["slow_link_nodes"] == ["node0002"]


def test_stage_imbalance_slows_the_whole_last_stage_and_is_not_a_fault(embedded_store):
    res = simulate(embedded_store, job_id="j", seed=9, faults=["stage_imbalance:1.4"], **JOB)
    compute = _compute_ms(embedded_store, "j")
    ratios = [_ratio(compute, [r], list(range(16)), range(20)) for r in range(16, 32)]
    assert min(ratios) > 1.35 and max(ratios) < 1.45
    assert res.truth["healthy"] and res.truth["culprit_ranks"] == [] and res.truth["culprit_nodes"] == []
    f = res.truth["faults"][0]
    assert not f["is_fault"] and f["ranks"] == list(range(16, 32)) and f["nodes"] == ["node0002", "node0003"]
    with pytest.raises(ConfigError, match="pp >= 2"):
        simulate(None, ranks=8, steps=2, faults=["stage_imbalance"])


def test_clock_skew_shifts_only_that_nodes_timestamps(tmp_path):
    base = simulate(None, job_id="j", seed=10, out_dir=tmp_path / "a", **JOB)
    skew = simulate(None, job_id="j", seed=10, out_dir=tmp_path / "b", faults=["clock_skew:1:-7.5@4"], **JOB)
    assert skew.truth["clock_offsets_ms"] == {"node0001": -7.5} and skew.truth["healthy"]
    for table, cols in (
        ("collectives", ["enter_ns", "end_ns"]),
        ("phases", ["start_ns", "end_ns"]),
        ("steps", ["start_ns", "end_ns"]),
    ):
        a = pq.read_table(tmp_path / "a" / f"{table}.parquet")
        b = pq.read_table(tmp_path / "b" / f"{table}.parquet")
        rank, step = a.column("rank").to_numpy(), a.column("step").to_numpy()
        expect = np.where((rank // 8 == 1) & (step >= 4), -7_500_000, 0)
        for c in cols:
            assert np.array_equal(b.column(c).to_numpy() - a.column(c).to_numpy(), expect), (table, c)
        assert _same(a.drop_columns(cols), b.drop_columns(cols))
    assert base.truth["clock_offsets_ms"] == {}


def test_clock_skew_breaks_completion_agreement_only_across_the_node(embedded_store):
    simulate(embedded_store, job_id="j", seed=11, faults=["clock_skew:node0003:5"], **JOB)
    spreads = _rows(
        embedded_store,
        """SELECT max(intDiv(rank, 8) = 3) AND min(intDiv(rank, 8) = 3) = 0, max(end_ns) - min(end_ns)
           FROM collectives GROUP BY pg, seq""",
    )
    mixed = [s for m, s in spreads if m]
    clean = [s for m, s in spreads if not m]
    assert mixed and all(5_000_000 - LEAVE_NS <= s <= 5_000_000 + LEAVE_NS for s in mixed)
    assert clean and max(clean) <= LEAVE_NS


def test_several_faults_and_truth_file(tmp_path, embedded_store):
    res = simulate(
        embedded_store,
        ranks=64,
        steps=12,
        pp=2,
        tp=4,
        faults=["slow_gpu:17:1.3@5", "slow_node:6", Fault(FaultKind.SLOW_LINK, "node0001", 2.0, 3)],
        onset_step=2,
        seed=12,
    )
    t = res.truth
    assert [f["onset_step"] for f in t["faults"]] == [5, 2, 3]
    assert t["culprit_ranks"] == [17, *range(48, 56)] and t["culprit_nodes"] == ["node0001", "node0006"]
    path = res.write_truth(tmp_path / "sub" / "truth.json")
    assert json.loads(path.read_text()) == t
    assert t["rows"] == res.rows and t["job_id"] == res.job_id and res.job_id.startswith("sim-")
    n = _rows(embedded_store, f"SELECT count() FROM collectives WHERE job_id = '{res.job_id}'")
    assert n == [(res.rows["collectives"],)]


# -- determinism, files -----------------------------------------------------------------
def test_same_seed_same_records_whatever_the_chunking(tmp_path):
    a = simulate(None, job_id="j", seed=13, out_dir=tmp_path / "a", faults=["slow_gpu:3"], **JOB)
    b = simulate(None, job_id="j", seed=13, out_dir=tmp_path / "b", faults=["slow_gpu:3"], chunk_rows=500, **JOB)
    c = simulate(None, job_id="j", seed=14, out_dir=tmp_path / "c", faults=["slow_gpu:3"], **JOB)
    assert a.rows == b.rows == c.rows and a.truth["faults"] == b.truth["faults"]
    for table in ("ranks", "process_groups", "collectives", "phases", "steps"):
        ta, tb = (pq.read_table(tmp_path / x / f"{table}.parquet") for x in "ab")
        assert _same(ta, tb), table
    ca = pq.read_table(tmp_path / "a" / "collectives.parquet")
    cc = pq.read_table(tmp_path / "c" / "collectives.parquet")
    assert not ca.column("end_ns").equals(cc.column("end_ns"))
    assert pq.ParquetFile(tmp_path / "b" / "collectives.parquet").metadata.num_row_groups > 1


def test_files_are_the_open_ingest_format(tmp_path, embedded_store):
    from ranklens.ingest import ingest_paths

    res = simulate(None, job_id="files", seed=15, out_dir=tmp_path / "out", **JOB)
    assert sorted(p.split("/")[-1] for p in res.files) == [
        "collectives.parquet",
        "phases.parquet",
        "process_groups.parquet",
        "ranks.parquet",
        "steps.parquet",
        "truth.json",
    ]
    written = ingest_paths(embedded_store, [tmp_path / "out"])
    assert written == {k: v for k, v in res.rows.items()}


def test_microbatches_and_tp_collectives(embedded_store):
    params = SimParams(tp_collectives=3, microbatches=2, noise=0.0)
    res = simulate(embedded_store, job_id="mb", seed=16, params=params, **JOB)
    per_rank_step = 2 * 3 * 2 + 1 + 2 * 2  # TP: K x M x (fwd + bwd); DP: 1; p2p: M x (fwd + bwd)
    assert res.rows["collectives"] == 20 * 32 * per_rank_step
    (hi,) = _rows(embedded_store, "SELECT max(seq) FROM collectives WHERE pg = '1'")[0]
    assert hi == 20 * 12


# -- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        ("slow_gpu:17:1.3@20", Fault(FaultKind.SLOW_GPU, "17", 1.3, 20)),
        ("slow_gpu:17", Fault(FaultKind.SLOW_GPU, "17", 1.2, 0)),
        ("slow_node:3:1.5", Fault(FaultKind.SLOW_NODE, "node0003", 1.5, 0)),
        ("slow_link:node0012", Fault(FaultKind.SLOW_LINK, "node0012", 2.0, 0)),
        ("slow_data:5:0.25@3", Fault(FaultKind.SLOW_DATA, "5", 0.25, 3)),
        ("stage_imbalance", Fault(FaultKind.STAGE_IMBALANCE, "", 1.3, 0)),
        ("stage_imbalance:1.1@7", Fault(FaultKind.STAGE_IMBALANCE, "", 1.1, 7)),
        ("clock_skew:node0002:-4.5", Fault(FaultKind.CLOCK_SKEW, "node0002", -4.5, 0)),
        (" SLOW_GPU:0 ", Fault(FaultKind.SLOW_GPU, "0", 1.2, 0)),
    ],
)
def test_parse_fault(spec, expect):
    f = parse_fault(spec)
    assert f == expect
    assert parse_fault(f.spec) == f


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("slow_cpu:3", "unknown kind 'slow_cpu'"),
        ("slow_gpu", "needs a target: a rank"),
        ("slow_gpu:x", "target 'x' is not a rank"),
        ("slow_gpu:3:fast", "severity 'fast' is not a number"),
        ("slow_gpu:3:0", "factor 0 must be > 0"),
        ("slow_gpu:3:1.2:4", "too many fields"),
        ("slow_gpu:3@soon", "onset 'soon'"),
        ("slow_gpu:3@-2", "onset"),
        ("slow_node:rack4", "not a node"),
        ("clock_skew:node0001", "needs a severity"),
        ("slow_data:3:-1", "must be >= 0"),
        ("stage_imbalance:x", "severity 'x'"),
        ("slow_link", "needs a target: a node"),
    ],
)
def test_parse_fault_errors(spec, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_fault(spec)
    assert "e.g." in str(e.value)


def test_parse_fault_onset_argument():
    assert parse_fault("slow_gpu:1", onset_step=4).onset_step == 4
    assert parse_fault("slow_gpu:1@2", onset_step=4).onset_step == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ranks=30, steps=2, pp=4), "not divisible by pp\\*tp = 4"),
        (dict(ranks=32, steps=2, dp=3, tp=4), "is not ranks=32"),
        (dict(ranks=32, steps=0), "steps=0"),
        (dict(ranks=32, steps=5, faults=["slow_gpu:32"]), "rank 32 is not a rank of the job \\(0..31\\)"),
        (dict(ranks=32, steps=5, faults=["slow_node:node0004"]), "node0000..node0003"),
        (dict(ranks=32, steps=5, faults=["slow_gpu:1@5"]), "onset step 5 is not in 0..4"),
        (dict(ranks=32, steps=5, step_ms=0), "step_ms"),
        (dict(ranks=32, steps=5, params=SimParams(microbatches=0)), "microbatches"),
    ],
)
def test_simulate_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        simulate(None, **kwargs)


def test_check_job_places_faults():
    layout, faults = check_job(ranks=64, steps=10, pp=2, tp=8, faults=["slow_node:1", "stage_imbalance"])
    assert (layout.dp, layout.world_size, layout.nodes) == (4, 64, 8)
    assert faults[0].ranks == tuple(range(8, 16)) and faults[1].ranks == tuple(range(32, 64))
    assert layout.rank(*layout.coords(45)) == 45


# -- CLI ----------------------------------------------------------------------------------
def test_cli_writes_store_and_truth(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"embedded://{tmp_path / 'store'}"
    args = ["--ranks", "16", "--steps", "6", "--tp", "2", "--pp", "2", "--fault", "slow_gpu:3:1.5@2", "--store", url]
    r = CliRunner().invoke(simulate_command, [*args, "--job", "cli-job", "--truth", "t.json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "job cli-job:" in r.output and "ranklens analyze --job cli-job" in r.output and "t.json" in r.output
    truth = json.loads((tmp_path / "t.json").read_text())
    assert truth["culprit_ranks"] == [3] and truth["layout"]["dp"] == 4

    r = CliRunner().invoke(simulate_command, [*args, "--json", "--seed", "3"], catch_exceptions=False)
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["store"] == url and out["rows"]["steps"] == 96 and out["truth"]["seed"] == 3
    assert (tmp_path / f"{out['job_id']}.truth.json").exists()


def test_cli_out_dir_without_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANKLENS_STORE", raising=False)
    r = CliRunner().invoke(simulate_command, ["--ranks", "8", "--steps", "3", "--out", "files"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "files" / "collectives.parquet").exists() and (tmp_path / "files" / "truth.json").exists()
    assert not (tmp_path / "ranklens-store").exists() and "ranklens ingest files" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "10", "--pp", "4"], "not divisible"),
        (["--ranks", "8", "--fault", "slow_gpu:9"], "rank 9 is not a rank"),
        (["--ranks", "8", "--fault", "bogus"], "unknown kind"),
    ],
)
def test_cli_errors_write_nothing(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANKLENS_STORE", raising=False)
    r = CliRunner().invoke(simulate_command, args)
    assert r.exit_code == 2 and message in r.output
    assert list(tmp_path.iterdir()) == []


def test_public_names():
    import ranklens.simulate as sim

    for name in sim.__all__:
        assert hasattr(sim, name), name
    assert {"simulate", "parse_fault", "SimResult", "Fault"} <= set(sim.__all__)


def test_telemetry_tables_and_hang(embedded_store):
    """With telemetry, the nodes' reports follow the same job: a slowed GPU runs hot from the
    fault's onset, and a hung rank is the one world member whose heartbeat never entered seq 1."""
    res = simulate(
        embedded_store,
        ranks=16,
        steps=6,
        tp=4,
        ranks_per_node=4,
        faults=["slow_gpu:5:1.4@3"],
        telemetry=True,
        hang_rank=6,
        gpu_sample_s=0.25,
        job_id="tele",
    )
    assert res.hang_rank == 6 and res.truth["culprit_ranks"] == [5, 6] and res.host(5) == "node0001"
    assert {"heartbeats", "gpu_samples", "gpu_events", "log_events"} <= set(res.rows)
    q = embedded_store.query
    hb = {
        int(r): (list(p), list(e), list(c), list(w))
        for r, p, e, c, w in q(
            "SELECT rank, pgs, pg_entered, pg_completed, pending_pgs FROM heartbeats WHERE job_id = 'tele'"
        ).rows()
    }
    assert len(hb) == 16
    waiting = [r for r, (pgs, ent, _c, _w) in hb.items() if ent[pgs.index("0")] == 1]
    assert sorted(waiting) == [r for r in range(16) if r != 6] and hb[6][3] == [] and hb[0][3] == ["0"]
    tp = hb[0][0][1]  # rank 0's tensor-parallel group: 2 all_reduces x 2 (forward, backward) x 6 steps
    assert (
        hb[0][1][1] == hb[0][2][1] == 24
        and q(f"SELECT max(seq) FROM collectives WHERE job_id = 'tele' AND pg = '{tp}'").scalar() == 24
    )
    onset = int(q("SELECT min(start_ns) FROM steps WHERE job_id = 'tele' AND step = 3").scalar())
    hot = q("SELECT rank, min(ts_ns) FROM gpu_samples WHERE job_id = 'tele' AND temp_c > 78 GROUP BY rank").rows()
    assert [int(r) for r, _ in hot] == [5] and int(hot[0][1]) >= onset
    assert [int(x) for x in q("SELECT rank FROM gpu_events WHERE job_id = 'tele'").column("rank")] == [5]
    timeout = q("SELECT rank FROM log_events WHERE job_id = 'tele' AND klass = 'nccl_timeout'").rows()
    assert timeout == [(6,)]


def test_telemetry_is_off_by_default_and_a_hang_needs_it(embedded_store):
    res = simulate(embedded_store, ranks=4, steps=2, job_id="plain")
    assert set(res.rows) == {"ranks", "process_groups", "collectives", "phases", "steps"}
    assert "hang_rank" not in res.truth and res.hang_rank is None
    with pytest.raises(ConfigError, match="hang_rank needs telemetry"):
        simulate(None, ranks=4, steps=2, hang_rank=1)
    with pytest.raises(ConfigError, match="not a rank"):
        simulate(None, ranks=4, steps=2, hang_rank=4, telemetry=True)
