"""Tensor parallelism under FSDP2 (a 2-D (dp, tp) mesh, as torchtitan's ``parallelize``
builds it): the elements of a unit's flat shard whose parameters are replicated over the TP
dimension travel exact.

A unit sharded over the dp dimension holds parameters that tensor parallelism made DTensors
(``ColwiseParallel`` / ``RowwiseParallel``: sharded over tp, a different slice on each TP
rank) beside ones every TP rank holds a copy of (norms, biases of row-wise layers, anything
left out of the plan). Each TP rank's dp group runs the unit's collectives over its own
flat buffer, whose quantization groups mix both kinds, so the codecs would decode the copies
differently on each TP rank and they would drift apart. So, as ``exact_params`` keeps
megatron-core's replicated parameters exact (docs/megatron.md), the replicated elements of
every shard are all-gathered and reduce-scattered exactly beside the compressed collective,
and overwrite what it decoded: every TP rank then ends with the same bits of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..errors import Sdp4bitError


@dataclass(frozen=True)
class ExactRanges:
    """The [start, stop) element ranges of a unit's per-rank shard (FSDP's layout: its
    parameters' padded shards in order) that hold TP-replicated parameters."""

    ranges: tuple[tuple[int, int], ...]
    shard_numel: int  # the whole shard's

    @property
    def whole(self) -> bool:
        """Every element is TP-replicated: the unit runs FSDP's own (exact) collectives."""
        return self.ranges == ((0, self.shard_numel),)

    @property
    def numel(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """The ranges' elements of each row of `rows` (``(W, N)`` or ``(N,)``), contiguous."""
        return torch.cat([rows[..., start:stop] for start, stop in self.ranges], dim=-1)

    def put(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Writes `values` (as :meth:`take` gives them) back into the ranges of `rows`."""
        at = 0
        for start, stop in self.ranges:
            rows[..., start:stop].copy_(values[..., at:at + stop - start])
            at += stop - start

    def reduce_scatter(self, output: torch.Tensor, input_tensor: torch.Tensor,
                       group: dist.ProcessGroup, divisor: float) -> int:
        """Overwrites the ranges of `output` (this rank's ``(N,)`` shard) with the exact fp32
        sum of the ranges of every row of `input_tensor` (``(W * N,)``) over `group`, divided
        by `divisor`; returns the bytes this rank sent."""
        world = group.size()
        rows = self.take(input_tensor.view(world, -1)).float().contiguous()
        summed = torch.empty(rows.shape[1], dtype=torch.float32, device=rows.device)
        dist.reduce_scatter_tensor(summed, rows.view(-1), group=group)
        if divisor != 1:
            summed.div_(divisor)
        self.put(output, summed)
        return (world - 1) * summed.numel() * summed.element_size()

    def all_gather(self, output: torch.Tensor, own: torch.Tensor,
                   group: dist.ProcessGroup) -> int:
        """Overwrites the ranges of every rank's slot of `output` (``(W * N,)``) with the
        exact `own` (this rank's :meth:`take`, kept before the compressed gather decoded over
        it) of each rank; returns the bytes this rank sent."""
        world = group.size()
        gathered = torch.empty(world * own.numel(), dtype=own.dtype, device=own.device)
        dist.all_gather_into_tensor(gathered, own, group=group)
        self.put(output.view(world, -1), gathered.view(world, -1))
        return (world - 1) * own.numel() * own.element_size()


def tp_dimension(param_meshes: list, shard_dim_names: tuple) -> str | None:
    """The name of the TP dimension the units' parameters live on besides the dp dimension
    they are sharded over (None: no tensor parallelism); refuses more than one."""
    others = set()
    for mesh in param_meshes:
        if mesh.ndim == 1:
            continue
        names = mesh.mesh_dim_names or tuple(f"dim {d}" for d in range(mesh.ndim))
        others.update(n for n in names if n not in shard_dim_names)
    if len(others) > 1:
        raise Sdp4bitError(
            f"the FSDP units' parameters live on mesh dimensions {sorted(others)} besides the "
            "data-parallel one they are sharded over; sdp4bit.fsdp serves one tensor-parallel "
            "dimension (a 2-D (dp, tp) mesh)")
    return others.pop() if others else None


def exact_ranges(fsdp_params: list, tp_name: str) -> ExactRanges | None:
    """The ranges of a unit's shard holding parameters not sharded over the TP dimension
    `tp_name`: plain tensors (every TP rank holds them) and DTensors replicated over it; None
    where there are none."""
    ranges, at = [], 0
    for fsdp_param in fsdp_params:
        numel = fsdp_param.padded_sharded_param_size.numel()
        if not _sharded_over(fsdp_param.sharded_param, tp_name):
            if ranges and ranges[-1][1] == at:
                ranges[-1] = (ranges[-1][0], at + numel)
            else:
                ranges.append((at, at + numel))
        at += numel
    return ExactRanges(tuple(ranges), at) if ranges else None


def _sharded_over(param, tp_name: str) -> bool:
    """Whether the sharded parameter `param` (a DTensor on the dp mesh, or on the (dp, tp)
    mesh) holds a different slice on each rank of the TP dimension."""
    mesh = param.device_mesh
    if tp_name not in (mesh.mesh_dim_names or ()):
        return False
    placement = param.placements[mesh.mesh_dim_names.index(tp_name)]
    return isinstance(placement, Shard)
