"""Cost of zero-code step inference (tracing/_autostep.py): µs per training step with it on vs off,
and the cost per module call while the model is still being looked for (global module hooks).

    python bench/autostep_bench.py [--steps 500] [--rounds 9]

One process, no torch.distributed. First the CPU time (this thread's, which other processes on a
busy host do not inflate) of inference's hooks for one step, called directly, next to the explicit
API marking the same step and phases. Then wall time: each round runs the same tiny training loop
(a DataLoader, a 3-layer model, a loss module, SGD: a step of a few hundred µs, so a fixed per-step
cost is not hidden in compute) once with ``autostep`` on and once off, alternating, so drift in
machine load hits both; medians over rounds and of the paired differences are reported.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def _loop(steps: int, autostep: bool) -> float:
    import torch

    import ranklens.tracing as rlt

    rlt.init(job_id="bench", spool_dir=tempfile.mkdtemp(prefix="ranklens-autostep-"), rank=1, world_size=1,
             patch_distributed=False, autostep=autostep, flush_interval_s=0.5)  # fmt: skip
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        lossf = torch.nn.MSELoss()
        data = torch.utils.data.TensorDataset(torch.randn(8 * steps, 16), torch.randn(8 * steps, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=8)
        it = iter(loader)
        for _ in range(20):  # warm-up (the model is found at the first optimizer step)
            x, y = next(it)
            lossf(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        start = time.perf_counter_ns()
        for _ in range(steps - 20):
            x, y = next(it)
            lossf(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter_ns() - start) / (steps - 20) / 1e3
    finally:
        rlt.shutdown()


def hooks_cost(steps: int) -> float:
    """ns per step of inference's own Python work: the hooks of one step called directly (data wait,
    model forward pre/post, backward, optimizer pre/post), on a tracer whose rows are kept."""
    import torch

    from ranklens.tracing._autostep import AutoStep
    from ranklens.tracing.tracer import Tracer

    t = Tracer(job_id="b", attempt=0, rank=1, world_size=1, spool_dir=tempfile.mkdtemp(), flush_interval_s=60)
    auto = AutoStep(t)  # not installed: the hooks are called by hand
    auto._torch = torch
    model, opt = torch.nn.Linear(1, 1), object()
    auto._adopt([model])

    def nothing(it: object) -> None:
        return None

    start = time.thread_time_ns()  # this thread's CPU time: what a busy host's other processes do not add
    for _ in range(steps):
        auto.data_wait(nothing, None)
        auto._root_pre(model, ())
        auto._root_post(model, (), None)
        auto._end_backward(auto._begin_backward())
        auto._opt_pre(opt, (), {})
        auto._opt_post(opt, (), {})
    ns = (time.thread_time_ns() - start) / steps
    assert auto.steps_written == steps - 1 and auto.optimizer_steps == steps
    auto.close()
    t.shutdown()
    return ns


def explicit_cost(steps: int) -> float:
    """ns per step of the explicit API doing the same marking (one step, four phases), for scale."""
    from ranklens.tracing.tracer import Tracer

    t = Tracer(job_id="b", attempt=0, rank=1, world_size=1, spool_dir=tempfile.mkdtemp(), flush_interval_s=60)
    start = time.thread_time_ns()
    for i in range(steps):
        with t.step(i):
            for name in ("data", "forward", "backward", "optimizer"):
                with t.phase(name):
                    pass
    ns = (time.thread_time_ns() - start) / steps
    t.shutdown()
    return ns


def discovery_cost(layers: int, calls: int) -> tuple[float, float]:
    """CPU ns per module call of a ``layers``-deep model with the global hooks installed vs not."""
    import torch
    from torch.nn.modules import module as nn_module

    from ranklens.tracing._autostep import AutoStep
    from ranklens.tracing.tracer import Tracer

    model = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(layers)])
    x = torch.ones(1)

    def run() -> float:
        start = time.thread_time_ns()
        for _ in range(calls):
            model(x)
        return (time.thread_time_ns() - start) / calls / (layers + 1)

    off = [run() for _ in range(3)]
    t = Tracer(job_id="b", attempt=0, rank=1, world_size=1, spool_dir=tempfile.mkdtemp(), flush_interval_s=60)
    auto = AutoStep(t, give_up_after=10**9).install()
    with torch.no_grad():  # not a training forward: the model is never adopted, hooks stay global
        on = [run() for _ in range(3)]
    assert nn_module._global_forward_pre_hooks
    auto.close()
    t.shutdown()
    return statistics.median(off), statistics.median(on)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # a busy 2-core host: intra-op threads would only add noise
    hooks = statistics.median(hooks_cost(20_000) for _ in range(5))
    explicit = statistics.median(explicit_cost(20_000) for _ in range(5))
    print(f"inference's own work: {hooks / 1e3:.1f} µs/step (CPU time of the hooks of one step, called directly); "
          f"the explicit API marking the same: {explicit / 1e3:.1f} µs/step")  # fmt: skip
    on, off = [], []
    for _ in range(a.rounds):
        off.append(_loop(a.steps, False))
        on.append(_loop(a.steps, True))
    m_on, m_off = statistics.median(on), statistics.median(off)
    diffs = sorted(x - y for x, y in zip(on, off))
    print(f"step time, autostep off: median {m_off:.1f} µs/step over {a.rounds} rounds of {a.steps} steps")
    print(f"step time, autostep on:  median {m_on:.1f} µs/step")
    paired = statistics.median(diffs)
    print(f"inference cost: median of paired differences {paired:+.1f} µs/step ({100 * paired / m_off:+.1f}%); "
          f"per-round differences {', '.join(f'{d:+.1f}' for d in diffs)} µs")  # fmt: skip
    base, hooked = discovery_cost(100, 300)
    print(f"while the model is looked for (step 0 only): {base:.0f} -> {hooked:.0f} ns per module call "
          f"(+{hooked - base:.0f} ns)")  # fmt: skip


if __name__ == "__main__":
    main()
