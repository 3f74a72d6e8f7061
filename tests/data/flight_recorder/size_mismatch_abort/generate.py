"""How size_mismatch_abort/ was made: run with RANK, WORLD_SIZE=4, MASTER_ADDR, MASTER_PORT set,
one process per rank. Rank 2 passes 1000 floats to the 4th all_reduce, the others 520."""

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace_json

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
r = dist.get_rank()
t = torch.ones(1000 if r == 2 else 520)
for _ in range(3):
    dist.all_reduce(torch.ones(520))
print(r, "before", flush=True)
try:
    dist.all_reduce(t)
    print(r, "after ok", flush=True)
except Exception as e:
    print(r, "exc", type(e).__name__, str(e)[:300], flush=True)
with open(f"out/fr_trace_rank_{r}.json", "wb") as f:
    f.write(_dump_fr_trace_json())
print(r, "dumped", flush=True)
