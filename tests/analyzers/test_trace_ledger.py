"""Issue 17 #2: a profiler window's NCCL kernels joined to the ledger by ``(rank, pg, seq)``.

The recorded sets (tests/data/kineto, ../shared/data/kineto) predate torch 2.5's ``Seq`` on NCCL
kernels and no GPU runs here, so the kernels are written from a ledger: each collective's kernel
starts a launch delay after its rank arrived and ends when the collective completed (an NCCL kernel
runs until every member has joined), with the arguments a real NCCL kernel carries (the field names
of the recorded ResNet trace) plus ``Seq``. The traces go through the real Kineto ingest.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ranklens.analyzers.trace_ledger import collective_kernels, consistent, ops_agree
from ranklens.cli import cli
from ranklens.collector.kineto import ingest_kineto
from tests.helpers import synthetic_job

LAUNCH_US = 30
DATA = Path(__file__).resolve().parents[1] / "data" / "kineto"


def _write_traces(directory: Path, rows: dict[str, list[dict]], *, seq_shift: int = 0, steps=(8, 12)) -> None:
    """Per rank, a Kineto trace of steps ``steps`` (ProfilerStep annotations, one NCCL all-reduce
    kernel per ledger collective); the kernel's ``Seq`` is the ledger's seq plus ``seq_shift``."""
    directory.mkdir(parents=True, exist_ok=True)
    by_rank: dict[int, list[dict]] = {}
    for c in rows["collectives"]:
        if steps[0] <= c["step"] < steps[1]:
            by_rank.setdefault(c["rank"], []).append(c)
    for rank, colls in by_rank.items():
        ev: list[dict] = []
        for s in range(*steps):
            mine = [c for c in colls if c["step"] == s]
            t0 = min(c["enter_ns"] for c in mine) // 1000 - 50
            t1 = max(c["end_ns"] for c in mine) // 1000 + 50
            ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                       "ts": t0, "dur": t1 - t0, "args": {}})  # fmt: skip
        for i, c in enumerate(colls):
            start = c["enter_ns"] // 1000 + LAUNCH_US
            dur = c["end_ns"] // 1000 - start
            corr = 5000 + i
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": start - LAUNCH_US + 5, "dur": 6, "args": {"correlation": corr}})  # fmt: skip
            ev.append(
                {
                    "ph": "X", "cat": "kernel", "pid": 0, "tid": 40, "ts": start, "dur": dur,
                    "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                    "args": {
                        "External id": corr, "queued": 0, "device": rank, "context": 1, "stream": 40,
                        "correlation": corr, "Collective name": "allreduce", "In msg nelems": c["nbytes"] // 4,
                        "Out msg nelems": c["nbytes"] // 4, "Group size": 4, "dtype": "Float",
                        "Process Group Name": c["pg"], "Process Group Description": "default_pg",
                        "Process Group Ranks": "[0, 1, 2, 3]", "Seq": c["seq"] + seq_shift,
                    },
                }
            )  # fmt: skip
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 4},
               "traceEvents": ev}  # fmt: skip
        with gzip.open(directory / f"rank{rank}.pt.trace.json.gz", "wt") as f:
            json.dump(doc, f)


def _job(store, tmp_path: Path, *, seq_shift: int = 0) -> dict[str, list[dict]]:
    rows = synthetic_job(job_id="tl", ranks=4, steps=16, slow_rank=2, slow_from=5, extra_s=0.06)
    store.write_many(rows)
    _write_traces(tmp_path / "traces", rows, seq_shift=seq_shift)
    ingest_kineto(store, [tmp_path / "traces"], job_id="tl")
    return rows


def test_op_names_agree_across_torch_spellings():
    assert ops_agree("allreduce", "all_reduce")
    assert ops_agree("AllGather", "all_gather_into_tensor")
    assert ops_agree("ReduceScatter", "reduce_scatter_tensor")
    assert ops_agree("SendRecv", "send") and ops_agree("SendRecv", "recv")
    assert ops_agree("all_to_all", "all_to_all_single")
    assert not ops_agree("allreduce", "all_gather")
    assert not ops_agree("broadcast", "all_reduce")
    assert not ops_agree("", "all_reduce")
    # a kernel that started well before its rank arrived is not its collective's kernel
    row = (0, "0", 3, "allreduce", 1_000_000_000, 10, "all_reduce", 1_005_000_000, 1024, 4096)
    assert not consistent(row)
    assert consistent((*row[:4], 1_006_000_000, *row[5:]))
    # nor is one whose elements times no dtype size make the ledger's bytes
    assert not consistent((0, "0", 3, "allreduce", 10, 10, "all_reduce", 0, 1000, 4096))


@pytest.mark.parametrize("seq_shift", [0, 1])
def test_kernels_meet_their_collectives_and_the_wait_is_on_the_late_ranks_peers(store, tmp_path, seq_shift):
    rows = _job(store, tmp_path, seq_shift=seq_shift)
    ck = collective_kernels(store, "tl")
    assert ck is not None
    in_window = [c for c in rows["collectives"] if 8 <= c["step"] < 12]
    assert ck.with_seq == len(in_window)
    assert ck.seq_shift == seq_shift
    assert ck.consistent == len(in_window), (ck.matched, ck.consistent)
    per = {r.rank: r for r in ck.per_rank}
    assert sorted(per) == [0, 1, 2, 3]
    for r in per.values():
        assert r.matched == len(in_window) // 4
        assert r.launch_ms_mean == pytest.approx(LAUNCH_US / 1000, abs=0.002)
    # rank 2 arrives ~20 ms late at each of the window's collectives: its kernels are the short
    # ones, its peers' kernels wait for it
    assert per[2].wait_ms < 0.1 * min(per[r].wait_ms for r in (0, 1, 3)), per
    expected = {r: 0.0 for r in range(4)}
    by_key: dict[tuple[str, int], list[dict]] = {}
    for c in in_window:
        by_key.setdefault((c["pg"], c["seq"]), []).append(c)
    for members in by_key.values():
        durs = {c["rank"]: c["end_ns"] // 1000 - (c["enter_ns"] // 1000 + LAUNCH_US) for c in members}
        for r, d in durs.items():
            expected[r] += (d - min(durs.values())) / 1000
    for r in range(4):
        assert per[r].wait_ms == pytest.approx(expected[r], rel=1e-6, abs=1e-3)
    assert ck.top and all(c.last_rank == 2 for c in ck.top), ck.top
    waits = [c.wait_ms for c in ck.top]
    assert waits == sorted(waits, reverse=True) and waits[0] > 0


def test_without_seq_or_ledger_there_is_no_join(store, tmp_path):
    # a recorded NCCL trace (torch before 2.5: Process Group Name but no Seq)
    ingest_kineto(store, [DATA / "hta_resnet_ddp_a100_rank0_of2"], job_id="old")
    assert store.query("SELECT count() FROM trace_events WHERE job_id = 'old' AND pg != ''").rows()[0][0] > 0
    assert store.query("SELECT count() FROM trace_events WHERE job_id = 'old' AND seq >= 0").rows()[0][0] == 0
    assert collective_kernels(store, "old") is None
    # kernels with a Seq but no ledger for the job
    rows = synthetic_job(job_id="nol", ranks=4, steps=12, slow_rank=2, slow_from=5)
    _write_traces(tmp_path / "t2", rows)
    ingest_kineto(store, [tmp_path / "t2"], job_id="nol")
    assert collective_kernels(store, "nol") is None


def test_analyze_traces_prints_the_join(tmp_path):
    url = f"embedded://{tmp_path}/s"
    from ranklens.store import open_store

    store = open_store(url)
    _job(store, tmp_path)
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--job", "tl", "--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)["collective_kernels"]
    assert j["consistent"] == j["kernels_with_seq"] > 0 and j["seq_shift"] == 0
    assert {x["rank"] for x in j["ranks"]} == {0, 1, 2, 3}
    assert j["top_collectives"][0]["last_rank"] == 2
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--job", "tl"])
    assert r.exit_code == 0, r.output
    assert "Communication kernels joined to the ledger" in r.output
    assert "waited longest for rank 2" in r.output, r.output
