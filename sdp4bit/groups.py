"""The process groups one DP group's compressed collectives run over, built once."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _native
from .errors import Sdp4bitError, translated_errors

logger = logging.getLogger("sdp4bit")

# Every ProcessGroups not yet closed, held until closed: its background thread and its
# collectives in flight outlive the Python object (a collective keeps its groups alive).
_OPEN: dict[int, ProcessGroups] = {}
# How long the exit hook gives woken threads to take the GIL back, seconds.
_EXIT_GIL_WAIT_S = 10.0
# Threads inside a collective's wait(); the exit hook waits for none to be left
# (docs/architecture.md, "Waiting, and the GIL at shutdown").
_WAITING = [0]
_WAITING_LOCK = threading.Lock()


@contextlib.contextmanager
def counted_wait():
    """Counts the calling thread as waiting on a collective while the block runs."""
    with _WAITING_LOCK:
        _WAITING[0] += 1
    try:
        yield
    finally:
        with _WAITING_LOCK:
            _WAITING[0] -= 1


def threads_in_wait() -> int:
    """Threads waiting on a collective now."""
    with _WAITING_LOCK:
        return _WAITING[0]


@atexit.register
def _close_open_groups() -> None:
    """Closes the groups still open when the interpreter exits, before it starts shutting
    down, then waits (bounded) until no thread is inside a wait() (docs/architecture.md,
    "Waiting, and the GIL at shutdown"); a rank never exits under a collective its peers are
    still running. Like :meth:`ProcessGroups.close`, this waits for those collectives (at
    most the groups' timeout). Registered after torch's import, so it runs before any exit
    hook of torch's."""
    for groups in list(_OPEN.values()):
        try:
            groups.close()
        except Sdp4bitError as e:
            logger.warning("sdp4bit: closing process groups at exit failed: %s", e)
    # Sleeping hands the GIL to the threads those collectives woke; bounded, so that exit
    # never hangs on a thread that waits for something else.
    deadline = time.monotonic() + _EXIT_GIL_WAIT_S
    while threads_in_wait() > 0 and time.monotonic() < deadline:
        time.sleep(0.001)


#: Where launchers say how many ranks share a node, in the order they are read: torchrun and
#: torch.distributed.run (``LOCAL_WORLD_SIZE``), DeepSpeed's and Open MPI's launchers
#: (``LOCAL_SIZE``, ``OMPI_COMM_WORLD_LOCAL_SIZE``), and SLURM's ``srun`` (tasks per node).
NODE_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                       "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def node_size(given: int | None, setting: str) -> int:
    """Ranks per node: `given` if set, else the first launcher variable of
    :data:`NODE_SIZE_VARIABLES` that is set. SLURM's ``SLURM_TASKS_PER_NODE`` is taken only
    when every node runs the same count (``4`` or ``4(x8)``). `setting` names the integration's
    flag or config key (``--sdp4bit-ranks-per-node``, ``"sdp4bit": {"ranks_per_node": N}``),
    which the error advises when neither says."""
    if given is not None:
        if int(given) <= 0:
            raise ValueError(f"sdp4bit: {setting} must be a positive rank count, got {given}")
        return int(given)
    for name in NODE_SIZE_VARIABLES:
        value = os.environ.get(name)
        if not value:
            continue
        count = value.split("(x", 1)[0] if name == "SLURM_TASKS_PER_NODE" else value
        if count.isdigit() and int(count) > 0 and "," not in value:
            return int(count)
        raise ValueError(
            f"sdp4bit: {name}={value!r} does not give one positive number of ranks per node; "
            f"set {setting}")
    raise ValueError(
        f"sdp4bit: the number of ranks per node is unknown: no launcher variable of "
        f"{', '.join(NODE_SIZE_VARIABLES)} is set; set {setting}")


def is_first_rank() -> bool:
    """Whether this process is the job's rank 0: from torch.distributed once it is
    initialized, before that from the launcher's ``RANK`` (or SLURM's ``SLURM_PROCID``;
    a process started by no launcher is rank 0). Start-up lines print on it alone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        value = os.environ.get(name)
        if value is not None:
            return value.strip() == "0"
    return True


def timeout_of(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout `group`'s collectives run under (what ``init_process_group`` or
    ``new_group`` gave it), or None where this torch does not say (torch's default then
    applies). sdp4bit's own groups take it, so that a dead peer fails them as soon as it
    fails the framework's collectives, not after torch's default of 10 or 30 minutes."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def node_labels_from_local_world_size(global_ranks: list[int], local_world_size: int) -> list[int]:
    """Node of each rank when nodes hold `local_world_size` consecutive global ranks."""
    if local_world_size <= 0:
        raise ValueError(f"sdp4bit: local_world_size must be positive, got {local_world_size}")
    return [g // local_world_size for g in global_ranks]


def _layout(labels: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
    """(node index, local index, members per node) of each DP rank, as the Rust core's
    Topology numbers them: nodes in order of first appearance, locals in DP order."""
    seen: dict[int, int] = {}
    node_of, local_of, members = [], [], []
    for z, label in enumerate(labels):
        node = seen.setdefault(label, len(seen))
        if node == len(members):
            members.append([])
        node_of.append(node)
        local_of.append(len(members[node]))
        members[node].append(z)
    return node_of, local_of, members


@dataclass
class ProcessGroups:
    """A DP group and, when every node holds the same number of its ranks, its intra-node and
    inter-node subgroups, as private process groups (so that the compressed collectives, run
    on a background thread for CPU buckets and on a side stream for CUDA buckets, never
    interleave with the training loop's own collectives). One set of groups serves buckets
    of one kind, CPU or CUDA.

    Build it once per DP group with :meth:`create`; every rank of the DP group must call it.
    """

    dp_group: dist.ProcessGroup | None
    global_ranks: list[int]
    node_labels: list[int]
    rank: int
    world: dist.ProcessGroup
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    native: object
    timeout: datetime.timedelta | None = None
    host: dist.ProcessGroup | None = None  # host_group(), once made

    @classmethod
    def create(
        cls,
        dp_group: dist.ProcessGroup | None = None,
        local_world_size: int | None = None,
        node_labels: list[int] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> ProcessGroups:
        """Builds the groups of `dp_group` (default: the whole job).

        Nodes come from `node_labels` (one per DP rank) if given, else from
        `local_world_size` (default: the launcher's, :func:`node_size`), a rank's node being
        ``global_rank // local_world_size``. `timeout` bounds every collective of these groups
        (default: `dp_group`'s own, :func:`timeout_of`).
        """
        if not dist.is_initialized():
            raise RuntimeError("sdp4bit: torch.distributed is not initialized")
        global_ranks = dist.get_process_group_ranks(dp_group or dist.group.WORLD)
        if timeout is None:
            timeout = timeout_of(dp_group or dist.group.WORLD)
        if node_labels is None:
            local_world_size = node_size(local_world_size, "local_world_size or node_labels")
            node_labels = node_labels_from_local_world_size(global_ranks, local_world_size)
        node_labels = [int(label) for label in node_labels]
        if len(node_labels) != len(global_ranks):
            raise ValueError(
                f"sdp4bit: {len(node_labels)} node labels for a DP group of {len(global_ranks)} ranks"
            )
        rank = dist.get_rank(dp_group or dist.group.WORLD)
        node_of, local_of, members = _layout(node_labels)
        equal_nodes = len({len(m) for m in members}) == 1
        if equal_nodes:
            # c10d orders a group's ranks by global rank; the core's inter-node group is in
            # node order. Checked for every local index before any group exists, so that all
            # ranks raise together instead of some waiting in new_group.
            for local in range(len(members[0])):
                across = [global_ranks[m[local]] for m in members]
                if across != sorted(across):
                    raise ValueError(
                        f"sdp4bit: node labels {node_labels} order the nodes differently from "
                        f"the global ranks (inter-node group {across}); number nodes by their "
                        "lowest global rank"
                    )
        kwargs = {"use_local_synchronization": True}
        if timeout is not None:
            kwargs["timeout"] = timeout
        world = dist.new_group(global_ranks, **kwargs)
        intra = inter = None
        if equal_nodes and len(global_ranks) > 1:
            # Every rank builds only the subgroups it belongs to (local synchronization), in
            # the same order on every rank: its node's group, then its local index's group.
            mine = members[node_of[rank]]
            across = [m[local_of[rank]] for m in members]
            if len(mine) > 1:
                intra = dist.new_group([global_ranks[z] for z in mine], **kwargs)
            if len(members) > 1:
                inter = dist.new_group([global_ranks[z] for z in across], **kwargs)
        with translated_errors():
            native = _native.classes().ProcessGroups(
                world.group_name,
                intra.group_name if intra is not None else "",
                inter.group_name if inter is not None else "",
            )
        groups = cls(dp_group, global_ranks, node_labels, rank, world, intra, inter, native,
                     timeout)
        _OPEN[id(groups)] = groups
        return groups

    def close(self) -> None:
        """Completes the collectives already started, stops the background thread and
        releases the private groups. Call it before ``dist.destroy_process_group()`` (process
        exit then has nothing of sdp4bit's left to tear down); collectives started afterwards
        raise :class:`Sdp4bitError`. Idempotent; groups still open when the interpreter
        exits are closed then, before it shuts down."""
        with translated_errors():
            self.native.close()
        _OPEN.pop(id(self), None)

    def host_group(self) -> dist.ProcessGroup:
        """A gloo group of the DP group's ranks for the agreements sdp4bit makes in host
        memory beside CUDA buckets (their integer-sum overflows, collectives.py), whatever the
        world group's backend: no device work, so no wait for the device. Made at its first
        use, which every rank reaches at the same point (a bucket's set-up, after the set-up
        agreement)."""
        if self.host is None:
            kwargs = {"use_local_synchronization": True, "backend": "gloo"}
            if self.timeout is not None:
                kwargs["timeout"] = self.timeout
            self.host = dist.new_group(self.global_ranks, **kwargs)
        return self.host

    @property
    def size(self) -> int:
        """Ranks in the DP group."""
        return len(self.global_ranks)

    def side_stream(self, device: torch.device, collective: str) -> torch.cuda.Stream:
        """The stream the `collective` (``"reduce_scatter"`` or ``"all_gather"``) of CUDA
        buckets on `device` runs on: one per device, kind and set of groups, so that an
        all-gather's work does not queue behind a reduce-scatter's, nor the reverse. The
        extension creates it (non-blocking, at the device's greatest priority) rather than take
        one of torch's pool streams, which NCCL's communicators also take, so no other work
        queues on it. Work issued on it runs alongside the caller's stream; a collective's
        ``wait()`` makes the caller's current stream wait for it."""
        with translated_errors():
            stream_id, device_index, device_type = self.native.side_stream(device.index,
                                                                           collective)
        return torch.cuda.Stream(stream_id=stream_id, device_index=device_index,
                                 device_type=device_type)
