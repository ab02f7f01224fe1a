"""What each rank runs in test_wait.py: how ``Handle.wait`` blocks on a CPU collective's
completion descriptor (imported by name in the rank processes)."""

from __future__ import annotations

import datetime
import os
import resource
import select
import time

import torch
import torch.distributed as dist

import sdp4bit.collectives
from sdp4bit import Config, GradReduceScatter, ProcessGroups, Sdp4bitError, WeightAllGather

# Descriptors rank 0 holds open before a wait, so that the completion descriptor's number is
# above select.select's limit (FD_SETSIZE, 1024) when the process may open that many.
_DESCRIPTORS_ABOVE_SELECT_LIMIT = 1100


def _eventfds() -> int:
    """This process's open eventfds."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventfd]"
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    return count


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _hold_many_descriptors() -> list[int]:
    """Opens descriptors until the next one is numbered above 1024, if the limits allow it
    (then returns them, for the caller to close); else opens none."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _DESCRIPTORS_ABOVE_SELECT_LIMIT + 64
    if hard != resource.RLIM_INFINITY and hard < want:
        return []
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held = []
    while not held or held[-1] < _DESCRIPTORS_ABOVE_SELECT_LIMIT:
        held.append(os.open(os.devnull, os.O_RDONLY))
    return held


def wait_returns_when_the_collective_completes(rank, world, delay):
    """Rank 0 starts a reduce-scatter that rank 1 joins `delay` seconds later, with its
    completion descriptor numbered above 1024 where the limits allow. Rank 0 returns: the
    descriptor's number, whether it was readable and whether the collective was completed
    just after the start, the wall times of the start and of wait()'s return, the calling
    thread's CPU seconds in wait(), and whether the shard is right; rank 1 returns the wall
    time of its wait()'s return. Handle.wait rechecks completion only every 60 s here, so a
    descriptor that never became readable would make rank 0 return a minute late."""
    sdp4bit.collectives._COMPLETION_RECHECK_MS = 60_000
    groups = ProcessGroups.create(node_labels=list(range(world)))
    numel = world * 4096
    rs = GradReduceScatter(groups, Config(), numel, 0)
    shard = torch.empty(rs.shard_len)
    bucket = torch.ones(numel)
    held = _hold_many_descriptors() if rank == 0 else []
    dist.barrier()
    if rank != 0:
        time.sleep(delay)
        rs.start(bucket, shard, 0).wait()
        done = time.time()
        groups.close()
        return {"done": done}
    started = time.time()
    handle = rs.start(bucket, shard, 0)
    fd = handle._work.completion_fd()
    readable_at_start, completed_at_start = _readable(fd), handle.is_completed()
    cpu = time.thread_time()
    handle.wait()
    cpu = time.thread_time() - cpu
    done = time.time()
    for descriptor in held:
        os.close(descriptor)
    shard_right = bool(torch.allclose(shard, torch.full_like(shard, float(world)), rtol=0.1))
    groups.close()
    return {"fd": fd, "held": len(held), "readable_at_start": readable_at_start,
            "completed_at_start": completed_at_start, "completed_at_end": handle.is_completed(),
            "started": started, "done": done, "wait_cpu_s": cpu, "shard_right": shard_right}


def completion_descriptors_do_not_leak(rank, world, calls):
    """Open eventfds after the set-up (before any collective), while 8 reduce-scatters are in
    flight, after `calls` reduce-scatters and all-gathers (waited, and as many reduce-scatters
    dropped unwaited) and after the groups are closed (their executor thread joined)."""
    groups = ProcessGroups.create(node_labels=list(range(world)))
    numel = world * 1024
    rs = GradReduceScatter(groups, Config(), numel, 0)
    ag = WeightAllGather(groups, Config(), torch.zeros(numel, dtype=torch.bfloat16), 1)
    bucket, shard = torch.randn(numel), torch.empty(rs.shard_len)
    params = torch.zeros(numel, dtype=torch.bfloat16)
    before = _eventfds()
    in_flight = [rs.start(bucket, shard, step) for step in range(8)]
    while_in_flight = _eventfds()
    for handle in in_flight:
        handle.wait()
    del in_flight, handle
    for step in range(calls):
        rs.start(bucket, shard, step).wait()
        ag.start(params, step).wait()
        rs.start(bucket, shard, step)  # dropped: its Work waits for it as it is freed
    after_calls = _eventfds()
    groups.close()
    after_close = _eventfds()
    return {"before": before, "while_in_flight": while_in_flight, "in_flight": 8,
            "after_calls": after_calls, "after_close": after_close}


def errors_from_the_collective_reach_wait(rank, world):
    """Rank 0 starts a reduce-scatter that rank 1 never joins, on groups with a 2 s timeout:
    wait() raises the exchange's error (rank 0 returns its message and how long wait() took);
    then both ranks meet on the default group and close their groups."""
    groups = ProcessGroups.create(node_labels=list(range(world)),
                                  timeout=datetime.timedelta(seconds=2))
    numel = world * 1024
    rs = GradReduceScatter(groups, Config(), numel, 0)
    shard = torch.empty(rs.shard_len)
    message, seconds, again = None, None, None
    if rank == 0:
        handle = rs.start(torch.ones(numel), shard, 0)
        started = time.monotonic()
        try:
            handle.wait()
        except Sdp4bitError as error:
            message = str(error)
        seconds = time.monotonic() - started
        # The failed collective was released by that wait(); a second one raises the same
        # error again instead of returning as if it had succeeded.
        try:
            handle.wait()
            again = None
        except Sdp4bitError as error:
            again = str(error)
    dist.barrier()
    groups.close()
    return {"message": message, "seconds": seconds, "again": again}
