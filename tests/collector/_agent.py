"""The collector agent's config the agent tests start from: fast intervals, one log glob, metrics
on an ephemeral loopback port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ranklens.collector.agent import AgentConfig
from ranklens.collector.tailer import LogSource


def agent_config(tmp_path: Path, **kw: Any) -> AgentConfig:
    """Spool ``tmp_path/spool``, logs ``tmp_path/logs/*.log`` (job-1), host node-a; ``kw`` overrides."""
    base: dict[str, Any] = dict(
        spool_dir=str(tmp_path / "spool"),
        logs=(LogSource(glob=str(tmp_path / "logs" / "*.log"), job_id="job-1"),),
        host="node-a",
        ship_interval_s=0.05,
        log_poll_interval_s=0.02,
        commit_interval_s=0.1,
        nvml_interval_s=0.05,
        metrics_port=0,
        metrics_addr="127.0.0.1",
    )
    base.update(kw)
    return AgentConfig(**base)
