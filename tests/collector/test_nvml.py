"""GPU health through NVML, driven by the in-package fake (checked against the real pynvml module
where nvidia-ml-py is installed: same names, constant values, error classes and signatures)."""

from __future__ import annotations

import inspect
import logging
import math

import pytest

from ranklens.collector import fake_nvml
from ranklens.collector.fake_nvml import FakeGpu, FakeNvml
from ranklens.collector.nvml import GpuSampler, RankResolver
from ranklens.records import to_arrow

UUID0 = "GPU-00000000-0000-0000-0000-000000000000"


def _sampler(fake: FakeNvml, **kw) -> GpuSampler:
    clock = iter(range(10**18, 10**18 + 10**12, 10**9))  # one second per call
    s = GpuSampler(fake, host="node-a", clock=lambda: next(clock), **kw)
    assert s.start()
    return s


def test_fake_is_faithful_to_pynvml():
    pynvml = pytest.importorskip("pynvml")
    fake = FakeNvml()
    for name in dir(fake_nvml):
        if name.startswith(("NVML_", "nvmlEventType")):
            assert getattr(pynvml, name) == getattr(fake_nvml, name), name
        if name.startswith("NVMLError_"):
            assert issubclass(getattr(pynvml, name), pynvml.NVMLError), name
    for value in (fake_nvml.NVML_ERROR_NOT_SUPPORTED, fake_nvml.NVML_ERROR_TIMEOUT, fake_nvml.NVML_ERROR_GPU_IS_LOST):
        real, mine = pynvml.NVMLError(value), fake_nvml.NVMLError(value)
        assert type(real).__name__ == type(mine).__name__ and str(real) == str(mine) and real.value == mine.value
    for name in dir(fake):
        if name.startswith("nvml") and callable(getattr(fake, name)):
            real_params = list(inspect.signature(getattr(pynvml, name)).parameters)
            fake_params = list(inspect.signature(getattr(fake, name)).parameters)
            assert fake_params == real_params, name


def test_samples_fit_the_schema_and_convert_units():
    fake = fake_nvml.fake_nvml(2)
    fake.gpus[1].util_pct, fake.gpus[1].power_mw, fake.gpus[1].throttle_reasons = 87, 455_123, 0x4
    s = _sampler(fake)
    r = s.sample()
    assert len(r.samples) == 2 and r.events == []
    row = r.samples[1]
    assert (row["host"], row["gpu_index"], row["util_pct"], row["power_w"]) == ("node-a", 1, 87.0, 455.123)
    assert row["mem_total_bytes"] == 80 << 30 and row["throttle_reasons"] == 4 and row["sm_clock_mhz"] == 1980
    assert to_arrow("gpu_samples", r.samples).num_rows == 2
    s.close()
    assert fake.initialized == 0


def test_unsupported_fields_are_unknown_and_not_asked_again():
    gpu = FakeGpu(uuid=UUID0, power_mw=None, ecc_volatile=None, ecc_aggregate=None, pcie_replay=None)
    fake = FakeNvml([gpu])
    s = _sampler(fake)
    row = s.sample().samples[0]
    assert math.isnan(row["power_w"]) and row["ecc_corrected"] == -1 and row["pcie_replay"] == -1
    assert row["nvlink_errors"] == -1  # no NVLink on this fake GPU
    calls = dict(fake.calls)
    s.sample()
    assert fake.calls["nvmlDeviceGetPowerUsage"] == calls["nvmlDeviceGetPowerUsage"]
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == calls["nvmlDeviceGetUtilizationRates"] + 1


def test_xid_and_counter_increases_are_events():
    fake = fake_nvml.fake_nvml(2)
    s = _sampler(fake)
    s.sample()  # baseline
    fake.inject_xid(1, 79)
    fake.gpus[0].ecc_volatile = {0: 3, 1: 0}
    fake.gpus[0].remapped_rows = (0, 1, 1, 0)
    r = s.sample()
    kinds = sorted((e["kind"], e["gpu_index"], e["code"]) for e in r.events)
    assert kinds == [("ecc_sbe", 0, 3), ("row_remap", 0, 1), ("xid", 1, 79)]
    xid = next(e for e in r.events if e["kind"] == "xid")
    assert "hardware" in xid["message"] and xid["gpu_uuid"] == fake.gpus[1].uuid
    assert to_arrow("gpu_events", r.events).num_rows == 3
    assert s.sample().events == []  # a counter that stays put is not an event again


def test_nvlink_counters_and_throughput():
    gpu = FakeGpu(uuid=UUID0)
    f = fake_nvml
    gpu.nvlink_fields = {
        f.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 1000,
        f.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 0,
        f.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: 2,
        f.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: 1,
    }
    fake = FakeNvml([gpu])
    s = _sampler(fake)
    assert s.sample().samples[0]["nvlink_errors"] == 3
    gpu.nvlink_fields[f.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX] = 3000  # KiB, one second later
    r = s.sample()
    assert r.extras[0]["nvlink_tx_bytes_per_second"] == pytest.approx(2000 * 1024)


def test_no_driver_says_so_once_and_returns_nothing(caplog):
    fake = FakeNvml(init_error=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED)
    s = GpuSampler(fake, host="h")
    with caplog.at_level(logging.WARNING, logger="ranklens.collector.nvml"):
        assert s.start() is False
        assert s.start() is False
        assert s.sample().samples == []
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "Driver Not Loaded" in msgs[0] and "carries on" in msgs[0]
    assert not s.available and "Driver Not Loaded" in s.reason


def test_no_gpu_and_lost_gpu():
    assert GpuSampler(FakeNvml([]), host="h").start() is False
    fake = fake_nvml.fake_nvml(1)
    s = _sampler(fake)
    fake.gpus[0].lost = True
    r = s.sample()
    assert [e["kind"] for e in r.events] == ["gpu_lost"] and math.isnan(r.samples[0]["util_pct"])
    assert s.sample().events == []  # said once


def test_gpu_to_rank_from_processes_and_cuda_visible_devices():
    fake = fake_nvml.fake_nvml(2)
    fake.gpus[0].processes = [(100, 500 << 20), (200, 40 << 30)]
    fake.gpus[1].processes = [(300, 1 << 30), (100, 200 << 20)]
    envs = {
        100: {"RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "job-9", "CUDA_VISIBLE_DEVICES": "0,1"},
        200: {"RANK": "5", "RANKLENS_JOB_ID": "job-9"},  # the biggest user of GPU 0
        300: {"RANK": "1", "LOCAL_RANK": "1", "RANKLENS_JOB_ID": "job-9", "CUDA_VISIBLE_DEVICES": "0,1"},
    }
    s = _sampler(fake, resolver=RankResolver(envs.get))
    rows = s.sample().samples
    assert [(r["job_id"], r["rank"]) for r in rows] == [("job-9", 0), ("job-9", 1)]
    assert RankResolver(envs.get, static={0: ("j", 7)}).resolve(0, "u", []) == ("j", 7)
    assert RankResolver(lambda pid: None).resolve(0, "u", [(1, 1)]) == ("", -1)


def test_throughput_and_lifetime_health_counters_are_columns():
    fake = fake_nvml.fake_nvml(1)
    g = fake.gpus[0]
    g.pcie_tx_kbps, g.pcie_rx_kbps = 1000, 250
    g.ecc_aggregate = {0: 7, 1: 1}
    g.remapped_rows = (3, 1, 0, 0)
    g.retired_pages = {fake.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: [1, 2],
                       fake.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [9]}  # fmt: skip
    tx, rx = fake.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, fake.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    g.nvlink_fields = {tx: 0, rx: 0}
    s = _sampler(fake)
    first = s.sample().samples[0]
    assert math.isnan(first["nvlink_tx_bytes_per_s"])  # a rate needs two readings
    g.nvlink_fields = {tx: 2_000_000, rx: 1_000_000}  # KiB, one (fake) second later
    row = s.sample().samples[0]
    assert (row["pcie_tx_bytes_per_s"], row["pcie_rx_bytes_per_s"]) == (1000 * 1024.0, 250 * 1024.0)
    assert (row["ecc_corrected_aggregate"], row["ecc_uncorrected_aggregate"]) == (7, 1)
    assert (row["remapped_rows_correctable"], row["remapped_rows_uncorrectable"]) == (3, 1)
    assert (row["retired_pages_sbe"], row["retired_pages_dbe"]) == (2, 1)
    assert (row["nvlink_tx_bytes_per_s"], row["nvlink_rx_bytes_per_s"]) == (2_000_000 * 1024.0, 1_000_000 * 1024.0)
    assert to_arrow("gpu_samples", [row]).num_rows == 1


def test_a_gpu_reporting_no_clocks_event_reasons_exports_none_of_them():
    from prometheus_client import generate_latest

    from ranklens.collector.metrics import CollectorMetrics

    fake = fake_nvml.fake_nvml(2)
    fake.gpus[0].throttle_reasons, fake.gpus[1].throttle_reasons = None, 0x40  # gpu 0: not supported
    s = _sampler(fake)
    r = s.sample()
    m = CollectorMetrics()
    m.observe_gpus(r.samples, r.extras)
    lines = [ln for ln in generate_latest(m.registry).decode().splitlines() if ln.startswith("ranklens_gpu_clocks")]
    assert r.samples[0]["throttle_reasons"] == 0  # the stored row cannot say unknown
    assert lines and all('gpu="1"' in ln for ln in lines)  # /metrics does: no series, not nine zeros
    assert any('reason="hw_thermal_slowdown"' in ln and ln.endswith(" 1.0") for ln in lines)
    s.close()
