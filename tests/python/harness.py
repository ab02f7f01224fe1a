"""Runs a scenario on W gloo ranks, each its own process, and returns every rank's result.

Rank processes are forked by a fork server (``multiprocessing``'s "forkserver" start method)
that imported torch, megatron-core and DeepSpeed once (``rank_preload``), so a test does not
pay their imports (about 2 s of CPU for torch and 5 s for megatron-core, per rank) again. The
server itself never runs torch or Rust code, so no thread pool is forked half-initialised;
every rank still starts with its own process state.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, env, backend, scenario, args, results):
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        value = scenario(rank, world, *args)
        results.put((rank, "ok", value))
    except BaseException:  # reported to the parent, which fails the test with it
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, scenario, *args, env: dict[str, str] | None = None,
              timeout: float = 180.0, backend: str = "gloo") -> list:
    """Runs ``scenario(rank, world, *args)`` on `world` processes joined in a process group
    of `backend` (gloo unless said); returns the per-rank return values, or fails with every
    failed rank's traceback."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rank_preload"])
    results = ctx.Queue()
    port = free_port()
    env = {"LOCAL_WORLD_SIZE": str(world), **(env or {})}
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, env, backend, scenario, args, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    collected: dict[int, tuple[str, object]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(collected) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(collected))} gave no result "
                    f"within {timeout} s"
                )
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in collected]
                if dead:
                    raise RuntimeError(f"ranks {dead} died without a result "
                                       f"(exit codes {[procs[r].exitcode for r in dead]})")
                continue
            collected[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failures = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(collected.items()) if s != "ok"]
    if failures:
        raise AssertionError("scenario failed:\n" + "\n".join(failures))
    return [collected[r][1] for r in range(world)]
