"""Tracing must not change what a DDP job computes: the parameters after a few steps of an unmodified
DDP script under ``ranklens run`` (ranklens' all-reduce hook in place of DDP's native one) equal those
of the same run untraced (``RANKLENS_DISABLE=1``), to float32 rounding."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

from tests._jobs import GLOO_TEARDOWN_ABORT, TORCHRUN, ranklens_run

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)),
                bucket_cap_mb=0.05)  # several buckets a step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank: the average matters
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
    if rank == 0:
        torch.save({"params": [p.detach() for p in model.parameters()],
                    "hooked": bool(getattr(model, "_ranklens_user_hook", False))}, sys.argv[1])
    dist.barrier()  # rank 1 does not tear gloo down while rank 0 still saves
    dist.destroy_process_group()
    """
)


@pytest.mark.e2e
def test_a_traced_ddp_job_trains_to_the_same_parameters_as_untraced(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    got = {}
    for mode in ("off", "on"):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for k in ("RANKLENS_JOB_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "RANKLENS_DISABLE", "RANKLENS_DDP"):
            env.pop(k, None)
        if mode == "off":
            env["RANKLENS_DISABLE"] = "1"
        out = tmp_path / f"{mode}.pt"
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(tmp_path / "train.py"), str(out)]
        proc = ranklens_run(f"embedded://{tmp_path}/store", tmp_path / f"spool-{mode}", cmd, timeout=240, env=env)
        if proc.returncode != 0 and GLOO_TEARDOWN_ABORT in proc.stderr:
            # torch's gloo aborted a rank in its teardown (a fresh-clone CI run, with tracing OFF):
            # not what this test is about; once more, and a second time fails
            print(f"{mode}: a rank aborted in gloo's teardown; running the job again", file=sys.stderr)
            proc = ranklens_run(f"embedded://{tmp_path}/store", tmp_path / f"spool-{mode}", cmd, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[mode] = torch.load(out)
    assert got["on"]["hooked"] and not got["off"]["hooked"]  # the traced run really went through the hook
    for a, b in zip(got["off"]["params"], got["on"]["params"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
