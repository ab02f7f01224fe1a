"""Runs a training script on W ranks of this host as ``torchrun --standalone --nproc-per-node W``
does, but forks the rank processes from a launcher that has imported torch, megatron-core and
sdp4bit once, so a run does not pay their imports again on every rank (about 2 s of CPU for
torch and 5 s for megatron-core per rank: some 15 s of a 70 s run of the convergence study on
2 cores).

Each rank is a process of its own, forked before anything runs: the launcher only imports
(it never runs torch, Rust or collective code, and it refuses to fork once it has a second
thread), so every rank starts from the state a fresh interpreter would reach by importing the
same libraries. The rank gets torchrun's rendezvous variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), runs
the script as ``__main__`` with the script's directory first on its path, runs the exit
handlers the script registered (not those of the libraries' imports, which ran in the
launcher), and exits with the script's status. When a rank fails, the
others are stopped (they would wait in a collective until their timeout), as torchrun does.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

#: What every rank of the study's scripts imports; a library that is not installed is skipped.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp",
           "megatron.core.distributed", "megatron.core.optimizer",
           "megatron.core.models.gpt", "megatron.core.transformer", "sdp4bit")


@dataclass(frozen=True)
class Finished:
    """A finished run: its exit status (the first failing rank's, else 0) and every rank's
    output (stdout and stderr together), rank after rank."""

    returncode: int
    output: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class RankLauncher:
    """Launches W-rank runs of Python scripts from this process. `env` is set in this process
    before anything is imported (variables read at library load, such as ``OMP_NUM_THREADS``,
    must be), so every rank inherits it."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD):
        os.environ.update(env)
        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError:
                continue

    def run(self, script: Path, args: list[str], world: int, cwd: Path,
            timeout: float) -> Finished:
        """Runs `script` with `args` on `world` ranks in `cwd`; waits for every rank (at most
        `timeout` seconds, then stops them all and reports status 124)."""
        if _threads() != 1:
            raise RuntimeError(f"the launcher has {_threads()} threads: forking it would "
                               "copy a half-held lock into every rank")
        port = _free_port()
        with tempfile.TemporaryDirectory() as logs:
            outputs = [Path(logs) / f"rank{rank}.log" for rank in range(world)]
            for out in outputs:  # there even for a rank stopped before it ran a line
                out.touch()
            pids = [self._fork_rank(script, args, rank, world, port, cwd, out)
                    for rank, out in enumerate(outputs)]
            status = _wait_all(pids, timeout)
            text = "".join(f"--- rank {rank} ---\n{out.read_text(errors='replace')}"
                           for rank, out in enumerate(outputs))
        return Finished(status, text)

    @staticmethod
    def _fork_rank(script: Path, args: list[str], rank: int, world: int, port: int,
                   cwd: Path, output: Path) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            code = _run_rank(script, args, rank, world, port, cwd, output)
        finally:
            os._exit(code)


def _run_rank(script: Path, args: list[str], rank: int, world: int, port: int, cwd: Path,
              output: Path) -> int:
    """In the forked rank: the script as ``__main__``; its exit status."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # The launcher's own exit handlers (its temporary directories' clean-up among them) are
    # not the rank's: the rank runs those its script registers.
    atexit._clear()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    warnings.simplefilter("ignore")
    os.chdir(cwd)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter exits: a number is the status, else printed
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # reported in the rank's output, as an uncaught exception would be
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _wait_all(pids: list[int], timeout: float) -> int:
    """Waits for every rank; when one fails or the time is up, stops the others. The first
    failure's status (128 + N for a rank killed by signal N), 124 for a timeout, else 0."""
    deadline = time.monotonic() + timeout
    running, status = list(pids), 0
    while running:
        for pid in list(running):
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            running.remove(pid)
            code = os.waitstatus_to_exitcode(raw)
            if code != 0 and status == 0:
                status = code if code > 0 else 128 - code
                _stop(running)
        if running and time.monotonic() > deadline and status == 0:
            status = 124
            _stop(running)
        time.sleep(0.05)
    return status


def _stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
