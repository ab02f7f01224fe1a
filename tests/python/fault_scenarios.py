"""Rank code for test_faults.py: a real integration trains on gloo ranks until one rank dies
(``os._exit``) as it enters one of sdp4bit's compressed collectives, leaving its peers in the
middle of it; every other rank reports what it raised, and when.

Each rank is a process of its own, started by test_faults.py's runner as harness.py starts
them (a fork server that imported the heavy libraries once), in a process group whose
timeout is :data:`TIMEOUT_S`, and writes its report to a file (nothing is lost when a peer
dies)."""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback

import torch
import torch.distributed as dist

#: The process group's timeout: every other rank must fail within it.
TIMEOUT_S = 20
#: The rank that dies, and its exit status (what tells the runner it died where it should).
DYING_RANK = 1
DEATH_STATUS = 17


def _megatron(rank, world):
    """megatron-core's DDP with the distributed optimizer (megatron_scenarios.train)."""
    from megatron_scenarios import train

    return train(rank, world, "sdp4bit", False, False, 3)


def _deepspeed(rank, world):
    """DeepSpeed ZeRO 2 with the "sdp4bit" section (deepspeed_scenarios)."""
    from deepspeed_scenarios import _zero2_steps

    return _zero2_steps(rank, world, 3)


def _fsdp(rank, world):
    """FSDP2 through sdp4bit.fsdp (fsdp_scenarios.train)."""
    from fsdp_scenarios import train

    return train(rank, world, "sdp4bit", 3)


def _stall(rank, world):
    """No integration: rank 0 never returns (the runner's own control)."""
    if rank == 0:
        time.sleep(3600)


INTEGRATIONS = {"megatron": _megatron, "deepspeed": _deepspeed, "fsdp": _fsdp, "stall": _stall}


def die_entering(collective: str, call: int, death_file: str) -> None:
    """Makes this process's `call`-th ``start()`` of the sdp4bit collective class named
    `collective` (over every instance) write the time to `death_file` and end the process
    (``os._exit``) instead of taking part: its peers are left in that collective. (Ending
    after the collective has started on sdp4bit's thread leaves it to race the exit: a small
    exchange often completes first, and the peers fail in the next collective instead.)"""
    import sdp4bit.collectives

    cls = getattr(sdp4bit.collectives, collective)
    original = cls.start
    calls = [0]

    def start(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            with open(death_file, "w") as out:
                out.write(repr(time.time()))
            os._exit(DEATH_STATUS)
        return original(self, *args, **kwargs)

    cls.start = start


def without_collective_names() -> None:
    """The control: sdp4bit's collectives raise the extension's message alone, as before
    their errors named the collective."""
    import sdp4bit.collectives
    from sdp4bit.errors import translated_errors

    sdp4bit.collectives.translated_errors = lambda collective=None: translated_errors()


def rank_entry(rank, world, port, env, integration, collective, call, directory,
               named=True):
    """One rank: joins the process group (timeout :data:`TIMEOUT_S`), arms the death on
    :data:`DYING_RANK`, runs the integration (`named` False: :func:`without_collective_names`),
    and writes its report to ``rank<r>`` in `directory` (:func:`report`)."""
    os.environ.update(env)
    torch.set_num_threads(1)
    death_file = os.path.join(directory, "death")
    if not named:
        without_collective_names()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        if rank == DYING_RANK and collective is not None:
            die_entering(collective, call, death_file)
        outcome = ("ok", INTEGRATIONS[integration](rank, world))
    except BaseException as error:  # what the test checks
        outcome = ("error", {"type": type(error).__name__, "message": str(error),
                             "traceback": traceback.format_exc(), "at": time.time()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _write(os.path.join(directory, f"rank{rank}"), outcome)


def _write(path: str, outcome) -> None:
    """Writes `outcome` to `path` whole (a reader never sees part of it)."""
    with open(path + ".part", "wb") as out:
        pickle.dump(outcome, out)
    os.replace(path + ".part", path)


def report(directory: str, rank: int):
    """What rank `rank` reported: ("ok", its result) or ("error", {"type", "message",
    "traceback", "at"}); None if it wrote nothing (it died)."""
    path = os.path.join(directory, f"rank{rank}")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def death_time(directory: str) -> float | None:
    """When the dying rank ended itself (time.time()), or None if it never reached the
    collective."""
    path = os.path.join(directory, "death")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return float(f.read())
