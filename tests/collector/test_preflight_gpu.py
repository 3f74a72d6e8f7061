"""The pre-flight GPU checks (``gpu.*``) through the shipped fake NVML, and the fake's JSON spec
(``from_spec``, what ``$RANKLENS_FAKE_NVML`` of the node worker reads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ranklens.collector import fake_nvml
from ranklens.collector.fake_nvml import FakeGpu, FakeNvml, from_spec
from ranklens.collector.preflight import CheckResult, Context, NodeReport, Status, resolve_checks, run_node
from ranklens.collector.preflight.runner import RESULT_TAG

GPU_CHECKS = [
    "gpu.count",
    "gpu.driver",
    "gpu.ecc_uncorrected",
    "gpu.ecc_corrected",
    "gpu.row_remap",
    "gpu.xid",
    "gpu.temperature",
    "gpu.throttle",
    "gpu.pcie_link",
    "gpu.nvlink",
    "gpu.persistence_mode",
    "gpu.processes",
    "gpu.compute_burn",
]


def _run(fake: FakeNvml | None, checks: str = "gpu", **kw) -> NodeReport:
    return run_node(Context(node="n1", nvml=fake, burn_s=0.05, **kw), resolve_checks(checks))


def _of(report: NodeReport, check: str) -> list[CheckResult]:
    return [r for r in report.results if r.check == check]


def _by_subject(report: NodeReport, check: str) -> dict[str, Status]:
    return {r.subject: r.status for r in _of(report, check)}


def test_the_gpu_group_is_registered_in_order():
    assert [c.name for c in resolve_checks("gpu")] == GPU_CHECKS


def test_healthy_gpus_pass_or_skip_fast_and_nvml_is_shut_down():
    fake = fake_nvml.fake_nvml(2)
    report = _run(fake)
    assert {r.check for r in report.results} == set(GPU_CHECKS)
    for r in report.results:
        assert r.status in (Status.PASS, Status.SKIP), r
        if r.check not in ("gpu.count", "gpu.driver", "gpu.compute_burn"):
            assert r.subject in ("gpu0", "gpu1") and r.message.removeprefix("skipped: ").startswith(r.subject), r
    assert [r.status for r in _of(report, "gpu.nvlink")] == [Status.SKIP, Status.SKIP]  # no NVLink on the fake
    assert "no NVLink" in _of(report, "gpu.nvlink")[0].message
    burn = _of(report, "gpu.compute_burn")
    if burn[0].status is Status.SKIP:
        assert burn == [burn[0]] and "skipped: no GPU (CUDA not available" in burn[0].message
    assert report.status is Status.PASS
    assert report.facts["software"]["nvidia_driver"] == "550.54.15-fake"
    assert report.facts["software"]["cuda_driver"] == "12.4"
    assert report.facts["gpu_count"] == 2
    assert sum(r.duration_s for r in report.results if r.check != "gpu.compute_burn") < 1.0
    assert fake.initialized == 0  # the runner shut NVML down
    assert fake.calls["nvmlInit"] == 1  # opened once for the whole group


def test_uncorrected_ecc_fails_that_gpu_only():
    fake = fake_nvml.fake_nvml(2)
    fake.gpus[1].ecc_volatile = {0: 0, 1: 2}
    report = _run(fake, "gpu.ecc_uncorrected")
    assert _by_subject(report, "gpu.ecc_uncorrected") == {"gpu0": Status.PASS, "gpu1": Status.FAIL}
    bad = _of(report, "gpu.ecc_uncorrected")[1]
    assert "gpu1" in bad.message and "2 uncorrected" in bad.message and bad.value == 2
    assert bad.fix and bad.threshold and report.status is Status.FAIL

    fake.gpus[1].ecc_volatile = {0: 0, 1: 0}
    fake.gpus[1].ecc_aggregate = {0: 0, 1: 5}  # in the GPU's past: fails too, its own threshold lifts it
    assert _by_subject(_run(fake, "gpu.ecc_uncorrected"), "gpu.ecc_uncorrected")["gpu1"] is Status.FAIL
    lifted = _run(fake, "gpu.ecc_uncorrected", thresholds={"ecc_uncorrected_aggregate_max": 10})
    assert _by_subject(lifted, "gpu.ecc_uncorrected")["gpu1"] is Status.PASS


def test_corrected_ecc_warns_above_the_threshold():
    fake = fake_nvml.fake_nvml(1)
    fake.gpus[0].ecc_aggregate = {0: 1001, 1: 0}
    r = _of(_run(fake, "gpu.ecc_corrected"), "gpu.ecc_corrected")[0]
    assert r.status is Status.WARN and r.fix and "1000" in r.threshold
    r = _of(_run(fake, "gpu.ecc_corrected", thresholds={"ecc_corrected_warn": 5000}), "gpu.ecc_corrected")[0]
    assert r.status is Status.PASS


def test_unsupported_query_skips_that_gpu():
    fake = FakeNvml([FakeGpu(uuid="GPU-a", ecc_volatile=None, ecc_aggregate=None), FakeGpu(uuid="GPU-b")])
    report = _run(fake, "gpu.ecc_uncorrected,gpu.ecc_corrected")
    for check in ("gpu.ecc_uncorrected", "gpu.ecc_corrected"):
        assert _by_subject(report, check) == {"gpu0": Status.SKIP, "gpu1": Status.PASS}
        assert "Not Supported" in _of(report, check)[0].message


def test_row_remap_pending_or_failed_fails_and_old_gpus_use_retired_pages():
    fake = fake_nvml.fake_nvml(4)
    fake.gpus[0].remapped_rows = (1, 0, 1, 0)  # pending
    fake.gpus[1].remapped_rows = (0, 3, 0, 1)  # failure
    fake.gpus[2].remapped_rows = (0, 9, 0, 0)  # many uncorrectable remaps
    fake.gpus[3].remapped_rows = None  # pre-Ampere: retired pages
    fake.gpus[3].retired_pages = {0: [0x1000], 1: [0x2000]}
    fake.gpus[3].retired_pages_pending = 0
    report = _run(fake, "gpu.row_remap")
    got = {r.subject: r for r in _of(report, "gpu.row_remap")}
    assert [got[f"gpu{i}"].status for i in range(4)] == [Status.FAIL, Status.FAIL, Status.WARN, Status.PASS]
    assert "PENDING" in got["gpu0"].message and "nvidia-smi -r -i 0" in got["gpu0"].fix
    assert "FAILED" in got["gpu1"].message and "RMA" in got["gpu1"].fix
    assert "2 page(s) retired" in got["gpu3"].message

    fake.gpus[3].retired_pages_pending = 1
    assert _by_subject(_run(fake, "gpu.row_remap"), "gpu.row_remap")["gpu3"] is Status.FAIL
    fake.gpus[3].retired_pages = None
    r = _of(_run(fake, "gpu.row_remap"), "gpu.row_remap")[3]
    assert r.status is Status.SKIP and "neither" in r.message


def test_nvml_xid_fails_the_gpu_naming_the_xid():
    fake = fake_nvml.fake_nvml(2)
    fake.inject_xid(1, 79)
    t0 = time.perf_counter()
    report = _run(fake, "gpu.xid")
    assert time.perf_counter() - t0 < 1.0
    assert _by_subject(report, "gpu.xid") == {"gpu0": Status.PASS, "gpu1": Status.FAIL}
    bad = _of(report, "gpu.xid")[1]
    assert "Xid 79" in bad.message and "fallen off the bus" in bad.message and "NVML" in bad.message
    assert "drain" in bad.fix and bad.threshold
    assert fake.calls["nvmlEventSetFree"] == 1


def test_kernel_log_xids_are_placed_by_pci_address():
    fake = fake_nvml.fake_nvml(2)  # the fake's GPUs sit on buses 0x18 and 0x19
    fake.kernel_log = [
        "NVRM: Xid (PCI:0000:19:00): 13, pid=4242, name=python, Graphics Exception: ESR 0x514648",
        "NVRM: Xid (PCI:0000:19:00): 13, pid=4242, name=python, Graphics Exception: ESR 0x514648",
        "NVRM: Xid (PCI:0000:c1:00): 94, pid=1, Contained: CE User Channel",  # a GPU not visible here
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
    ]
    report = _run(fake, "gpu.xid")
    assert _by_subject(report, "gpu.xid") == {"gpu0": Status.PASS, "gpu1": Status.FAIL}
    bad = _of(report, "gpu.xid")[1]
    assert "Xid 13" in bad.message and "x2" in bad.message and "kernel log" in bad.message
    assert "1 Xid line(s) of GPUs not visible here ignored" in _of(report, "gpu.xid")[0].message


def test_throttle_reasons():
    fake = fake_nvml.fake_nvml(3)
    fake.gpus[0].throttle_reasons = fake_nvml.nvmlClocksEventReasonHwSlowdown
    fake.gpus[1].throttle_reasons = fake_nvml.nvmlClocksEventReasonSwThermalSlowdown
    fake.gpus[2].throttle_reasons = fake_nvml.nvmlClocksEventReasonGpuIdle  # idle is fine
    report = _run(fake, "gpu.throttle")
    got = _of(report, "gpu.throttle")
    assert [r.status for r in got] == [Status.FAIL, Status.WARN, Status.PASS]
    assert "HW slowdown" in got[0].message and got[0].fix
    assert "SW thermal slowdown" in got[1].message and "GPU idle" in got[2].message


def test_temperature_warns_then_fails():
    fake = fake_nvml.fake_nvml(3)
    fake.gpus[1].temp_c, fake.gpus[2].temp_c = 90, 97
    got = _of(_run(fake, "gpu.temperature"), "gpu.temperature")
    assert [r.status for r in got] == [Status.PASS, Status.WARN, Status.FAIL]
    assert got[2].value == 97 and got[2].unit == "C" and got[2].fix


def test_pcie_width_is_strict_and_an_idle_generation_downshift_passes():
    fake = fake_nvml.fake_nvml(3)
    fake.gpus[0].pcie_width = 8
    fake.gpus[1].pcie_gen = 1  # idle: GPUs lower the link speed
    fake.gpus[2].pcie_gen, fake.gpus[2].util_pct = 3, 95
    got = _of(_run(fake, "gpu.pcie_link"), "gpu.pcie_link")
    assert [r.status for r in got] == [Status.FAIL, Status.PASS, Status.WARN]
    assert "x8 of x16" in got[0].message and got[0].fix and got[0].threshold
    assert "idle" in got[1].message


def test_nvlink_down_links():
    fake = fake_nvml.fake_nvml(3)
    fake.gpus[0].nvlink_states = [1] * 18
    fake.gpus[1].nvlink_states = [1] * 17 + [0]
    fake.gpus[2].nvlink_states = [0] * 18  # down while the others are up
    got = _of(_run(fake, "gpu.nvlink"), "gpu.nvlink")
    assert [r.status for r in got] == [Status.PASS, Status.FAIL, Status.FAIL]
    assert "NVLink(s) 17 inactive" in got[1].message and got[1].fix
    for g in fake.gpus:
        g.nvlink_states = [0] * 4
    got = _of(_run(fake, "gpu.nvlink"), "gpu.nvlink")
    assert {r.status for r in got} == {Status.WARN} and "fabricmanager" in got[0].fix
    got = _of(_run(fake, "gpu.nvlink", thresholds={"nvlink_all_inactive_ok": 1}), "gpu.nvlink")
    assert {r.status for r in got} == {Status.PASS}


def test_persistence_off_warns_and_leftover_processes_warn():
    fake = fake_nvml.fake_nvml(2)
    fake.gpus[0].persistence_mode = 0
    fake.gpus[1].processes = [(4242, 3 << 30), (4243, 1 << 30)]
    report = _run(fake, "gpu.persistence_mode,gpu.processes")
    assert _by_subject(report, "gpu.persistence_mode") == {"gpu0": Status.WARN, "gpu1": Status.PASS}
    assert "nvidia-smi -pm 1" in _of(report, "gpu.persistence_mode")[0].fix
    assert _by_subject(report, "gpu.processes") == {"gpu0": Status.PASS, "gpu1": Status.WARN}
    procs = _of(report, "gpu.processes")[1]
    assert "pid 4242 (3.0 GiB)" in procs.message and "pid 4243" in procs.message and procs.fix


def test_count_against_the_expected_number():
    fake = fake_nvml.fake_nvml(2)
    bad = _of(_run(fake, "gpu.count", gpus_expected=8), "gpu.count")[0]
    assert bad.status is Status.FAIL and "2 GPU(s)" in bad.message and "8 expected" in bad.message
    assert bad.threshold == "== 8 GPUs" and "missing" in bad.fix
    assert _of(_run(fake, "gpu.count", gpus_expected=2), "gpu.count")[0].status is Status.PASS
    assert _of(_run(FakeNvml([]), "gpu.count"), "gpu.count")[0].status is Status.FAIL  # NVML works, no GPU


def test_lost_gpu_fails_once_and_later_checks_skip_it():
    fake = fake_nvml.fake_nvml(2)
    fake.gpus[1].lost = True
    report = _run(fake, "gpu.count,gpu.temperature,gpu.throttle")
    count = _of(report, "gpu.count")
    assert count[0].status is Status.PASS  # NVML counts it...
    assert count[1].subject == "gpu1" and count[1].status is Status.FAIL and "lost" in count[1].message
    assert _by_subject(report, "gpu.temperature") == {"gpu0": Status.PASS, "gpu1": Status.SKIP}
    assert "lost" in _of(report, "gpu.temperature")[1].message

    fake = fake_nvml.fake_nvml(1)
    ctx = Context(node="n1", nvml=fake)
    run_node(ctx, resolve_checks("gpu.count"))  # opened healthy, then it falls off the bus
    fake.gpus[0].lost = True
    report = run_node(ctx, resolve_checks("gpu.temperature,gpu.throttle"))
    assert [r.status for r in report.results] == [Status.FAIL, Status.SKIP]


@pytest.mark.parametrize("expected,status", [(-1, Status.SKIP), (8, Status.FAIL)])
def test_init_error_skips_unless_gpus_are_expected(expected, status):
    fake = FakeNvml([FakeGpu(uuid="GPU-a")], init_error=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED)
    report = _run(fake, gpus_expected=expected)
    count = _of(report, "gpu.count")[0]
    assert count.status is status and "NVML init failed: Driver Not Loaded" in count.message
    others = [r for r in report.results if r.check != "gpu.count"]
    assert {r.status for r in others} == {Status.SKIP}
    assert fake.calls["nvmlInit"] == 1


def test_without_nvml_every_gpu_check_says_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    report = _run(None)
    assert [r.check for r in report.results] == GPU_CHECKS
    for r in report.results:
        if r.check == "gpu.compute_burn" and r.status is Status.PASS:
            continue  # CUDA without pynvml: the burn still runs
        assert r.status is Status.SKIP and "no GPU" in r.message, r
    assert "pynvml missing" in report.results[0].message


def test_real_pynvml_without_a_driver_skips():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML (scripts/gpu_check.py checks it for real)")
    r = _of(_run(None, "gpu.count"), "gpu.count")[0]
    assert r.status is Status.SKIP and r.message.startswith("skipped: no GPU (NVML init failed:")


# --- the spec ------------------------------------------------------------------------------------
SPEC = {
    "gpus": [
        {"uuid": "GPU-a"},
        {"uuid": "GPU-b", "ecc_volatile": {"0": 0, "1": 4}, "remapped_rows": [0, 1, 1, 0], "processes": [[7, 1024]]},
    ],
    "xids": [[0, 79]],
    "init_error": None,
}


def test_from_spec_file_and_inline(tmp_path):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(SPEC))
    for fake in (from_spec(str(path)), from_spec(json.dumps(SPEC))):
        assert [g.uuid for g in fake.gpus] == ["GPU-a", "GPU-b"]
        assert fake.gpus[1].ecc_volatile == {0: 0, 1: 4}  # JSON's string keys back to NVML's ints
        assert fake.gpus[1].remapped_rows == (0, 1, 1, 0) and fake.gpus[1].processes == [(7, 1024)]
        assert fake.gpus[0] == FakeGpu(uuid="GPU-a") and fake.init_error is None
        report = _run(fake, "gpu.xid,gpu.ecc_uncorrected")
        assert _by_subject(report, "gpu.xid") == {"gpu0": Status.FAIL, "gpu1": Status.PASS}
        assert _by_subject(report, "gpu.ecc_uncorrected") == {"gpu0": Status.PASS, "gpu1": Status.FAIL}
    fake = from_spec('{"gpus": 3, "init_error": "NVML_ERROR_DRIVER_NOT_LOADED"}')
    assert [g.uuid for g in fake.gpus] == ["GPU-fake-0", "GPU-fake-1", "GPU-fake-2"]
    assert fake.init_error == fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert from_spec('{"gpus": [{"nvlink_states": [1, 0], "temp_c": null}]}').gpus[0].temp_c is None


@pytest.mark.parametrize(
    "spec,words",
    [
        ("{not json", "not valid JSON"),
        ('{"gpu": 2}', "unknown key(s) 'gpu'"),
        ('{"gpus": [{"temperature": 40}]}', "gpus[0]: unknown field(s) 'temperature'"),
        ('{"gpus": [{"temp_c": "hot"}]}', "'gpus[0].temp_c' must be int or null"),
        ('{"gpus": [{"ecc_volatile": {"x": 1}}]}', "'gpus[0].ecc_volatile'"),
        ('{"gpus": [{"remapped_rows": [0, 0]}]}', "'gpus[0].remapped_rows'"),
        ('{"gpus": [{"uuid": null}]}', "'gpus[0].uuid' may not be null"),
        ('{"gpus": 1, "xids": [[3, 79]]}', "names GPU 3; the spec has 1 GPU(s)"),
        ('{"gpus": 1, "xids": [79]}', "'xids' entries must be [gpu_index, xid]"),
        ('{"init_error": "driver"}', "'init_error' must be null"),
        ('{"gpus": "two"}', "'gpus' must be a number or a list"),
    ],
)
def test_from_spec_errors_name_the_field(spec, words):
    with pytest.raises(ValueError) as e:
        from_spec(spec)
    assert words in str(e.value) and "inline fake NVML spec" in str(e.value)


def test_from_spec_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"fake NVML spec file '.*nope\.json': cannot read it"):
        from_spec(str(tmp_path / "nope.json"))


def test_worker_entry_point_reads_the_fake_from_the_environment(tmp_path):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(SPEC))
    env = {**os.environ, "RANKLENS_FAKE_NVML": str(path)}
    p = subprocess.run(
        [sys.executable, "-m", "ranklens.collector.preflight", "--node", "n1", "--checks", "gpu", "--burn", "0.05"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_TAG + " "))
    report = NodeReport.from_json(json.loads(line[len(RESULT_TAG) + 1 :]))
    assert report.node == "n1" and report.status is Status.FAIL
    assert _by_subject(report, "gpu.ecc_uncorrected") == {"gpu0": Status.PASS, "gpu1": Status.FAIL}
    assert _by_subject(report, "gpu.xid") == {"gpu0": Status.FAIL, "gpu1": Status.PASS}
    assert "Xid 79" in _of(report, "gpu.xid")[0].message
    assert _by_subject(report, "gpu.row_remap")["gpu1"] is Status.FAIL  # the pending remap
    assert report.facts["software"]["nvidia_driver"] == "550.54.15-fake"


class _FakeTensor:
    def __init__(self, finite: bool = True) -> None:
        self.finite = finite

    def all(self) -> _FakeTensor:
        return self

    def item(self) -> bool:
        return self.finite


class _FakeCuda:
    """torch.cuda as the burn uses it: two devices (CI has no CUDA; scripts/gpu_check.py runs the real one)."""

    def __init__(self, uuids: list[str], broken: int = -1) -> None:
        self.uuids, self.broken, self.matmuls = uuids, broken, 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.uuids)

    def get_device_properties(self, i: int):
        return type("Props", (), {"uuid": self.uuids[i], "name": "NVIDIA H100 80GB HBM3"})()

    def device(self, dev):
        import contextlib

        return contextlib.nullcontext()

    def is_bf16_supported(self) -> bool:
        return True

    def synchronize(self, dev=None) -> None:
        time.sleep(0.001)

    def empty_cache(self) -> None:
        pass


def _fake_torch(cuda: _FakeCuda):
    import types

    torch = types.ModuleType("torch")
    torch.cuda = cuda
    torch.bfloat16, torch.float16 = "torch.bfloat16", "torch.float16"

    def device(kind, index):
        if index == cuda.broken:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return (kind, index)

    def matmul(a, b, out):
        cuda.matmuls += 1

    torch.device = device
    torch.Generator = lambda device: type("G", (), {"manual_seed": lambda self, s: self})()
    torch.randn = torch.empty = lambda *a, **kw: _FakeTensor()
    torch.matmul = matmul
    torch.isfinite = lambda c: _FakeTensor()
    return torch


def test_compute_burn_names_gpus_as_nvml_does_and_reports_tflops(monkeypatch):
    fake = fake_nvml.fake_nvml(2)
    nvml_uuids = [g.uuid for g in fake.gpus]
    # CUDA numbers the GPUs its own way (and without NVML's "GPU-" prefix): device 0 is NVML's gpu1
    cuda = _FakeCuda([nvml_uuids[1].removeprefix("GPU-"), nvml_uuids[0].removeprefix("GPU-")], broken=1)
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cuda))
    report = _run(fake, "gpu.compute_burn")
    got = {r.subject: r for r in _of(report, "gpu.compute_burn")}
    assert got["gpu1"].status is Status.PASS and got["gpu1"].unit == "TFLOPS" and got["gpu1"].value > 0
    assert nvml_uuids[1] in got["gpu1"].message and "bfloat16 8192x8192 matmul" in got["gpu1"].message
    assert report.facts["gpu_tflops"] == {"gpu1": got["gpu1"].value}
    assert got["gpu0"].status is Status.FAIL and "unspecified launch failure" in got["gpu0"].message
    assert got["gpu0"].fix and cuda.matmuls > 0
