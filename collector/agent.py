"""The per-node agent: one object that runs every collector loop and stops them cleanly.

Loops (tasks on the process's one background worker, :mod:`ranklens._worker`; each survives its
own errors, which are counted; each blocking loop has a lane of its own, so a store that does not
answer holds up neither the logs nor NVML, and the disk budget is checked on the worker's tick):

- **ship**: the :class:`~ranklens.collector.shipper.Shipper` moves spool segments (rank spools
  and the collector's own) into the store; a segment is deleted only after the store has it;
- **logs**: a :class:`~ranklens.collector.tailer.Tailer` follows log globs, filters at the
  source, and commits events to the local spool (offsets are saved only after that);
- **gpu**: a :class:`~ranklens.collector.nvml.GpuSampler` reads NVML every ``nvml_interval_s``
  (off, with one log line, where there is no GPU);
- **metrics**: ``/metrics`` for Prometheus on ``metrics_port``;
- **liveness** (in the ship loop): the pids of this node's ranks; a rank whose process is gone
  without a clean shutdown gets a last heartbeat with ``exited = 2`` (:mod:`.liveness`).

Everything the agent produces goes to disk first (``<spool>/_collector/<host>/``), so a store
that is down costs disk, never rows. :meth:`Agent.stop` flushes the producers, makes one last
shipping pass and returns within its timeout.

Configuration: keyword arguments (:class:`AgentConfig`), ``RANKLENS_COLLECTOR_<KEY>`` variables
for any ``[collector]`` key, and one TOML file (:func:`load_config`; arguments win over variables,
variables over the file)::

    [collector]
    spool_dir = "/var/lib/ranklens/spool"   # env RANKLENS_SPOOL via the CLI
    host = "node-17"                        # default: this host's name
    ship_interval_s = 1.0
    commit_interval_s = 2.0                 # how often log events / GPU samples are written
    spool_max_bytes = "20GiB"               # disk budget while the store is down (0: none)
    spool_min_free_bytes = "1GiB"           # keep this much free on the spool's filesystem
    spool_check_interval_s = 1.0            # how often the budget is checked (even while passes back off)
    metrics_port = 9400                     # omit: no endpoint; 0: any free port
    metrics_addr = "0.0.0.0"
    metrics_top_k = 3                       # per job, the slowest ranks with series of their own
    nvml = true                             # true, false, or omit for "when available"
    nvml_interval_s = 1.0
    shutdown_timeout_s = 10.0

    [[logs]]
    glob = "/var/log/training/*/rank-*.log"
    stream = "stdout"
    rank_pattern = "rank-(\\\\d+)"

    [filter]                                # and [[rules]]: see ranklens.collector.rules
    context_lines = 3
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ranklens._metrics_http import MetricsServer
from ranklens._worker import Worker
from ranklens.collector.liveness import LivenessWatcher
from ranklens.collector.metrics import MAX_TOP_K, CollectorMetrics
from ranklens.collector.nvml import GpuSampler
from ranklens.collector.outbox import COLLECTOR_DIR, Outbox
from ranklens.collector.rules import RuleSet, load_rules, read_config_file, rules_from_config
from ranklens.collector.shipper import COMPACT_EVERY, Shipper, SpoolBudget, hold_collector_lock, parse_bytes
from ranklens.collector.tailer import LogSource, Tailer
from ranklens.config import DEFAULT_SPOOL_DIR, ENV_COLLECTOR_FAULT, ENV_COLLECTOR_PREFIX, node_name
from ranklens.errors import ConfigError
from ranklens.store.api import Store, SupportsCompact

__all__ = ["Agent", "AgentConfig", "load_config"]

log = logging.getLogger("ranklens.collector")


@dataclass(frozen=True)
class AgentConfig:
    """What the agent does. Every field can come from the config file or a keyword argument.

    Args:
        spool_dir: spool root (rank spools and the collector's own segments).
        logs: log sources to follow (none: no log tailing).
        rules: the log filter's rule set (default: built-in rules).
        engine: log filter search engine (``auto``, ``hyperscan``, ``re2``, ``re``).
        state_dir: where the tailer keeps offsets (default: ``<spool>/_collector/<host>/state``).
        host: node name (default: this host's name).
        nvml: True: sample GPUs (log once if impossible); False: never; None: when available.
        nvml_interval_s: seconds between GPU samples.
        metrics_port: ``/metrics`` port (None: no endpoint; 0: any free port).
        metrics_addr: address the endpoint binds.
        metrics_top_k: per job, how many of this node's slowest (and most silent) ranks get series
            of their own on ``/metrics`` (0: none); the rest is per-node aggregates, and every
            rank's detail is in the store (:class:`~ranklens.collector.metrics.CollectorMetrics`).
        ship_interval_s: seconds between shipping passes.
        log_poll_interval_s: seconds between log reads.
        commit_interval_s: seconds between writes of log events and GPU samples to the spool.
        shutdown_timeout_s: default bound of :meth:`Agent.stop`.
        spool_max_bytes: the spool's disk budget (bytes or ``"20GiB"``; 0: none). Over it, the
            oldest segments of the least valuable tables are removed and counted in ``drops``.
        spool_min_free_bytes: free space to keep on the spool's filesystem (same policy). Both
            limits apply only while the store cannot take the rows: a healthy store ships first.
        spool_check_interval_s: how often the spool is measured against its budget; while the
            store is down this runs on its own, however long the shipping passes back off.
        liveness_interval_s: how often the pids of this node's ranks are checked; a rank whose
            process is gone without a clean shutdown gets a last heartbeat with ``exited = 2``
            (:mod:`ranklens.collector.liveness`); 0: off.
    """

    spool_dir: str = DEFAULT_SPOOL_DIR
    logs: tuple[LogSource, ...] = ()
    rules: RuleSet | None = None
    engine: str = "auto"
    state_dir: str | None = None
    host: str = ""
    nvml: bool | None = None
    nvml_interval_s: float = 1.0
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    metrics_top_k: int = 3
    ship_interval_s: float = 1.0
    log_poll_interval_s: float = 0.25
    commit_interval_s: float = 2.0
    shutdown_timeout_s: float = 10.0
    spool_max_bytes: int | str = 20 * 1024**3
    spool_min_free_bytes: int | str = 1024**3
    spool_check_interval_s: float = 1.0
    liveness_interval_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("spool_max_bytes", "spool_min_free_bytes"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), f"collector {name}"))
        for name in (
            "nvml_interval_s",
            "ship_interval_s",
            "log_poll_interval_s",
            "commit_interval_s",
            "spool_check_interval_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.01 <= v <= 3600:
                raise ConfigError(f"collector {name}={v!r}: allowed 0.01..3600 seconds")
        lv = self.liveness_interval_s
        if not isinstance(lv, (int, float)) or isinstance(lv, bool) or not (lv == 0 or 0.01 <= lv <= 3600):
            raise ConfigError(f"collector liveness_interval_s={lv!r}: allowed 0 (off) or 0.01..3600 seconds")
        if not isinstance(self.shutdown_timeout_s, (int, float)) or not 0 < self.shutdown_timeout_s <= 600:
            raise ConfigError(f"collector shutdown_timeout_s={self.shutdown_timeout_s!r}: allowed 0..600 seconds")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool)
            or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError(f"collector metrics_port={self.metrics_port!r}: allowed 0..65535 (0: any free port)")
        k = self.metrics_top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_K:
            raise ConfigError(f"collector metrics_top_k={k!r}: allowed 0..{MAX_TOP_K} (0: no per-rank series)")
        if self.nvml not in (None, True, False):
            raise ConfigError(f"collector nvml={self.nvml!r}: allowed true, false (omit: when available)")

    @property
    def hostname(self) -> str:
        return self.host or node_name()

    @property
    def budget(self) -> SpoolBudget:
        return SpoolBudget(
            max_bytes=int(self.spool_max_bytes),
            min_free_bytes=int(self.spool_min_free_bytes),
            check_interval_s=float(self.spool_check_interval_s),
        )

    def state_path(self) -> Path:
        """Where the collector keeps its state (tailer offsets). The delivery journal is the spool's
        (``<spool>/_collector/state/shipping.json``): one for every shipper of the spool."""
        from ranklens.formats.spool import safe_part as _safe

        if self.state_dir:
            return Path(self.state_dir)
        return Path(self.spool_dir) / COLLECTOR_DIR / "state" / _safe(self.hostname)

    def shipper(self, store: Store, **kw: Any) -> Shipper:
        """The shipper this configuration describes."""
        legacy = self.state_path() / "shipping.json"  # where releases before issue 22 kept it
        return Shipper(self.spool_dir, store, host=self.hostname, budget=self.budget, legacy_journals=[legacy], **kw)


_COLLECTOR_KEYS = {f.name for f in dataclasses.fields(AgentConfig)} - {"logs", "rules"}
_SOURCE_KEYS = {f.name for f in dataclasses.fields(LogSource)}


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> AgentConfig:
    """An :class:`AgentConfig` from a TOML/YAML file (``[collector]``, ``[[logs]]``, ``[filter]``,
    ``[[rules]]``) with keyword ``overrides`` on top (a None override is ignored).

    ``overrides`` may also hold ``log_globs`` (a list of globs added as ``file`` sources) and
    ``rules_file`` (a separate rule file; it replaces the rules of the config file).

    Raises:
        ConfigError: naming the file, the key, the value and what is allowed.
    """
    data: Mapping[str, Any] = read_config_file(path) if path else {}
    where = str(path) if path else "arguments"
    unknown_sections = set(data) - {"collector", "logs", "filter", "rules"}
    if unknown_sections:
        raise ConfigError(
            f"{where}: unknown section(s) {sorted(unknown_sections)}; allowed: collector, logs, filter, rules"
        )
    section = dict(data.get("collector", {}) or {})
    bad = set(section) - _COLLECTOR_KEYS
    if bad:
        raise ConfigError(f"{where}: [collector] unknown key(s) {sorted(bad)}; allowed: {sorted(_COLLECTOR_KEYS)}")
    sources: list[LogSource] = []
    for i, s in enumerate(data.get("logs", []) or []):
        if not isinstance(s, Mapping):
            raise ConfigError(f"{where}: logs[{i}] must be a table")
        bad = set(s) - _SOURCE_KEYS
        if bad:
            raise ConfigError(f"{where}: logs[{i}] unknown key(s) {sorted(bad)}; allowed: {sorted(_SOURCE_KEYS)}")
        try:
            sources.append(LogSource(**s))
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{where}: logs[{i}]: {e}") from None
    for g in overrides.pop("log_globs", None) or ():
        sources.append(LogSource(glob=str(g)))
    rules_file = overrides.pop("rules_file", None)
    context_lines = overrides.pop("context_lines", None)
    rules: RuleSet | None
    if rules_file:
        rules = load_rules(rules_file)
    elif "filter" in data or "rules" in data:
        rules = rules_from_config(data, where)
    else:
        rules = None
    if context_lines is not None:
        rules = dataclasses.replace(rules or RuleSet.builtin(), context_lines=int(context_lines))
    section.update(env_overrides(os.environ))
    section.update({k: v for k, v in overrides.items() if v is not None})
    bad = set(section) - _COLLECTOR_KEYS
    if bad:
        raise ConfigError(f"unknown collector option(s) {sorted(bad)}")
    try:
        return AgentConfig(logs=tuple(sources), rules=rules, **section)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


ENV_PREFIX = ENV_COLLECTOR_PREFIX


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``[collector]`` keys from ``RANKLENS_COLLECTOR_<KEY>`` variables (e.g.
    ``RANKLENS_COLLECTOR_SHIP_INTERVAL_S=0.5``), typed like the key. Raises ConfigError naming the
    variable for an unknown key or a value of the wrong type."""
    types = {f.name: f.type for f in dataclasses.fields(AgentConfig)}
    out: dict[str, Any] = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_COLLECTOR_FAULT:
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key not in _COLLECTOR_KEYS:
            raise ConfigError(f"{var}: {key!r} is not a collector setting; allowed: {sorted(_COLLECTOR_KEYS)}")
        kind = str(types[key])
        value: Any = raw.strip()
        try:
            if kind.startswith("bool"):
                if value.lower() in ("", "auto", "none"):
                    value = None
                elif value.lower() in ("1", "true", "yes", "on"):
                    value = True
                elif value.lower() in ("0", "false", "no", "off"):
                    value = False
                else:
                    raise ValueError(value)
            elif kind == "float":
                value = float(value)
            elif kind == "int":
                value = int(value)
            elif kind.startswith("int | None"):
                value = int(value) if value else None
            elif kind.startswith("int | str"):
                value = int(value) if value.isdigit() else value
        except ValueError:
            raise ConfigError(f"{var}={raw!r}: expected a value of type {kind}") from None
        out[key] = value
    return out


_LOG_CATCH_UP_POLLS = 64  # polls in a row while the logs have more (each bounded per file)


class Agent:
    """Runs the collector loops for one node.

    Args:
        config: what to run.
        store: where rows go (used by the shipping lane only).
        registry: Prometheus registry for the metrics (default: a new one).
        nvml: the NVML module (default: ``pynvml``; a FakeNvml in tests).
        environ_reader: pid -> environment, for GPU -> rank mapping (tests).
        otel_provider: an OpenTelemetry ``TracerProvider`` for spans of the shipping loop (default:
            none, unless the OTEL_* variables ask for export, e.g. ``OTEL_EXPORTER_OTLP_ENDPOINT``).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        store: Store,
        registry: Any | None = None,
        nvml: Any | None = None,
        environ_reader: Callable[[int], Mapping[str, str] | None] | None = None,
        otel_provider: Any = None,
    ) -> None:
        self.config = config
        self.store = store
        self.host = config.hostname
        self.metrics = CollectorMetrics(registry, node=self.host, top_k=config.metrics_top_k)
        self.spool_dir = Path(config.spool_dir)
        self.outbox = Outbox(self.spool_dir, host=self.host, on_write=self._on_write)
        self.liveness: LivenessWatcher | None = None
        if config.liveness_interval_s:
            self.liveness = LivenessWatcher(self.outbox, interval_s=config.liveness_interval_s)
        from ranklens.otel import collector_tracer

        self.shipper = config.shipper(
            store,
            outbox=self.outbox,
            on_segment=self._on_segment,
            tracer=collector_tracer(otel_provider, host=self.host),
        )
        self.tailer: Tailer | None = None
        if config.logs:
            state_dir = config.state_path()
            self.tailer = Tailer(
                config.logs,
                sink=self.outbox,
                state_path=state_dir / "tailer.json",
                rules=config.rules,
                host=self.host,
                engine=config.engine,
                on_commit=self.metrics.observe_filter,
            )
        self.sampler: GpuSampler | None = None
        if config.nvml is not False:
            from ranklens.collector.nvml import RankResolver

            resolver = RankResolver(environ_reader) if environ_reader else None
            self.sampler = GpuSampler(nvml, host=self.host, resolver=resolver)
        self.server: MetricsServer | None = None
        self._worker: Worker | None = None
        self._started = False
        self._ship_passes = 0
        self._next_ship = 0.0  # while the store keeps failing: no pass before this (monotonic s)
        self._last_commit = 0.0
        self._gpu_on = False
        self._gpu_samples: list[dict[str, Any]] = []
        self._gpu_events: list[dict[str, Any]] = []
        self._gpu_last_write = 0.0
        self._collector_lock: Any = None

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        """The bound ``/metrics`` port (None without an endpoint)."""
        return self.server.port if self.server else None

    @property
    def errors(self) -> dict[str, int]:
        """Exceptions the loops raised (caught and counted; no loop stops for one), by loop."""
        return dict(self._worker.stats().errors_by_name) if self._worker is not None else {}

    def start(self) -> None:
        """Start the metrics endpoint and every loop. Returns at once."""
        if self._started:
            return
        self._started = True
        # the spool's collector: `ranklens run` will not start a shipper of its own next to us
        self._collector_lock = hold_collector_lock(self.spool_dir)
        if not self._collector_lock.__enter__():
            log.info("ranklens collector: another process (ranklens run?) ships %s too; taking turns", self.spool_dir)
        if self.config.metrics_port is not None:
            self.server = MetricsServer(
                self.metrics.registry, port=self.config.metrics_port, addr=self.config.metrics_addr
            )
            self.server.start()
            log.info("ranklens collector: metrics on %s", self.server.url)  # the port, when 0 asked for any
        w = self._worker = Worker("ranklens-collector", max_queue=16)
        if self.tailer is not None:
            self._last_commit = time.monotonic()
            w.every(self.config.log_poll_interval_s, self._logs_tick, name="logs", blocking=True, lane="logs")
        if self.sampler is not None:
            w.submit(self._gpu_start, name="gpu", lane="gpu")
        self._next_ship = 0.0
        w.submit(self._ship_tick, name="ship")  # the first pass at once, then every ship_interval_s
        w.every(self.config.ship_interval_s, self._ship_tick, name="ship", blocking=True)
        if self.config.budget.max_bytes or self.config.budget.min_free_bytes:
            w.every(self.config.spool_check_interval_s, self._budget_tick, name="budget")

    def stop(self, timeout: float | None = None) -> bool:
        """Stop within ``timeout`` seconds (default: the config's): producers flush to the spool,
        the shipper makes a last pass, the endpoint closes. True when every loop finished in time."""
        timeout_s = timeout if timeout is not None else self.config.shutdown_timeout_s
        clean = True
        if self._started and self._worker is not None:
            # the worker ends its tick, lets the logs and GPU lanes finish, then runs the final
            # pass on the shipping lane: the producers' last rows, then the last shipping pass
            clean = self._worker.close(timeout_s, final=self._final_pass).clean
        if self.server is not None:
            self.server.close()
        if self._collector_lock is not None:
            self._collector_lock.__exit__(None, None, None)
            self._collector_lock = None
        if not clean:
            log.warning("ranklens collector: stopped with loops still running (timeout); their data stays in the spool")
        self._started = False
        return clean

    def run(self, *, handle_signals: bool = True) -> None:
        """Start, wait for SIGTERM/SIGINT (or :meth:`stop` from another thread), stop."""
        done = threading.Event()
        old: dict[int, Any] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, lambda *_: done.set())
        self.start()
        try:
            while not done.wait(0.5):
                if not self._started:
                    break
        finally:
            self.stop()
            for signum, h in old.items():
                signal.signal(signum, h)

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- loops ----------------------------------------------------------------------------

    def _on_segment(self, table: str, data: Any) -> None:
        """Every segment on its way to the store: per-rank metrics and liveness."""
        self.metrics.observe_rows(table, data)
        if self.liveness is not None:
            self.liveness.observe(table, data)

    def _on_write(self, table: str, rows: int) -> None:
        self.metrics.segments_written.labels(table).inc()

    def ship_once(self) -> Any:
        """One shipping pass (also what the ship loop does), with metrics."""
        r = self.shipper.ship_once()
        if r.busy:  # another shipper (a one-off `ranklens collect`) holds the spool: it ships meanwhile
            return r
        self.metrics.observe_ship(r)
        self._ship_passes += 1
        if isinstance(self.store, SupportsCompact) and r.segments and self._ship_passes % COMPACT_EVERY == 0:
            try:
                self.store.compact()
            except Exception:
                log.exception("ranklens collector: compaction failed (data is safe, parts stay)")
        self._spool_gauges()
        return r

    def _spool_gauges(self) -> None:
        sh = self.shipper
        self.metrics.spool_segments_pending.set(sh.spool_segments)
        self.metrics.spool_bytes.set(sh.spool_bytes)
        self.metrics.segments_in_doubt.set(len(sh.in_doubt))
        oldest = sh.spool_oldest
        self.metrics.ship_lag.set(max(0.0, time.time() - oldest) if oldest is not None else 0.0)

    def _ship_tick(self) -> None:
        """The shipping lane's task: a pass every ``ship_interval_s``, backing off while the store fails."""
        if self.shipper.failures and time.monotonic() < self._next_ship:
            return
        self._ship_pass()
        self._next_ship = time.monotonic() + self._ship_delay()

    def _ship_pass(self) -> None:
        try:
            self.ship_once()
        except Exception:
            log.exception("ranklens collector: shipping pass failed; segments stay for the next one")
            self.metrics.store_errors.inc()
        if self.liveness is not None:
            try:
                self.metrics.ranks_gone.inc(len(self.liveness.check()))
            except Exception:
                log.exception("ranklens collector: liveness check failed")

    def _final_pass(self) -> None:
        """At stop, when no other loop runs: what the producers hold goes to the spool, then the
        last shipping pass."""
        try:
            if self.tailer is not None:
                try:
                    self.tailer.poll()  # what was written up to the stop
                    self._commit_logs()
                finally:
                    self.tailer.close()
        finally:
            try:
                if self._gpu_on:
                    self._gpu_on = False
                    try:
                        self._gpu_tick(stopping=True)
                    finally:
                        assert self.sampler is not None
                        self.sampler.close()
            finally:
                self._ship_pass()

    def _budget_tick(self) -> None:
        """While the store fails, passes back off (up to a minute) and one may take long (a server
        that does not answer); the disk budget is held meanwhile, every ``spool_check_interval_s``
        on the worker's tick (not behind the shipping lane), so it holds as data arrives (issue 22 #6)."""
        if self.shipper.failures:
            self._check_budget()

    def _check_budget(self) -> None:
        try:
            r = self.shipper.check_budget()
        except Exception:
            log.exception("ranklens collector: checking the spool's budget failed")
            return
        if not r.busy:
            for t, n in r.evicted.items():
                self.metrics.spool_evicted_rows.labels(t).inc(n)
            self._spool_gauges()

    def _ship_delay(self) -> float:
        """The ship interval; while the store keeps failing, doubling up to a minute (with jitter,
        so the collectors of a cluster do not all retry at once)."""
        import random

        base = self.config.ship_interval_s
        k = self.shipper.failures
        if not k:
            return base
        return max(base, min(60.0, base * 2.0 ** min(k, 16))) * random.uniform(0.8, 1.2)

    def _logs_tick(self) -> None:
        """The logs lane's task: read what is new; while there is more, read on (a bounded catch-up,
        so a stop is not held up)."""
        tailer = self.tailer
        assert tailer is not None
        for _ in range(_LOG_CATCH_UP_POLLS):
            try:
                got = tailer.poll()
            except Exception:
                log.exception("ranklens collector: reading logs failed")
                got = 0
            self.metrics.log_files.set(len(tailer.files))
            if time.monotonic() - self._last_commit >= self.config.commit_interval_s:
                self._commit_logs()
                self._last_commit = time.monotonic()
            if not got or (self._worker is not None and self._worker.closed):
                return

    def _commit_logs(self) -> None:
        assert self.tailer is not None
        r = self.tailer.commit()
        if r.error:
            self.metrics.write_errors.labels("log_filter").inc()

    def _gpu_start(self) -> None:
        """The GPU lane's first job: NVML up (or off, with one log line), then a sample every
        ``nvml_interval_s`` on the same lane."""
        sampler = self.sampler
        assert sampler is not None and self._worker is not None
        if not sampler.start():
            self.metrics.nvml_available.set(0)
            return
        self.metrics.nvml_available.set(1)
        self._gpu_on = True
        self._gpu_last_write = time.monotonic()
        self._gpu_tick()
        self._worker.every(self.config.nvml_interval_s, self._gpu_tick, name="gpu", blocking=True, lane="gpu")

    def _gpu_tick(self, stopping: bool = False) -> None:
        sampler = self.sampler
        assert sampler is not None
        if not self._gpu_on and not stopping:
            return
        r = sampler.sample()
        samples, events = self._gpu_samples, self._gpu_events
        samples.extend(r.samples)
        events.extend(r.events)
        self.metrics.observe_gpus(r.samples, r.extras)
        for e in r.events:
            self.metrics.gpu_events.labels(e["kind"]).inc()
        if stopping or time.monotonic() - self._gpu_last_write >= self.config.commit_interval_s or events:
            if self._write_gpu(samples, events):
                samples.clear()
                events.clear()
            elif len(samples) > 100_000:  # the disk keeps failing: bound memory, count the loss
                self._write_drop("gpu_samples_dropped", len(samples))
                samples.clear()
            self._gpu_last_write = time.monotonic()

    def _write_gpu(self, samples: list[dict[str, Any]], events: list[dict[str, Any]]) -> bool:
        try:
            if events:
                self.outbox.write("gpu_events", events)
                events.clear()
            if samples:
                self.outbox.write("gpu_samples", samples)
        except OSError as e:
            log.error("ranklens collector: cannot write GPU rows to the spool: %s", e)
            self.metrics.write_errors.labels("gpu").inc()
            return False
        return True

    def _write_drop(self, what: str, n: int) -> None:
        row = {"ts_ns": time.time_ns(), "host": self.host, "component": "collector", "what": what, "count": n}
        try:
            self.outbox.write("drops", [row])
        except OSError:
            log.error("ranklens collector: dropped %d %s and cannot even record it", n, what)


def collector_dir(spool_dir: str | os.PathLike[str]) -> Path:
    """Where the collector's own segments live under a spool."""
    return Path(spool_dir) / COLLECTOR_DIR
