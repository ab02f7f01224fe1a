"""The all-gather and reduce-scatter an FSDP unit runs once sdp4bit is enabled on it.

FSDP2 calls them with the unit's whole flat buffers, which it allocates through them
(``allocate``):

- the reduce-scatter, once per backward that syncs gradients: `input_tensor` ``(W * N,)`` in the
  reduce dtype, row ``r`` holding what rank ``r`` receives, into `output_tensor` ``(N,)``, with
  ``op`` AVG, or SUM when the unit forces sum reductions (FSDP then divides itself);
- the all-gather, before every forward and every re-gather in backward: `input_tensor` is this
  rank's slot inside `output_tensor` ``(W * N,)``, already filled with its shard in the
  parameter dtype.

That is the layout of the core's buckets (shard ``r`` of a bucket belongs to rank ``r``), so
an fp32 reduce-scatter and a bf16 all-gather run on FSDP's own buffers without copies. Both
complete before returning: on the CPU they have run; for a CUDA unit they are enqueued on the
groups' side stream of their kind (the all-gathers' and the reduce-scatters' differ, as FSDP's
own streams do, so neither queues behind the other) and the stream that was current (FSDP's
reduce-scatter or all-gather stream, where FSDP then records its events) waits for them.

The compressed collectives are shared by the units whose buffers have the same size (the
core's buffers exist once per size, not once per unit). Each unit numbers its random streams
by its gradient syncs, with its index folded in (:meth:`UnitState.stream_step`): every gather
between two syncs (the forward, the backward re-gathers, micro-batches without sync)
quantizes the same weights with the same random numbers, so the backward pass sees exactly the
weights the forward pass used, and no two units or syncs share random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..collectives import CrossGroupAllReduce, GradReduceScatter, WeightAllGather
from ..config import Config, limits
from ..errors import Sdp4bitError
from ..groups import ProcessGroups
from ..integration import (WireCounter, cross_group_buffer, log_route_notice, require_bf16,
                           ring_all_reduce_bytes)
from ..telemetry import ErrorStats, Telemetry
from ._torch import Unit
from .tensor_parallel import ExactRanges

#: Reduce dtypes the gradient codecs take: fp32 as is, the 16-bit ones through an fp32 copy.
_STAGED_REDUCE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Shared:
    """What the units of one model share: the codecs, the groups, the compressed collectives
    (one per kind and buffer size), the counts."""

    config: Config
    groups: ProcessGroups
    telemetry: Telemetry
    units: int  # units with parameters: the stride of the stream steps
    units_with_grads: int  # units that reduce-scatter each step (telemetry waits for all)
    quant_start: int = 0  # the config's grad_quant_start_step
    wire: WireCounter = field(default_factory=WireCounter)
    reduce_scatters: dict[int, GradReduceScatter] = field(default_factory=dict)
    all_gathers: dict[int, WeightAllGather] = field(default_factory=dict)
    across: Across | None = None  # hybrid sharding: the all-reduce over the replicate dimension

    def reduce_scatter(self, numel: int, device: torch.device) -> GradReduceScatter:
        """The gradient collective of `numel`-element buffers, set up (collectively, with the
        cross-rank agreement check) when a buffer of that size is first seen."""
        rs = self.reduce_scatters.get(numel)
        if rs is None:
            rs = GradReduceScatter(self.groups, self.config, numel,
                                   _next_id(self.reduce_scatters, "gradient"), device=device)
            if not self.reduce_scatters:
                log_route_notice("FSDP units", [rs])
            self.reduce_scatters[numel] = rs
        return rs

    def all_gather(self, output: torch.Tensor) -> WeightAllGather:
        """The parameter collective of buffers like `output`, set up like the gradient ones.
        The direct weight codecs keep no reference: set-up reads nothing of `output`'s
        values."""
        ag = self.all_gathers.get(output.numel())
        if ag is None:
            ag = WeightAllGather(self.groups, self.config, output,
                                 _next_id(self.all_gathers, "parameter"))
            self.all_gathers[output.numel()] = ag
        return ag


@dataclass
class Across:
    """Hybrid sharding (a 2-D mesh, replicate x shard, each unit sharded over the shard
    dimension): the all-reduce of every unit's reduce-scattered gradients over the replicate
    dimension, from FSDP's all-reduce hook. With ``cross_group_bits`` 8 or 16, Global-QSGD
    integers summed by the replicate group (:class:`~sdp4bit.CrossGroupAllReduce`, one per
    buffer size, numerics §7.6); with ``exact`` (and before ``grad_quant_start_step``),
    FSDP's fp32 all-reduce."""

    group: dist.ProcessGroup  # the replicate dimension's group of this rank
    groups: ProcessGroups | None  # its sdp4bit groups, when compressed
    reduces: dict[int, CrossGroupAllReduce] = field(default_factory=dict)  # by padded numel

    @property
    def size(self) -> int:
        return self.group.size()

    def all_reduce(self, numel: int, config: Config, device: torch.device) -> CrossGroupAllReduce:
        """The compressed all-reduce of `numel`-element buffers, set up (collectively) when
        first seen."""
        reduce = self.reduces.get(numel)
        if reduce is None:
            reduce = CrossGroupAllReduce(self.groups, config, numel, _next_id(self.reduces,
                                         "replicate all-reduce"), stream_rank=dist.get_rank(),
                                         device=device)
            self.reduces[numel] = reduce
        return reduce


def _next_id(pool: dict, kind: str) -> int:
    """The bucket id of the next collective of `pool`: in the order buffer sizes are first
    seen, the same on every rank."""
    if len(pool) > limits().max_bucket_id:
        raise Sdp4bitError(f"more than {limits().max_bucket_id + 1} distinct FSDP {kind} "
                           "buffer sizes")
    return len(pool)


@dataclass
class UnitState:
    """One FSDP unit: its place among the model's units and its count of gradient syncs (the
    state a checkpoint keeps, :meth:`State.state_dict <sdp4bit.fsdp.State.state_dict>`)."""

    label: str
    index: int  # in module order, the same on every rank
    shared: Shared
    next_sync: int  # the gradient sync this unit runs next, the same on every rank
    param_reported_at: int = -1  # the last step whose all-gather telemetry was reported
    # The step of the reduce-scatter the all-reduce hook follows, until the hook takes it
    # (None: FSDP skipped the reduce-scatter, a shard group of one rank).
    reduced_at: int | None = None
    # Tensor parallelism: the shard's TP-replicated elements, which travel exact.
    exact: ExactRanges | None = None

    @property
    def step(self) -> int:
        """The gradient sync this unit runs next (counted from ``enable``'s ``first_step``,
        or from a checkpoint's); a gather brings the weights this sync's gradients are
        computed at."""
        return self.next_sync

    @property
    def whole_exact(self) -> bool:
        """Every parameter of the unit is TP-replicated: FSDP's own collectives run."""
        return self.exact is not None and self.exact.whole

    def stream_step(self, step: int) -> int:
        """The step the core numbers its random streams by for this unit at `step`. Units of
        one buffer size share a collective (so the core's buffers exist once per size, not
        once per unit), hence its bucket id: the unit's index is folded into the step, which
        keeps every (unit, step) on streams of its own (the core keeps its low 32 bits,
        docs/numerics.md §2.1)."""
        return step * self.shared.units + self.index

    def check_group(self, group: dist.ProcessGroup) -> None:
        """Refuses a collective over another group than the unit's shard group (fully_shard's
        reshard_after_forward=<int> re-gathers over a smaller one)."""
        groups = self.shared.groups
        if group is groups.dp_group:
            return
        ranks = dist.get_process_group_ranks(group)
        if ranks != groups.global_ranks:
            raise Sdp4bitError(
                f"{self.label} ran a collective over ranks {ranks}, not over its shard "
                f"group {groups.global_ranks} that sdp4bit set up for (fully_shard's "
                "reshard_after_forward=<int> re-gathers over a smaller group; use True or False)")


def _empty(size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


def _uncompressed_bytes(shard: torch.Tensor, world: int) -> int:
    """What FSDP's own collective sends from this rank for a shard like `shard`: the shard to
    each of the other ranks."""
    return (world - 1) * shard.numel() * shard.element_size()


def _divisor(op, world: int, unit: Unit) -> float:
    """What the sum is divided by for FSDP's reduce op: W for AVG, 1 for SUM, the unit's
    divide factor f for PREMUL_SUM (``set_gradient_divide_factor(f)`` without force-sum:
    FSDP asks for the sum of every rank's gradients times 1/f, and the op holds 1/f where
    Python cannot read it); any other op is refused."""
    # A plain op (AVG, SUM) is a RedOpType; a PREMUL_SUM comes as a ReduceOp holding one.
    kind = op if isinstance(op, dist.ReduceOp.RedOpType) else op.op
    if kind == dist.ReduceOp.AVG:
        return world
    if kind == dist.ReduceOp.SUM:
        return 1
    factor = unit.gradient_divide_factor() if kind == dist.ReduceOp.PREMUL_SUM else None
    if factor is None:
        raise Sdp4bitError(f"{unit.label} reduce-scatters with {kind.name}; sdp4bit's "
                           "gradient codecs serve AVG, SUM and the PREMUL_SUM of "
                           "set_gradient_divide_factor")
    return factor


class UnitReduceScatter(ReduceScatter):
    """The unit's gradient reduce-scatter with the gradient codec (FSDP's own before
    ``grad_quant_start_step`` and with ``grad_codec=none``, counted either way)."""

    def __init__(self, state: UnitState, unit: Unit) -> None:
        self.state, self.unit = state, unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False):
        state, shared = self.state, self.state.shared
        state.check_group(group)
        world = shared.groups.size
        step = state.step
        state.reduced_at = step
        state.next_sync += 1
        uncompressed = _uncompressed_bytes(output_tensor, world)
        if not shared.config.compresses_grads or state.whole_exact:
            shared.wire.add(uncompressed, uncompressed)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        # Refused from the first step, also while quantization has not started yet.
        divisor = _divisor(op, world, self.unit)
        dtype = input_tensor.dtype
        if dtype != torch.float32 and dtype not in _STAGED_REDUCE_DTYPES:
            raise Sdp4bitError(f"{state.label} reduces gradients in {dtype}; the "
                               "gradient codecs take float32, bfloat16 or float16 (set "
                               "MixedPrecisionPolicy(reduce_dtype=torch.float32))")
        if step < shared.quant_start:
            shared.wire.add(uncompressed, uncompressed)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        rs = shared.reduce_scatter(input_tensor.numel(), input_tensor.device)
        stream_step = state.stream_step(step)
        exact = None
        if shared.telemetry.due(step):
            exact = torch.empty_like(output_tensor)
            dist.reduce_scatter_tensor(exact, input_tensor, op=op, group=group)
        if dtype == torch.float32:
            bucket, shard = input_tensor, output_tensor
        else:  # the codecs read and write fp32: a 16-bit buffer goes through fp32 copies
            bucket = input_tensor.float()
            shard = torch.empty(output_tensor.shape, dtype=torch.float32,
                                device=output_tensor.device)
        rs.start(bucket, shard, stream_step).wait()
        if divisor != 1:
            shard.div_(divisor)
        if shard is not output_tensor:
            output_tensor.copy_(shard)
        sent = rs.wire_bytes(stream_step).total
        if state.exact is not None:
            sent += state.exact.reduce_scatter(output_tensor, input_tensor, group, divisor)
        shared.wire.add(sent, uncompressed)
        if exact is not None:
            shared.telemetry.report("grad", step, shared.units_with_grads, sent, uncompressed,
                                    ErrorStats.of([output_tensor], [exact]))
        return None


class UnitAllReduceHook:
    """FSDP's all-reduce hook of a unit sharded over the shard dimension of a 2-D mesh, run
    after the unit's reduce-scatter (on FSDP's all-reduce stream, or in line on the CPU). It
    does what native HSDP does after its reduce-scatter, so the gradients are native HSDP's:

    - sums the reduced shard over the replicate dimension (every replica then holds the same
      bits);
    - divides by the replicate size R only where no divide factor is set: FSDP then divides
      a unit sharded over S ranks by S, native HSDP by R x S; with
      ``set_gradient_divide_factor(f)`` both divide by f (AVG or PREMUL_SUM, or after a
      forced SUM);
    - while ``set_requires_all_reduce(False)`` holds, keeps the reduced shard (summed over
      such micro-steps) instead, as native HSDP does, and adds it to the shard of the next
      micro-step that all-reduces. FSDP accumulates the hook's output into the gradients, so
      the shard it is given back on the skipped micro-steps is zeros.
    """

    def __init__(self, state: UnitState, unit: Unit) -> None:
        self.state, self.unit = state, unit
        self.kept: torch.Tensor | None = None  # the reduced shards of skipped micro-steps

    def __call__(self, reduce_output: torch.Tensor) -> None:
        state = self.state
        step, state.reduced_at = state.reduced_at, None
        if step is None:  # no reduce-scatter ran (one rank a shard): this is the sync
            step = state.step
            state.next_sync += 1
        if not self.unit.requires_all_reduce():
            if self.kept is None:
                self.kept = reduce_output.clone()
            else:
                self.kept += reduce_output
            reduce_output.zero_()
            return
        if self.kept is not None:
            reduce_output += self.kept
            self.kept = None
        self._all_reduce(reduce_output, step)
        if self.unit.gradient_divide_factor() is None:
            reduce_output.div_(state.shared.across.size)

    def _all_reduce(self, reduce_output: torch.Tensor, step: int) -> None:
        """Sums `reduce_output` over the replicate dimension: Global-QSGD's integers from
        ``grad_quant_start_step`` on, else (and with ``cross_group_bits=exact``) fp32."""
        state, shared = self.state, self.state.shared
        across = shared.across
        numel = reduce_output.numel()
        ring = ring_all_reduce_bytes(numel, across.size)
        if across.groups is None or step < shared.quant_start:
            dist.all_reduce(reduce_output, group=across.group)
            shared.wire.add(ring, ring)
            return
        data = cross_group_buffer(reduce_output, across.size)
        reduce = across.all_reduce(data.numel(), shared.config, data.device)
        reduce.start(data, state.stream_step(step)).wait()
        if data is not reduce_output:
            reduce_output.copy_(data[:numel].view_as(reduce_output))
        shared.wire.add(reduce.wire_bytes(), ring)


class UnitAllGather(AllGather):
    """The unit's parameter all-gather with the weight codec (FSDP's own with
    ``weight_codec=none``, counted). Every rank, the owner included, ends with the decoded
    bytes of every shard: the same bytes on every rank; the sharded parameters the optimizer
    updates stay exact with their owner."""

    def __init__(self, state: UnitState) -> None:
        self.state = state

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False):
        state, shared = self.state, self.state.shared
        state.check_group(group)
        groups = shared.groups
        uncompressed = _uncompressed_bytes(input_tensor, groups.size)
        if not shared.config.compresses_weights or state.whole_exact:
            shared.wire.add(uncompressed, uncompressed)
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        _check_gather_dtype(output_tensor.dtype, state.label)
        shard = input_tensor.numel()
        if output_tensor.numel() != groups.size * shard:
            raise Sdp4bitError(f"{state.label} all-gathers {shard} elements per rank "
                               f"into {output_tensor.numel()}, not {groups.size} x {shard}")
        mine = output_tensor[groups.rank * shard:(groups.rank + 1) * shard]
        if mine.data_ptr() != input_tensor.data_ptr():
            mine.copy_(input_tensor)
        ag = shared.all_gather(output_tensor)
        step = state.step
        exact = None
        if shared.telemetry.due(step) and state.param_reported_at != step:
            exact = torch.empty_like(output_tensor)
            dist.all_gather_into_tensor(exact, mine.clone(), group=group)
        own = state.exact.take(mine) if state.exact is not None else None
        ag.start(output_tensor, state.stream_step(step)).wait()
        sent = ag.wire_bytes().total
        if own is not None:
            sent += state.exact.all_gather(output_tensor, own, group)
        shared.wire.add(sent, uncompressed)
        if exact is not None:
            state.param_reported_at = step
            shared.telemetry.report("param", step, shared.units, sent, uncompressed,
                                    ErrorStats.of([output_tensor], [exact]))
        return None


def _check_gather_dtype(dtype: torch.dtype, label: str) -> None:
    """The weight codecs quantize bf16 values; FSDP gathers raw bytes (uint8) when a unit's
    parameters are of several dtypes or bring their own all-gather (e.g. float8)."""
    if dtype == torch.uint8:
        raise Sdp4bitError(
            f"{label} all-gathers raw bytes (parameters of several dtypes, or "
            "tensor subclasses with their own all-gather such as float8); the weight codecs "
            "quantize bf16 parameters: give the unit one parameter dtype, or set "
            "weight_codec=none")
    require_bf16([dtype], f"{label} all-gathers its parameters as",
                 "set fully_shard(..., mp_policy=MixedPrecisionPolicy("
                 "param_dtype=torch.bfloat16))")
