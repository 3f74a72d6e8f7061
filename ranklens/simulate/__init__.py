"""Fault simulator: the records of a 3D-parallel training job, with injectable faults and ground truth.

:func:`simulate` generates, with numpy and pyarrow, what ``ranklens.tracing`` would record on a
data x pipeline x tensor parallel job of any size (tested to 10,240 ranks), streams it into a store
(``store.write_many`` once per chunk of steps, so memory stays bounded) and/or into Parquet files of
the open ingest format, and returns the ground truth an analyzer should find (issue 5, item 7).

Layout
    ``world = dp x pp x tp``, Megatron order: ``rank = pp_i*(dp*tp) + dp_i*tp + tp_i`` (tensor
    parallel fastest, then data parallel, then pipeline). ``ranks_per_node`` (8) consecutive ranks
    share a host ``node0000``, ``node0001``, ... Process groups (size-1 groups are not created):
    ``"0"`` the world, then the tensor-parallel groups ``tp_i`` (fixed pp_i, dp_i), the data-parallel
    groups ``dp_i`` (fixed pp_i, tp_i) and the pipeline groups ``pp_i`` (fixed dp_i, tp_i); ``pg`` is
    torch's numeric group name, ``name`` the description. P2P between neighbouring stages uses the
    tracer's convention ``pg = "<pp group>/p2p:<src>-><dst>"`` with its own ``seq`` per direction.

Timing model (per step; all ranks in parallel, causal; times in true ns, then clocks applied)
    1. ``data``: ``data_frac x step_ms`` x jitter (+ ``slow_data`` seconds).
    2. ``forward``, GPipe schedule (all forwards, then all backwards) over ``microbatches`` M: for
       each microbatch, stage p first receives its input from stage p-1 (a two-member exchange: the
       sender arrives when it finished computing, the receiver when it is free; both complete at
       ``max(arrivals) + transfer``), then runs K (``tp_collectives``) compute chunks each followed
       by a tensor-parallel ``all_reduce`` (every member arrives after its own chunk; the group
       completes at ``max(arrivals) + transfer``), then sends to stage p+1.
    3. ``backward``: the same in reverse stage order (gradients flow p+1 -> p), with chunks twice as
       long as forward's; then one data-parallel gradient ``all_reduce`` per (pp, tp) coordinate.
       The backward phase ends when that all-reduce completes.
    4. ``optimizer``: ``optimizer_frac x step_ms`` x jitter; the step ends; the next step starts a
       few tens of µs later. Phases partition the step exactly, and every phase is compute chunks
       plus the collectives in it, so ``phase time - time inside collectives`` is the compute time.
    The compute budget is sized so that a healthy step takes about ``step_ms``. Transfer time is
    ``latency*max(1, log2 n) + bus bytes / bandwidth`` (all_reduce bus bytes ``2(n-1)/n*nbytes``,
    p2p ``nbytes``) with NVLink bandwidth inside a node and network bandwidth across nodes, times a
    small lognormal jitter. Every member of a collective leaves it at the completion instant plus
    up to ``leave_jitter_ns`` (2 µs): the property clock alignment and blame rely on. Compute and
    data times get an iid lognormal jitter of sigma ``noise`` (mean 1).

Faults (``KIND[:TARGET][:SEVERITY][@ONSET_STEP]``, several at once, active from the onset step)
    ``slow_gpu:RANK[:FACTOR=1.2]``     that rank's forward + backward compute x FACTOR
    ``slow_node:NODE[:FACTOR=1.2]``    the same for every rank of the node
    ``slow_data:RANK[:SECONDS=0.1]``   that rank's data phase + SECONDS
    ``slow_link:NODE[:FACTOR=2]``      transfer time x FACTOR of every collective / p2p exchange
                                       with a member on NODE *that crosses nodes* (the node's network
                                       link; NVLink traffic inside the node is not affected)
    ``stage_imbalance[:FACTOR=1.3]``   the last pipeline stage's compute x FACTOR: by design, not a
                                       fault (ground truth: no faulty rank); needs pp >= 2
    ``clock_skew:NODE:MS``             every timestamp recorded by that node's ranks + MS ms (a clock
                                       offset, not a slowdown: no faulty rank)
    NODE is ``node0003`` or ``3``. Steps are numbered from 0; sequence numbers from 1.

Ground truth (:attr:`SimResult.truth`, :meth:`SimResult.write_truth`): the layout, every fault with
its targets as ranks and nodes, onset step (and its time), the phases it affects, and the union of
culprits an analyzer should name (``culprit_ranks``, ``culprit_nodes``; empty for a healthy job,
stage imbalance or clock skew), plus ``slow_link_nodes`` and ``clock_offsets_ms``.
"""

from ranklens.simulate.job import SimResult, simulate
from ranklens.simulate.model import (
    FAULT_DEFAULTS,
    Fault,
    FaultKind,
    Layout,
    ResolvedFault,
    SimParams,
    check_job,
    host_name,
    parse_fault,
)

__all__ = [
    "FAULT_DEFAULTS",
    "Fault",
    "FaultKind",
    "Layout",
    "ResolvedFault",
    "SimParams",
    "SimResult",
    "check_job",
    "host_name",
    "parse_fault",
    "simulate",
]
