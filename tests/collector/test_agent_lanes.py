"""The collector agent's loops share one Worker (ranklens/_worker.py): a store that does not answer
holds up the shipping lane only; log tailing and GPU sampling go on writing to the spool."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ranklens.collector.agent import Agent
from ranklens.collector.fake_nvml import fake_nvml
from ranklens.formats.spool import SpoolWriter
from ranklens.store.testing import SlowStore
from tests._sync import wait_until
from tests.collector._agent import agent_config

ROW = {"job_id": "j", "attempt": 0, "rank": 0, "pg": "0", "seq": 1, "op": "all_reduce", "enter_ns": 5}
ERR = "RuntimeError: CUDA error: an illegal memory access was encountered"


def _segments(spool: Path, table: str) -> list[Path]:
    return sorted((spool / "_collector").rglob(f"{table}.*"))


def test_a_hung_store_does_not_stop_logs_or_gpu_sampling(tmp_path, embedded_store):
    spool = tmp_path / "spool"
    SpoolWriter.for_rank(spool, "j", 0, 0).write("collectives", [ROW])
    release = threading.Event()
    store = SlowStore(embedded_store, until=release.is_set, timeout_s=60, ops={"write_many"})
    agent = Agent(agent_config(tmp_path, metrics_port=None), store=store, nvml=fake_nvml(1))
    agent.start()
    try:
        assert store.entered.wait(30)  # the first shipping pass is stuck in the store
        gpu_before = len(_segments(spool, "gpu_samples"))
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "rank-0.log").write_text(f"step 1\n{ERR}\n")
        wait_until(lambda: _segments(spool, "log_events"), 60, "the log event written while the store hangs")
        wait_until(
            lambda: len(_segments(spool, "gpu_samples")) >= gpu_before + 2, 60, "GPU samples while the store hangs"
        )
        assert not release.is_set() and store.entered.is_set()
        assert agent.errors == {}
    finally:
        release.set()
        t0 = time.monotonic()
        clean = agent.stop(timeout=30)
    assert clean and time.monotonic() - t0 < 30
