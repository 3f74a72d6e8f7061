"""The timing engine behind :mod:`ranklens.simulate` (the model is documented there).

State is one float64 array ``t`` of length world_size: the true time (ns since the job's start)
at which each rank is free, viewed as ``(pp, dp, tp)``. A step advances it stage by stage with
vectorised numpy operations over all groups of a stage at once, recording every collective as a
batch of arrays; :meth:`Engine.run` turns a chunk of steps into Arrow tables of the schema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ranklens.simulate.model import Layout, ResolvedFault, SimParams

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["OPS", "PHASES", "Engine"]

PHASES = ("data", "forward", "backward", "optimizer")
OPS = ("all_reduce", "send", "recv")
_AR, _SEND, _RECV = 0, 1, 2


@dataclass
class _Conditions:
    """What the active faults do in one step."""

    compute: np.ndarray  # (R,) forward/backward compute multiplier
    data_extra_ns: np.ndarray  # (R,) added to the data phase
    tp_link: np.ndarray  # (PP, DP) transfer multiplier of tensor-parallel groups
    dp_link: np.ndarray  # (PP, TP) of data-parallel groups
    p2p_link: np.ndarray  # (PP-1, DP, TP) of stage-to-stage exchanges
    skew_ns: np.ndarray  # (R,) int64 clock offset of each rank's records


def _transfer_ns(op: str, n: int, nbytes: float, multi_node: np.ndarray, p: SimParams) -> np.ndarray:
    lat = np.where(multi_node, p.inter_latency_ns, p.intra_latency_ns)
    bw = np.where(multi_node, p.inter_bw_Bps, p.intra_bw_Bps)
    if op == "p2p":
        return lat + nbytes / bw * 1e9
    return lat * max(1.0, math.log2(n)) + 2.0 * (n - 1) / n * nbytes / bw * 1e9


class Engine:
    """Generates a job's records chunk by chunk (steps must be run in order, from 0)."""

    def __init__(
        self,
        layout: Layout,
        params: SimParams,
        step_ns: float,
        faults: list[ResolvedFault],
        seed: int,
        job_id: str,
        start_ns: int,
    ) -> None:
        self.layout, self.params, self.faults = layout, params, faults
        self.job_id, self.start_ns = job_id, int(start_ns)
        self.PP, self.DP, self.TP = layout.pp, layout.dp, layout.tp
        self.R = layout.world_size
        self.grid = np.arange(self.R, dtype=np.int32).reshape(self.PP, self.DP, self.TP)
        self.node = np.arange(self.R) // layout.ranks_per_node
        self._hosts: pa.Array | None = None
        self.rng = np.random.default_rng(seed)
        self.loss_rng = np.random.default_rng([seed, 1])
        self.t = np.zeros(self.R)
        self.T = self.t.reshape(self.PP, self.DP, self.TP)
        self._first_start: dict[int, int] = {}
        self._cond_cache: dict[tuple[int, ...], _Conditions] = {}
        self._next_step = 0
        self._build_groups()
        self._build_costs(step_ns)
        self._reset_buffers()

    # -- structure ----------------------------------------------------------------------
    def _build_groups(self) -> None:
        PP, DP, TP, g = self.PP, self.DP, self.TP, self.grid
        self.groups: list[tuple[str, np.ndarray]] = [("default_pg", np.arange(self.R, dtype=np.int32))]

        def add(desc: str, members: np.ndarray) -> int:
            self.groups.append((desc, members.astype(np.int32)))
            return len(self.groups) - 1

        self.tp_pg = np.full((PP, DP), -1, dtype=np.int32)
        self.dp_pg = np.full((PP, TP), -1, dtype=np.int32)
        self.pp_pg = np.full((DP, TP), -1, dtype=np.int32)
        if TP > 1:
            for i, (p, d) in enumerate(np.ndindex(PP, DP)):
                self.tp_pg[p, d] = add(f"tp_{i}", g[p, d, :])
        if DP > 1:
            for i, (p, t) in enumerate(np.ndindex(PP, TP)):
                self.dp_pg[p, t] = add(f"dp_{i}", g[p, :, t])
        if PP > 1:
            for i, (d, t) in enumerate(np.ndindex(DP, TP)):
                self.pp_pg[d, t] = add(f"pp_{i}", g[:, d, t])
        names = [str(i) for i in range(len(self.groups))]
        # p2p "pg" strings (tracer convention), one per direction of each neighbouring pair
        self.fwd_pg = np.zeros((max(PP - 1, 0), DP, TP), dtype=np.int32)
        self.bwd_pg = np.zeros_like(self.fwd_pg)
        for link, d, t in np.ndindex(*self.fwd_pg.shape):
            base = names[self.pp_pg[d, t]]
            a, b = int(g[link, d, t]), int(g[link + 1, d, t])
            self.fwd_pg[link, d, t] = len(names)
            names.append(f"{base}/p2p:{a}->{b}")
            self.bwd_pg[link, d, t] = len(names)
            names.append(f"{base}/p2p:{b}->{a}")
        self.pg_names = names
        self.tp_rows = np.repeat(self.tp_pg, TP, axis=1)  # (PP, DP*TP): pg of each member row
        self.dp_rows = np.broadcast_to(self.dp_pg[:, None, :], (PP, DP, TP)).ravel()

    def _build_costs(self, step_ns: float) -> None:
        p, g, nd = self.params, self.grid, self.node
        PP, DP, TP, K, M = self.PP, self.DP, self.TP, self.params.tp_collectives, self.params.microbatches
        tp_nodes, dp_nodes = nd[g], nd[g]
        self.tp_multi = tp_nodes.min(axis=2) != tp_nodes.max(axis=2)  # (PP, DP)
        self.dp_multi = dp_nodes.min(axis=1) != dp_nodes.max(axis=1)  # (PP, TP)
        self.p2p_multi = nd[g[:-1]] != nd[g[1:]]  # (PP-1, DP, TP)
        self.tp_base = _transfer_ns("all_reduce", TP, p.tp_nbytes, self.tp_multi, p)
        self.dp_base = _transfer_ns("all_reduce", DP, p.dp_nbytes, self.dp_multi, p)
        self.p2p_base = _transfer_ns("p2p", 2, p.p2p_nbytes, self.p2p_multi, p)

        def med(a: np.ndarray) -> float:
            return float(np.median(a)) if a.size else 0.0

        comm = (
            (2 * K * (M + PP - 1) * med(self.tp_base) if TP > 1 else 0.0)
            + (2 * (M + PP - 2) * med(self.p2p_base) if PP > 1 else 0.0)
            + (med(self.dp_base) if DP > 1 else 0.0)
        )
        self.data_ns = p.data_frac * step_ns
        self.opt_ns = p.optimizer_frac * step_ns
        budget = max(step_ns - self.data_ns - self.opt_ns - comm - p.step_gap_ns, 0.1 * step_ns)
        per_microbatch_stage = budget / (M + PP - 1)  # GPipe: the critical path crosses M + PP - 1 slots
        self.fwd_chunk_ns = per_microbatch_stage / 3.0 / K
        self.bwd_chunk_ns = 2.0 * per_microbatch_stage / 3.0 / K
        self.collective_rows_per_step = (
            (self.R * 2 * K * M if TP > 1 else 0) + (4 * M * (PP - 1) * DP * TP) + (self.R if DP > 1 else 0)
        )

    def _conditions(self, step: int) -> _Conditions:
        key = tuple(i for i, f in enumerate(self.faults) if step >= f.onset_step)
        cached = self._cond_cache.get(key)
        if cached is not None:
            return cached
        PP, DP, TP = self.PP, self.DP, self.TP
        c = _Conditions(
            np.ones(self.R),
            np.zeros(self.R),
            np.ones((PP, DP)),
            np.ones((PP, TP)),
            np.ones((max(PP - 1, 0), DP, TP)),
            np.zeros(self.R, dtype=np.int64),
        )
        for i in key:
            f = self.faults[i]
            ranks = np.asarray(f.ranks, dtype=np.int64)
            kind = f.kind.value
            if kind in ("slow_gpu", "slow_node", "stage_imbalance"):
                c.compute[ranks] *= f.severity
            elif kind == "slow_data":
                c.data_extra_ns[ranks] += f.severity * 1e9
            elif kind == "clock_skew":
                c.skew_ns[ranks] += round(f.severity * 1e6)
            elif kind == "slow_link":
                on = np.isin(self.node[self.grid], np.asarray(f.nodes))  # (PP, DP, TP): member on the node
                c.tp_link[on.any(axis=2) & self.tp_multi] *= f.severity
                c.dp_link[on.any(axis=1) & self.dp_multi] *= f.severity
                c.p2p_link[(on[:-1] | on[1:]) & self.p2p_multi] *= f.severity
        self._cond_cache[key] = c
        return c

    # -- noise --------------------------------------------------------------------------
    def _jitter(self, sigma: float, shape: Any) -> np.ndarray | float:
        if sigma <= 0:
            return 1.0
        return self.rng.lognormal(-0.5 * sigma * sigma, sigma, shape)

    def _leave(self, shape: Any) -> np.ndarray:
        return self.rng.uniform(0.0, self.params.leave_jitter_ns, shape)

    # -- recording ----------------------------------------------------------------------
    def _reset_buffers(self) -> None:
        self._c_rank: list[np.ndarray] = []
        self._c_pg: list[np.ndarray] = []
        self._c_peer: list[np.ndarray] = []
        self._c_enter: list[np.ndarray] = []
        self._c_end: list[np.ndarray] = []
        self._c_meta: list[tuple[int, int, int, int]] = []
        self._c_n: list[int] = []
        self._marks: list[np.ndarray] = []  # per step: (5, R) step start, data/forward/backward/optimizer ends
        self._skews: list[np.ndarray] = []

    def _record(
        self,
        ranks: np.ndarray,
        pg: np.ndarray,
        enter: np.ndarray,
        end: np.ndarray,
        seq: int,
        op: int,
        nbytes: int,
        step: int,
        peer: np.ndarray | None = None,
    ) -> None:
        n = ranks.size
        self._c_rank.append(ranks)
        self._c_pg.append(pg)
        self._c_peer.append(peer if peer is not None else np.full(n, -1, dtype=np.int32))
        self._c_enter.append(enter.ravel())
        self._c_end.append(end.ravel())
        self._c_meta.append((seq, op, nbytes, step))
        self._c_n.append(n)

    # -- the model ----------------------------------------------------------------------
    def _tp_all_reduce(self, s: int, seq: int, p: int, c: _Conditions) -> None:
        T = self.T
        enter = T[p].copy()  # (DP, TP)
        xfer = self.tp_base[p] * c.tp_link[p] * self._jitter(self.params.link_jitter, self.DP)
        end = (enter.max(axis=1) + xfer)[:, None] + self._leave(enter.shape)
        T[p] = end
        self._record(self.grid[p].ravel(), self.tp_rows[p], enter, end, seq, _AR, self.params.tp_nbytes, s)

    def _exchange(self, s: int, seq: int, link: int, forward: bool, c: _Conditions) -> None:
        """Stage ``link`` <-> ``link + 1``: send and recv both complete at max(arrivals) + transfer."""
        T = self.T
        snd, rcv = (link, link + 1) if forward else (link + 1, link)
        s_enter, r_enter = T[snd].copy(), T[rcv].copy()
        shape = s_enter.shape
        xfer = self.p2p_base[link] * c.p2p_link[link] * self._jitter(self.params.link_jitter, shape)
        done = np.maximum(s_enter, r_enter) + xfer
        s_end, r_end = done + self._leave(shape), done + self._leave(shape)
        T[snd], T[rcv] = s_end, r_end
        pg = (self.fwd_pg if forward else self.bwd_pg)[link].ravel()
        a, b = self.grid[snd].ravel(), self.grid[rcv].ravel()
        nb = self.params.p2p_nbytes
        self._record(a, pg, s_enter, s_end, seq, _SEND, nb, s, peer=b)
        self._record(b, pg, r_enter, r_end, seq, _RECV, nb, s, peer=a)

    def _step(self, s: int) -> None:
        p, T, t = self.params, self.T, self.t
        PP, DP, TP, K, M = self.PP, self.DP, self.TP, p.tp_collectives, p.microbatches
        c = self._conditions(s)
        comp = c.compute.reshape(PP, DP, TP)
        if s == 0:
            t[:] = self.rng.uniform(0.0, 1e6, self.R)  # ranks start within a millisecond
        else:
            t += p.step_gap_ns * self.rng.uniform(0.5, 1.5, self.R)
        marks = np.empty((5, self.R))
        marks[0] = t
        self._first_start[s] = self.start_ns + int(t.min())
        t += self.data_ns * self._jitter(p.noise, self.R) + c.data_extra_ns
        marks[1] = t
        tp_seq = s * 2 * K * M + 1
        for m in range(M):
            for st in range(PP):
                if st > 0:
                    self._exchange(s, s * M + m + 1, st - 1, True, c)
                for k in range(K):
                    T[st] += self.fwd_chunk_ns * comp[st] * self._jitter(p.noise, (DP, TP))
                    if TP > 1:
                        self._tp_all_reduce(s, tp_seq + m * K + k, st, c)
        marks[2] = t
        tp_seq += M * K
        for m in range(M):
            for st in reversed(range(PP)):
                if st < PP - 1:
                    self._exchange(s, s * M + m + 1, st, False, c)
                for k in range(K):
                    T[st] += self.bwd_chunk_ns * comp[st] * self._jitter(p.noise, (DP, TP))
                    if TP > 1:
                        self._tp_all_reduce(s, tp_seq + m * K + k, st, c)
        if DP > 1:
            enter = T.copy()
            xfer = self.dp_base * c.dp_link * self._jitter(p.link_jitter, (PP, TP))
            end = (enter.max(axis=1) + xfer)[:, None, :] + self._leave(enter.shape)
            T[:] = end
            self._record(self.grid.ravel(), self.dp_rows, enter, end, s + 1, _AR, p.dp_nbytes, s)
        marks[3] = t
        t += self.opt_ns * self._jitter(p.noise, self.R)
        marks[4] = t
        self._marks.append(marks)
        self._skews.append(c.skew_ns)

    def group_last_seqs(self, steps: int) -> list[tuple[str, list[int], int]]:
        """Every process group but the p2p pairs as ``(pg, member ranks, last seq after steps)``.

        The world and the pipeline groups carry no collective of their own (seq 0: the pipeline's
        traffic is on its p2p pairs); a tensor-parallel group runs ``2 K M`` all_reduces a step, a
        data-parallel group one."""
        K, M = self.params.tp_collectives, self.params.microbatches
        tp, dp = set(self.tp_pg.ravel().tolist()), set(self.dp_pg.ravel().tolist())
        out = []
        for i, (_desc, members) in enumerate(self.groups):
            if i in tp:
                last = steps * 2 * K * M
            elif i in dp:
                last = steps
            else:
                last = 0
            out.append((self.pg_names[i], [int(m) for m in members], last))
        return out

    def step_start_ns(self, step: int) -> int:
        """Earliest true start of a step already run (epoch ns, before clock skew)."""
        return self._first_start[step]

    # -- output -------------------------------------------------------------------------
    def run(self, s0: int, s1: int) -> dict[str, pa.Table]:
        """Run steps ``s0 .. s1-1`` (continuing from the previous call); return their tables."""
        if s0 != self._next_step:
            raise ValueError(f"steps must be run in order: expected step {self._next_step}, got {s0}")
        self._reset_buffers()
        for s in range(s0, s1):
            self._step(s)
        self._next_step = s1
        out = {
            "collectives": self._collectives(s0),
            "phases": self._phases(s0, s1),
            "steps": self._steps(s0, s1),
        }
        self._reset_buffers()
        return out

    def _ns(self, rel: np.ndarray, rank: np.ndarray, step_index: np.ndarray) -> np.ndarray:
        """True relative times -> recorded epoch ns (each rank's clock offset in that step applied)."""
        out = np.rint(rel).astype(np.int64)
        out += self.start_ns
        if any(sk.any() for sk in self._skews):
            out += np.stack(self._skews)[step_index, rank]
        return out

    def _collectives(self, s0: int) -> pa.Table:
        import pyarrow as pa

        from ranklens.records import arrow_schema, arrow_table

        counts = np.asarray(self._c_n, dtype=np.int64)
        meta = np.asarray(self._c_meta, dtype=np.int64).reshape(-1, 4)
        rank = _cat(self._c_rank).astype(np.int32, copy=False)
        n = rank.size
        step = np.repeat(meta[:, 3], counts)
        si = step - s0
        enter = self._ns(_cat(self._c_enter), rank, si)
        end = self._ns(_cat(self._c_end), rank, si)
        pg = pa.array(self.pg_names, pa.string()).take(pa.array(_cat(self._c_pg).astype(np.int32)))
        op = pa.array(OPS, pa.string()).take(pa.array(np.repeat(meta[:, 1], counts).astype(np.int32)))
        cols = {
            "job_id": _const(self.job_id, n),
            "attempt": pa.array(np.zeros(n, np.int32)),
            "rank": pa.array(rank.astype(np.int32, copy=False)),
            "pg": pg,
            "seq": pa.array(np.repeat(meta[:, 0], counts)),
            "op": op,
            "nbytes": pa.array(np.repeat(meta[:, 2], counts)),
            "dtype": _const(self.params.dtype, n),
            "peer": pa.array(_cat(self._c_peer).astype(np.int32, copy=False)),
            "step": pa.array(step),
            "enter_ns": pa.array(enter),
            "start_ns": pa.array(np.zeros(n, np.int64)),
            "end_ns": pa.array(end),
            "clock": _const("cuda", n),
            "async_op": pa.array(np.zeros(n, np.uint8)),
            "host": self._host_names().take(pa.array(self.node[rank].astype(np.int32, copy=False))),
        }
        return arrow_table(cols, schema=arrow_schema("collectives"))

    def _host_names(self) -> pa.Array:
        """Every node's host name, by node index (as the ``ranks`` table names them)."""
        import pyarrow as pa

        if self._hosts is None:
            per_node = self.layout.ranks_per_node
            self._hosts = pa.array([self.layout.host(n * per_node) for n in range(int(self.node[-1]) + 1)], pa.string())
        return self._hosts

    def _phases(self, s0: int, s1: int) -> pa.Table:
        import pyarrow as pa

        from ranklens.records import arrow_schema, arrow_table

        marks = np.stack(self._marks)  # (S, 5, R)
        S, R, NP = s1 - s0, self.R, len(PHASES)
        rank = np.tile(np.repeat(np.arange(R, dtype=np.int32), NP), S)
        si = np.repeat(np.arange(S), R * NP)
        start = self._ns(marks[:, :NP, :].transpose(0, 2, 1).ravel(), rank, si)
        end = self._ns(marks[:, 1:, :].transpose(0, 2, 1).ravel(), rank, si)
        n = rank.size
        phase = pa.array(PHASES, pa.string()).take(pa.array(np.tile(np.arange(NP, dtype=np.int32), S * R)))
        cols = {
            "job_id": _const(self.job_id, n),
            "attempt": pa.array(np.zeros(n, np.int32)),
            "rank": pa.array(rank),
            "step": pa.array(si + s0),
            "phase": phase,
            "start_ns": pa.array(start),
            "end_ns": pa.array(end),
        }
        return arrow_table(cols, schema=arrow_schema("phases"))

    def _steps(self, s0: int, s1: int) -> pa.Table:
        import pyarrow as pa

        from ranklens.records import arrow_schema, arrow_table

        marks = np.stack(self._marks)
        S, R, p = s1 - s0, self.R, self.params
        rank = np.tile(np.arange(R, dtype=np.int32), S)
        si = np.repeat(np.arange(S), R)
        n = rank.size
        steps = np.arange(s0, s1)
        # the loss (one global value per step) is reported by the last pipeline stage only
        loss_curve = 2.2 + 8.0 * np.exp(-steps / 25.0) + self.loss_rng.normal(0.0, 0.02, S)
        last = rank >= self.layout.rank(self.PP - 1, 0, 0)
        loss = np.where(last, loss_curve[si], np.nan)
        cols = {
            "job_id": _const(self.job_id, n),
            "attempt": pa.array(np.zeros(n, np.int32)),
            "rank": pa.array(rank),
            "step": pa.array(si + s0),
            "start_ns": pa.array(self._ns(marks[:, 0, :].ravel(), rank, si)),
            "end_ns": pa.array(self._ns(marks[:, 4, :].ravel(), rank, si)),
            "samples": pa.array(np.full(n, p.samples_per_step, np.int64)),
            "tokens": pa.array(np.full(n, p.samples_per_step * p.tokens_per_sample, np.int64)),
            "loss": pa.array(loss),
            "grad_norm": pa.array(np.full(n, np.nan)),
        }
        return arrow_table(cols, schema=arrow_schema("steps"))

    def static_tables(self) -> dict[str, pa.Table]:
        """The ``ranks`` and ``process_groups`` tables of the job."""
        import pyarrow as pa

        from ranklens.records import arrow_schema, arrow_table

        L, R = self.layout, self.R
        ranks = np.arange(R, dtype=np.int32)
        local = (ranks % L.ranks_per_node).astype(np.int32)
        hosts = [L.host(r) for r in range(R)]
        c0 = self._conditions(0)
        started = self.start_ns - 30_000_000_000 + c0.skew_ns  # tracing starts before the first step
        cols = {
            "job_id": _const(self.job_id, R),
            "attempt": pa.array(np.zeros(R, np.int32)),
            "rank": pa.array(ranks),
            "world_size": pa.array(np.full(R, R, np.int32)),
            "host": pa.array(hosts, pa.string()),
            "local_rank": pa.array(local),
            "pid": pa.array((local + 4000).astype(np.int32)),
            "gpu_index": pa.array(local),
            "gpu_uuid": pa.array([f"GPU-sim-{h}-{i}" for h, i in zip(hosts, local.tolist())], pa.string()),
            "pp": pa.array(self.grid.reshape(R).astype(np.int32) // (L.dp * L.tp)),
            "tp": pa.array(ranks % L.tp),
            "dp": pa.array((ranks // L.tp) % L.dp),
            "started_ns": pa.array(started.astype(np.int64)),
        }
        ranks_t = arrow_table(cols, schema=arrow_schema("ranks"))
        G = len(self.groups)
        sizes = np.array([m.size for _, m in self.groups], dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        members = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate([m for _, m in self.groups])))
        pg_cols = {
            "job_id": _const(self.job_id, G),
            "attempt": pa.array(np.zeros(G, np.int32)),
            "pg": pa.array(self.pg_names[:G], pa.string()),
            "name": pa.array([d for d, _ in self.groups], pa.string()),
            "backend": _const("nccl", G),
            "ranks": members,
            "created_ns": pa.array(np.full(G, self.start_ns - 20_000_000_000, np.int64)),
        }
        return {"ranks": ranks_t, "process_groups": arrow_table(pg_cols, schema=arrow_schema("process_groups"))}


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


def _const(value: str, n: int) -> pa.Array:
    import pyarrow as pa

    return pa.array([value], pa.string()).take(pa.array(np.zeros(n, np.int32)))
