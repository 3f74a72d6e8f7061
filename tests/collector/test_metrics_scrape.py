"""issue 20: ``promtool check metrics`` on a live ``/metrics`` scrape, of a real ``ranklens
collector`` process (GPUs from the fake NVML that ships in the package: the one boundary this
machine cannot provide) and of ``ranklens analyze --follow --metrics-port``'s findings endpoint.
Both scrapes carry the issue's names (and not the old ones), no ``_created`` series in either
exposition format, and ``ranklens_build_info``; the collector's metric table in docs/collector.md
names, types and labels exactly what the collector serves."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import ranklens
from ranklens.collector.metrics import CLOCKS_EVENT_REASONS
from ranklens.formats.spool import SpoolWriter
from ranklens.schema import SCHEMA_VERSION
from tests._sync import wait_until

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "collector.md"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
JOB = "scrape-job"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (Debian: apt-get install prometheus); CI installs it",
)

# `ranklens collector` exactly as the CLI runs it, but with the package's fake NVML standing in for
# pynvml (two GPUs; GPU 0 with NVLink counters, GPU 1 held back by the power cap and by hardware
# thermal slowdown)
_COLLECTOR = """
import sys
from ranklens.collector import fake_nvml as f
nvml = f.fake_nvml(2)
nvml.gpus[0].nvlink_fields = {
    f.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 1, f.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 1,
    f.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: 0, f.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: 0,
    f.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: 0, f.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: 0,
}
nvml.gpus[1].throttle_reasons = 0x4 | 0x40
sys.modules["pynvml"] = nvml
from ranklens.cli import main
main()
"""


def _scrape(url: str, accept: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def _samples(body: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(body) for s in f.samples]


def _types(body: str) -> dict[str, str]:
    """Family name as exposed (counters with ``_total``) -> TYPE."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M))


def _promtool_check(body: str) -> None:
    r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
    # lint problems (names, units, help) are printed; a clean scrape prints nothing
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def _endpoint(log: Path, proc: subprocess.Popen) -> str:
    """The endpoint's URL, from the line the process says once it listens (port 0: any free one)."""

    def said() -> str | None:
        m = re.search(r"metrics on (http://\S+/metrics)", log.read_text(errors="replace"))
        return m.group(1) if m else None

    return wait_until(said, 120, "the 'metrics on URL' line", procs=[proc], detail=lambda: log.read_text()[-3000:])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def _build_info_is_this_ranklens(samples: list[tuple[str, dict[str, str], float]]) -> None:
    build = [(labels, v) for n, labels, v in samples if n == "ranklens_build_info"]
    labels = {
        "version": ranklens.__version__,
        "python": platform.python_version(),
        "schema_version": str(SCHEMA_VERSION),
    }
    assert build == [(labels, 1.0)]


def _spool_rows(spool: Path) -> None:
    """One rank of this node: a step, a collective, a heartbeat (the ranklens_rank_* series)."""
    now = time.time_ns()
    w = SpoolWriter.for_rank(spool, JOB, 0, 0)
    w.write("steps", [{"job_id": JOB, "rank": 0, "step": 7, "start_ns": now - 300_000_000, "end_ns": now}])
    w.write(
        "collectives",
        [{"job_id": JOB, "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": now - 10**8, "end_ns": now}],
    )
    w.write("heartbeats", [{"job_id": JOB, "rank": 0, "ts_ns": now, "pid": os.getpid()}])


def _documented() -> dict[str, tuple[str, set[str]]]:
    """docs/collector.md's metric table: name -> (type, labels)."""
    text = DOCS.read_text()
    section = text[text.index("\n## Metrics") : text.index("\n## ", text.index("\n## Metrics") + 1)]
    rows = re.findall(r"^\| `([a-z_]+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    assert rows, "docs/collector.md: no metric table under ## Metrics"
    return {n: (t, set(re.findall(r"`(\w+)`", labels))) for n, t, labels in rows}


@needs_promtool
def test_live_collector_scrape_passes_promtool_with_the_issue_20_names(tmp_path):
    spool, logs = tmp_path / "spool", tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.log").write_text("step 1 loss 2.0\nRuntimeError: CUDA error: an illegal memory access\n")
    _spool_rows(spool)
    config = tmp_path / "collector.toml"
    config.write_text(
        "[collector]\n"
        'host = "node-a"\n'
        "ship_interval_s = 0.1\ncommit_interval_s = 0.1\nnvml = true\nnvml_interval_s = 0.05\n"
        'metrics_port = 0\nmetrics_addr = "127.0.0.1"\n'
        f"[[logs]]\nglob = {str(logs / '*.log')!r}\njob_id = {JOB!r}\n"
    )
    log = tmp_path / "collector.log"
    t_spawn = time.time()
    args = ["collector", "--store", f"embedded://{tmp_path / 'store'}", "--config", str(config), "--spool", str(spool)]
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _COLLECTOR, *args], stdout=subprocess.DEVNULL, stderr=err)
    try:
        url = _endpoint(log, proc)

        def everything_in() -> str | None:  # the rows shipped, both GPUs sampled, the log read
            body = _scrape(url)
            got = [((n, labels.get("table", labels.get("gpu"))), v) for n, labels, v in _samples(body)]
            want = {("ranklens_collector_rows_shipped_total", "steps"), ("ranklens_node_steps_total", None)}
            want |= {("ranklens_gpu_clocks_event_reason", "1"), ("ranklens_gpu_temperature_celsius", "0")}
            want |= {("ranklens_collector_log_events_total", None)}  # the CUDA error, context and all
            rate = ("ranklens_gpu_nvlink_throughput_bytes_per_second", "0")  # from two samples
            return body if want <= {k for k, v in got if v} and rate in {k for k, _ in got} else None

        body = wait_until(everything_in, 120, "rows, GPUs and logs on /metrics", procs=[proc])
        openmetrics = _scrape(url, OPENMETRICS)
    finally:
        _stop(proc)

    _promtool_check(body)
    samples = _samples(body)
    names = {n for n, _, _ in samples}
    assert {
        "ranklens_collector_log_read_bytes_total",
        "ranklens_gpu_clocks_event_reason",
        "ranklens_build_info",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
        "python_info",
    } <= names
    assert not names & {"ranklens_collector_log_bytes_read_total", "ranklens_gpu_clocks_event_reasons"}
    assert "_created" not in body and "_created" not in openmetrics
    assert openmetrics.rstrip().endswith("# EOF")
    _build_info_is_this_ranklens(samples)
    # the process series are the collector's own: started after the test spawned it
    (start,) = [v for n, _, v in samples if n == "process_start_time_seconds"]
    assert t_spawn - 1 <= start <= time.time()
    assert [v for n, _, v in samples if n == "ranklens_collector_log_read_bytes_total"] == [
        float(len((logs / "rank-0.log").read_bytes()))
    ]
    # one host label name, `node`, on every GPU series
    gpu = [labels for n, labels, _ in samples if n.startswith("ranklens_gpu_") and n != "ranklens_gpu_events_total"]
    assert gpu and all(labels.get("node") == "node-a" and "host" not in labels for labels in gpu)
    # one 0/1 series per NVML reason and GPU: GPU 1 is power-capped and thermally slowed, GPU 0 is not
    reasons = {
        (labels["gpu"], labels["reason"]): v for n, labels, v in samples if n == "ranklens_gpu_clocks_event_reason"
    }
    held = {"sw_power_cap", "hw_thermal_slowdown"}
    assert reasons == {(g, r): float(g == "1" and r in held) for g in ("0", "1") for r, _ in CLOCKS_EVENT_REASONS}

    # the docs' table is what the collector serves: every family, its type and its labels
    types = _types(body)
    labels_of: dict[str, set[str]] = {}
    for n, labels, _ in samples:
        family = next(f for f in (n, re.sub(r"_(bucket|count|sum)$", "", n)) if f in types)
        labels_of.setdefault(family, set()).update(labels)
    served = {n: (t, labels_of.get(n)) for n, t in types.items() if n.startswith("ranklens_")}
    documented = _documented()
    assert set(documented) == set(served), (set(served) - set(documented), set(documented) - set(served))
    for n, (t, labels) in served.items():
        assert documented[n][0] == t, (n, documented[n][0], t)
        if labels is not None:  # a labelled counter with no child yet shows no labels to compare
            assert documented[n][1] == labels, (n, documented[n][1], labels)


@needs_promtool
def test_live_findings_endpoint_scrape_passes_promtool(tmp_path):
    from ranklens.store import open_store
    from tests.helpers import synthetic_job

    store = open_store(f"embedded://{tmp_path}/s")
    store.write_many(synthetic_job(slow_rank=3))
    store.close()
    log = tmp_path / "analyze.log"
    args = ["analyze", "--store", f"embedded://{tmp_path}/s", "--follow", "--interval", "0.5", "--metrics-port", "0"]
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ranklens.cli", *args], stdout=subprocess.DEVNULL, stderr=err)
    try:
        url = _endpoint(log, proc)

        def found() -> str | None:
            body = _scrape(url)
            return body if "ranklens_finding_open{" in body else None

        body = wait_until(found, 120, "the straggler finding on /metrics", procs=[proc])
        openmetrics = _scrape(url, OPENMETRICS)
    finally:
        _stop(proc)
    _promtool_check(body)
    samples = _samples(body)
    opened = [labels for n, labels, v in samples if n == "ranklens_finding_open" and v == 1]
    assert [(f["kind"], f["rank"]) for f in opened] == [("straggler", "3")]
    assert set(opened[0]) == {"job_id", "attempt", "kind", "severity", "finding_id", "rank", "node"}
    assert "_created" not in body and "_created" not in openmetrics
    _build_info_is_this_ranklens(samples)


def test_clocks_event_reasons_are_nvmls_names_and_bits():
    import pynvml  # nvidia-ml-py, NVIDIA's bindings (the collector extra); no GPU needed for constants

    for reason, bit in CLOCKS_EVENT_REASONS:
        camel = "".join(w.capitalize() for w in reason.split("_"))
        assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit, reason
    # every reason NVML's clocks-event API knows, each once
    assert sum(bit for _, bit in CLOCKS_EVENT_REASONS) == pynvml.nvmlClocksEventReasonAll
