"""Findings from profiler traces (issue 17 #2, #3): a rank whose kernels run slower than the same
kernels on its peers, a rank whose GPU idles while its peers' do not, and communication left
exposed; through the analyzer and through `ranklens analyze --traces`.

The straggler and idle cases are Kineto traces written here (four ranks, one slowed GPU, one slow
host), since the recorded sets have at most two ranks; exposed communication is on a recorded set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ranklens.analyzers.trace_findings import kernel_stragglers, trace_findings
from ranklens.analyzers.traces import temporal_breakdown, trace_span
from ranklens.cli import cli
from ranklens.collector.kineto import ingest_kineto

DATA = Path(__file__).resolve().parents[1] / "data" / "kineto"
STEPS = 4
GEMM_US, RELU_US = 1300, 100


def _write_rank(
    path: Path, rank: int, *, gemm_scale: float = 1.0, launch_gap_us: int = 0
) -> list[tuple[int, int, int]]:
    """One rank's trace: STEPS ProfilerSteps, each 8 (gemm, relu) pairs launched back to back on
    stream 7 and an all-reduce on stream 20 under the last gemms. ``gemm_scale`` slows the GPU's
    kernels; ``launch_gap_us`` delays each launch (a slow host: the GPU waits)."""
    ev: list[dict] = []
    corr = 1000 * (rank + 1)
    t = 1_700_000_000_000_000 + rank * 7  # epoch microseconds, as real traces
    for step in range(STEPS):
        step_start, gpu_t = t, t + 20
        for i in range(8):
            for name, dur in (
                ("void gemm_kernel<float>(float*)", GEMM_US),
                ("void relu_kernel<float>(float*)", RELU_US),
            ):
                corr += 1
                t += 5 + launch_gap_us
                ev.append(
                    {
                        "ph": "X",
                        "cat": "cuda_runtime",
                        "name": "cudaLaunchKernel",
                        "pid": 1,
                        "tid": 1,
                        "ts": t,
                        "dur": 4,
                        "args": {"correlation": corr},
                    }
                )
                d = round(dur * gemm_scale)
                start = max(gpu_t, t + 8)
                ev.append(
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": name,
                        "pid": 0,
                        "tid": 7,
                        "ts": start,
                        "dur": d,
                        "args": {"device": rank, "stream": 7, "correlation": corr},
                    }
                )
                gpu_t = start + d
                if i == 5 and name.startswith("void gemm"):
                    corr += 1
                    ev.append(
                        {
                            "ph": "X",
                            "cat": "cuda_runtime",
                            "name": "cudaLaunchKernel",
                            "pid": 1,
                            "tid": 1,
                            "ts": t + 1,
                            "dur": 3,
                            "args": {"correlation": corr},
                        }
                    )
                    ev.append(
                        {
                            "ph": "X",
                            "cat": "kernel",
                            "name": "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)",
                            "pid": 0,
                            "tid": 20,
                            "ts": start + 10,
                            "dur": 1500,
                            "args": {"device": rank, "stream": 20, "correlation": corr},
                        }
                    )
        t = max(t, gpu_t) + 50
        ev.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step + 10}",
                "pid": 1,
                "tid": 1,
                "ts": step_start,
                "dur": t - step_start,
            }
        )
    steps = [
        (int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"].startswith("ProfilerStep")
    ]
    path.write_text(
        json.dumps(
            {
                "schemaVersion": 1,
                "distributedInfo": {"rank": rank, "world_size": 4, "backend": "nccl"},
                "traceEvents": ev,
            }
        )
    )
    return steps


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A 4-rank job: rank 2's GPU runs its kernels 1.5x as long, rank 3's host launches late."""
    from ranklens.store import open_store

    d = tmp_path_factory.mktemp("traces4")
    steps = []
    for r in range(4):
        spans = _write_rank(
            d / f"rank{r}.json", r, gemm_scale=1.5 if r == 2 else 1.0, launch_gap_us=1200 if r == 3 else 0
        )
        steps += [
            {"job_id": "synthetic4", "rank": r, "step": s, "start_ns": a * 1000, "end_ns": b * 1000}
            for s, a, b in spans
        ]
    url = f"embedded://{d / 'store'}"
    store = open_store(url)
    ingest_kineto(store, [d], job_id="synthetic4")
    store.write("steps", steps)  # the job's own ledger over the same window (a traced job's profiler window)
    return store, url


def test_kernel_straggler_and_idle_rank_are_named(synthetic):
    store, _ = synthetic
    slow = kernel_stragglers(store, "synthetic4")
    assert slow[0].rank == 2 and slow[0].slowdown == pytest.approx(1.5, abs=0.02)
    assert all(k.slowdown == pytest.approx(1.0, abs=0.02) for k in slow[1:])
    by_kind = {}
    for f in trace_findings(store, "synthetic4"):
        by_kind.setdefault(f.kind, []).append(f)
    assert sorted(by_kind) == ["kernel_straggler", "trace_idle"]
    (ks,) = by_kind["kernel_straggler"]
    assert [s.rank for s in ks.suspects] == [2] and "1.50x" in ks.title
    (idle,) = by_kind["trace_idle"]
    assert [s.rank for s in idle.suspects] == [3]
    # the window leaves out the last profiler step, as HTA does
    span = trace_span(store, "synthetic4")
    assert (span.first_step, span.last_step) == (10, 12)
    assert idle.first_seen_step == 10 and idle.last_seen_step == 12
    b = {x.rank: x for x in temporal_breakdown(store, "synthetic4")}
    assert b[3].idle_time_pctg > 40 > 15 > b[0].idle_time_pctg


def test_no_finding_on_two_ranks_or_overlapped_communication(synthetic):
    store, _ = synthetic
    two = trace_findings(store, "synthetic4", ranks=[0, 2])
    assert two == []  # two ranks cannot say which is slow; the all-reduce runs under a gemm


def test_exposed_communication_on_a_recorded_trace(tmp_path):
    from ranklens.store import open_store

    store = open_store(f"embedded://{tmp_path / 'store'}")
    ingest_kineto(store, [DATA / "hta_recsys_2rank_of128"], job_id="recsys")
    (f,) = trace_findings(store, "recsys")
    assert f.kind == "exposed_communication" and sorted(s.rank for s in f.suspects) == [0, 1]
    assert f.evidence["comp_comm_overlap_pctg"] == {"0": 11.81, "1": 20.05}  # HTA's overlap


def test_cli_traces_json_and_text(synthetic):
    _, url = synthetic
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--json", "--no-save"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["job_id"] == "synthetic4" and out["ranks"] == [0, 1, 2, 3]
    row = out["temporal_breakdown"][3]
    for key in ("idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg", "comp_comm_overlap_pctg"):
        assert isinstance(row[key], float)
    assert {f["kind"] for f in out["findings"]} == {"kernel_straggler", "trace_idle"}
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--rank", "0", "--rank", "3"])
    assert r.exit_code == 0, r.output
    assert "profiler traces of 2 rank(s)" in r.output and "idle %" in r.output


def test_cli_traces_bad_input(synthetic, tmp_path):
    _, url = synthetic
    r = CliRunner().invoke(cli, ["analyze", "--store", url, "--rank", "1"])
    assert r.exit_code == 2 and "--rank goes with --traces" in r.output
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--follow", "--store", url])
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--job", "nope"])
    assert r.exit_code != 0 and "no profiler traces of job 'nope'" in r.output
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--rank", "9"])
    assert r.exit_code != 0 and "rank(s) 9 of job 'synthetic4'" in r.output
    from ranklens.store import open_store

    empty = f"embedded://{tmp_path / 'empty'}"
    open_store(empty).close()
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", empty])
    assert r.exit_code != 0 and "holds no profiler traces" in r.output and f"--store {empty}" in r.output


def test_plain_analyze_on_a_traces_only_store_points_to_traces(tmp_path):
    from ranklens.store import open_store

    url = f"embedded://{tmp_path / 'store'}"
    ingest_kineto(open_store(url), [DATA / "hta_resnet_ddp_a100_rank0_of2"], job_id="resnet")
    r = CliRunner().invoke(cli, ["analyze", "--store", url])
    assert r.exit_code != 0 and f"`ranklens analyze --traces --store {url}`" in r.output


def test_the_window_is_joined_with_the_jobs_ledger(synthetic):
    from ranklens.analyzers.traces import ledger_window

    store, url = synthetic
    led = ledger_window(store, "synthetic4")
    assert led is not None and (led.first_step, led.last_step) == (10, 13)
    assert sorted(led.per_rank) == [0, 1, 2, 3] and all(n == 4 for n, _, _ in led.per_rank.values())
    assert led.per_rank[3][1] > 1.5 * led.per_rank[0][1]  # the slow host's steps are longer
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--json", "--no-save"])
    assert json.loads(r.output)["ledger"]["first_step"] == 10
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--no-save"])
    assert "The job's ledger over the same window (steps 10-13)" in r.output


def test_a_job_is_swept_a_slice_of_ranks_at_a_time_with_the_same_numbers(synthetic, monkeypatch):
    """Each rank's kernels become arrays in the store: a large job is analysed RANKS_PER_QUERY
    ranks per statement; the slices give the numbers one statement gives."""
    from ranklens.analyzers import traces as T

    store, _ = synthetic
    analyses = (
        T.temporal_breakdown,
        T.kernel_type_breakdown,
        T.kernel_breakdown,
        T.idle_time_breakdown,
        T.launch_stats,
        T.queue_length_summary,
        T.kernel_launches,
    )
    whole = [f(store, "synthetic4") for f in analyses]
    monkeypatch.setattr(T, "RANKS_PER_QUERY", 1)
    assert [f(store, "synthetic4") for f in analyses] == whole
    assert [f(store, "synthetic4", ranks=[3, 1]) for f in analyses[:1]] == [[x for x in whole[0] if x.rank in (1, 3)]]


def test_a_cpu_only_profile_says_there_is_no_gpu_time(tmp_path):
    """A torch.profiler trace of a CPU-only run (no event on a CUDA stream): said plainly, exit 0."""
    from ranklens.store import open_store

    trace = tmp_path / "rank0.pt.trace.json"
    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10 + i * 100, "dur": 50}
        for i in range(5)
    ]
    trace.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))
    url = f"embedded://{tmp_path / 'store'}"
    ingest_kineto(open_store(url), [trace], job_id="cpu", rank=0)
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--no-save"])
    assert r.exit_code == 0, r.output
    assert "hold no GPU events" in r.output and "cpu_op 5" in r.output
    r = CliRunner().invoke(cli, ["analyze", "--traces", "--store", url, "--no-save", "--json"])
    out = json.loads(r.output)
    assert out["temporal_breakdown"] == [] and out["findings"] == []
