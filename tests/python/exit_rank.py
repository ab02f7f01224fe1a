"""A rank that exits while a Python thread waits on a compressed collective (run as a script
by test_exit.py, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set).

Rank 0 starts a reduce-scatter, waits for it in a daemon thread and lets its main thread return,
without closing anything; the other rank joins that collective only after rank 0 has begun
to exit (it waits for the file `flag`, which rank 0 writes last, then `delay` seconds), so
the collective completes while rank 0's interpreter is exiting."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sdp4bit import Config, GradReduceScatter, ProcessGroups


def main() -> None:
    flag, delay = Path(sys.argv[1]), float(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups = ProcessGroups.create(local_world_size=1)
    numel = 1 << 14
    rs = GradReduceScatter(groups, Config("sdp4bit"), numel, 0)
    shard = torch.empty(rs.shard_len)
    bucket = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    dist.barrier()
    if rank == 0:
        handle = rs.start(bucket, shard, 0)
        threading.Thread(target=handle.wait, daemon=True).start()
        flag.write_text("exiting")
        return
    while not flag.exists():
        time.sleep(0.01)
    time.sleep(delay)
    rs.start(bucket, shard, 0).wait()
    groups.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
