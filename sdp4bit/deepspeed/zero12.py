"""ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``).

Gradients are reduced bucket by bucket during the backward pass, when DeepSpeed reduces them
(stage 2: every micro-step; stage 1: at the accumulation boundary). Each parameter group's
flat buffer is cut into buckets of at most ``reduce_bucket_size`` elements in backward order
(:mod:`.bucket_layout`); a bucket's gradients are gathered into a buffer of DeepSpeed's
accumulation dtype (the optimizer's ``gradient_accumulation_dtype``: bf16 for a bf16 model
unless ``data_types.grad_accum_dtype`` says fp32; fp32 for fp16, which the codecs do not take)
and reduce-scattered with the gradient codec as soon as its last gradient arrives: with
``overlap_comm`` while the backward pass goes on (two buckets in flight at most, as DeepSpeed's
double-buffered IPG buckets), without it before the next gradient is taken. Each rank adds its
shard of every bucket into a store of its shards (1/W of the group); at the accumulation
boundary one all-to-all of exact values moves the shards' pieces to the ZeRO partitions they
belong to, which the step reads as DeepSpeed's flat gradient partitions. Beyond DeepSpeed's own
buffers a rank holds the store (1/W of the group, from a step's first reduction to its
boundary), up to three bucket buffers, and at the boundary the received pieces (1/W).

After the step the flat parameter buffer is all-gathered with the weight codec (qWD included:
every replica keeps the previous weights in that buffer). All-gathers outside the step
(checkpoint loading) stay exact and restart the weight codec from the gathered values.

qWD's references (each rank's own shard as every replica held it after the last all-gather)
must equal what the other replicas hold. Weights written outside the step break that: a
checkpoint load re-establishes them from the loaded weights (:func:`restore`); any other write
PyTorch counts (``load_state_dict``, in-place ops on the parameters or the flat buffer) is
seen before the next compressed all-gather, which then runs exact, on every rank, and sets the
references up again from its result.

With reentrant activation checkpointing DeepSpeed may run the backward epilogue once per
phase of one backward pass; each phase's reduction adds into the partitions the earlier phases
of that pass handed over (:func:`_hand_over`).
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._patching import Patches
from ..collectives import GradReduceScatter, WeightAllGather
from ..config import limits
from ..errors import Sdp4bitError
from ..groups import ProcessGroups
from ..integration import WireCounter, local_shard, log_route_notice, require_bf16
from ..replicas import check_replicas_identical
from .bucket_layout import BucketSpan, Run, plan_buckets, runs_between
from .section import Settings

logger = logging.getLogger("sdp4bit")
_PATCHES = Patches()
# The ZeRO optimizer whose step() is running (its all-gather of updated weights is compressed).
_STEPPING: contextvars.ContextVar = contextvars.ContextVar("sdp4bit_stepping", default=None)
# Attached optimizers, for the all-gathers DeepSpeed runs outside a step.
_ATTACHED: weakref.WeakSet = weakref.WeakSet()
# Buckets reduce-scattering at once with overlap_comm (DeepSpeed's two IPG buffers).
_IN_FLIGHT = 2


@dataclass
class _Bucket:
    """One gradient bucket: where it lies, its compressed reduce-scatter, where its shard's
    sums are kept in the group's store, and the reduction under way."""

    span: BucketSpan
    reduce_scatter: GradReduceScatter
    stored: slice  # this rank's shard (padding left out) in the group's store
    holds_sums: bool = False  # its part of the store holds reductions not yet handed on
    buffer: torch.Tensor | None = None  # this reduction's gradients, until it completes
    arrived: set = field(default_factory=set)  # ids of the parameters gathered into `buffer`
    started: bool = False  # reduce-scattering in this reduction


@dataclass
class _GroupState:
    """One parameter group's buckets, the all-to-all that moves their shards into the ZeRO
    partition, and its weight all-gather."""

    buckets: list[_Bucket]  # in backward order
    slot: dict[int, tuple[_Bucket, int]]  # id(param) -> its bucket, offset in the bucket
    partition_size: int
    store_size: int  # elements of this rank's shards of all buckets
    sends: list[int]  # elements of the store each rank's partition holds, in rank order
    receives: list[list[Run]]  # per source rank, its pieces of this rank's partition
    device: torch.device
    store: torch.Tensor | None = None  # the shards' sums, in ascending flat order


@dataclass
class State:
    """sdp4bit's state on an attached stage 1/2 optimizer (``optimizer._sdp4bit``)."""

    settings: Settings
    groups: ProcessGroups
    per_group: list[_GroupState]
    dtype: torch.dtype  # the accumulation dtype
    overlap: bool  # DeepSpeed's overlap_comm
    reductions: int = 0  # backward passes whose gradients were reduced (the codec's step)
    weight_step: int = 0  # compressed all-gathers of the run (the weight codec's step)
    in_flight: deque = field(default_factory=deque)  # (bucket, handle), oldest first
    weight_gathers: list[WeightAllGather] = field(default_factory=list)  # one per group
    wire: WireCounter = field(default_factory=WireCounter)
    weight_versions: tuple = ()  # the weights' version counters when the references were set
    resyncs: int = 0  # all-gathers run exact because weights were written outside the step


def attach(optimizer, settings: Settings) -> None:
    """Routes a stage 1/2 optimizer's gradient reduction and post-step all-gather through
    sdp4bit. Collective: every DP rank calls it."""
    problems = [name for name, present in (
        ("CPU offload", optimizer.cpu_offload),
        ("zero_optimization.parameter_alignment (it pads parameters inside the flat buffer, so "
         "DeepSpeed's gradient partitions are no longer the buffer's contiguous ranges that "
         "sdp4bit hands over)",
         any(any(padding) for padding in getattr(optimizer, "round_robin_bit16_padding", []))),
        ("MoE layers", optimizer.has_moe_layers),
        ("ZenFlow", getattr(optimizer, "zenflow", False)),
        ("hierarchical partitioning (a DP group per parameter group differing from the DP "
         "group)", any(g is not optimizer.dp_process_group
                       for g in optimizer.real_dp_process_group)),
    ) if present]
    if problems:
        raise Sdp4bitError(f"sdp4bit does not handle {', '.join(problems)} in ZeRO stage 1/2; "
                           "turn it off or use the baseline preset")
    config = settings.config
    flats = optimizer.bit16_groups_flat
    if config.compresses_weights:
        require_bf16((flat.dtype for flat in flats), "this model's flat parameter groups are",
                     'enable "bf16" in the DeepSpeed config')
    _install()
    groups = ProcessGroups.create(optimizer.dp_process_group, settings.ranks_per_node)
    dtype = _accumulation_dtype(optimizer)
    per_group = []
    if config.compresses_grads:
        bucket_ids = iter(range(limits().max_bucket_id + 1))
        per_group = [_group_state(optimizer, i, groups, config, dtype, bucket_ids)
                     for i in range(len(flats))]
    log_route_notice("ZeRO stage 1/2 gradient buckets",
                     [b.reduce_scatter for g in per_group for b in g.buckets])
    optimizer._sdp4bit = State(settings, groups, per_group, dtype, bool(optimizer.overlap_comm))
    if config.compresses_weights:
        set_up_weights(optimizer)
    _ATTACHED.add(optimizer)


def _group_state(optimizer, i: int, groups: ProcessGroups, config, dtype: torch.dtype,
                 bucket_ids) -> _GroupState:
    """Plans group `i`'s buckets and sets up their reduce-scatters (collective)."""
    flat, params = optimizer.bit16_groups_flat[i], optimizer.bit16_groups[i]
    rank, world = groups.rank, groups.size
    partition_size = optimizer.partition_size[i]
    if partition_size * world != flat.numel():
        raise Sdp4bitError(f"parameter group {i}: DeepSpeed's partitions ({world} x "
                           f"{partition_size}) do not tile its flat buffer of {flat.numel()} "
                           "elements")
    offsets = [(p.data_ptr() - flat.data_ptr()) // flat.element_size() for p in params]
    spans = plan_buckets([(o, p.numel()) for o, p in zip(offsets, params)], flat.numel(),
                         optimizer.reduce_bucket_size, world)
    buckets, slot, stored = [], {}, 0
    for span in spans:
        bucket_id = next(bucket_ids, None)
        if bucket_id is None:
            raise Sdp4bitError(
                f"ZeRO stage 1/2 needs more gradient buckets than the core's "
                f"{limits().max_bucket_id + 1} bucket ids; raise zero_optimization."
                f"reduce_bucket_size (now {optimizer.reduce_bucket_size})")
        buckets.append(_Bucket(span, GradReduceScatter(groups, config, span.padded, bucket_id,
                                                       device=flat.device), slice(0)))
        for k in span.params:
            slot[id(params[k])] = (buckets[-1], offsets[k] - span.lo)
    # The store holds this rank's shards in ascending flat order: then the pieces for each
    # partition follow one another in rank order, so the store is the all-to-all's input.
    for bucket in sorted(buckets, key=lambda b: b.span.lo):
        start, end = bucket.span.shard(rank, world)
        bucket.stored = slice(stored, stored + end - start)
        stored += end - start
    sends = [sum(run.length for run in runs_between(spans, world, partition_size, rank, dest))
             for dest in range(world)]
    return _GroupState(buckets, slot, partition_size, stored, sends,
                       [runs_between(spans, world, partition_size, source, rank)
                        for source in range(world)], flat.device)


def _accumulation_dtype(optimizer) -> torch.dtype:
    """The dtype gradients accumulate in: DeepSpeed's own (``gradient_accumulation_dtype``)
    where the gradient collective takes it (bf16, fp32), else fp32."""
    dtype = getattr(optimizer, "gradient_accumulation_dtype", torch.float32)
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


def detach(optimizer) -> None:
    """Forgets `optimizer` (its state is already removed by the caller)."""
    _ATTACHED.discard(optimizer)


def set_up_weights(optimizer) -> None:
    """(Re)builds the weight all-gathers from the flat buffers as every replica holds them
    (raises :class:`Sdp4bitError` on every rank if the replicas differ). The weight step goes
    on: each all-gather of the run draws its own rounding. Collective."""
    state = optimizer._sdp4bit
    check_replicas_identical(list(optimizer.bit16_groups_flat), optimizer.dp_process_group)
    state.weight_gathers = [WeightAllGather(state.groups, state.settings.config, flat,
                                            bucket_id=i)
                            for i, flat in enumerate(optimizer.bit16_groups_flat)]
    state.weight_versions = _weight_versions(optimizer)


def _weight_versions(optimizer) -> tuple:
    """The version counters of every parameter and flat buffer of `optimizer`: PyTorch bumps
    them on every in-place write through them (``load_state_dict``, ``copy_``, ``mul_`` under
    ``no_grad``), not on writes through ``.data`` (DeepSpeed's step, sdp4bit's all-gather)."""
    return (tuple(flat._version for flat in optimizer.bit16_groups_flat)
            + tuple(p._version for group in optimizer.bit16_groups for p in group))


def _written_outside_step(optimizer, state: State) -> bool:
    """Whether any DP rank's weights were written since the references were set, agreed by
    all ranks (so that all take the same path) in host memory over the groups' gloo group, with
    no wait for the device. Only qWD keeps references."""
    if not state.settings.config.resolved.keeps_reference:
        return False
    written = torch.tensor([int(_weight_versions(optimizer) != state.weight_versions)])
    dist.all_reduce(written, op=dist.ReduceOp.MAX, group=state.groups.host_group())
    return bool(written.item())


def checkpoint_state(state: State) -> dict:
    """What a checkpoint keeps: the codecs' steps (their rounding streams and
    ``grad_quant_start_step`` follow them). The references are not saved: they are each
    rank's shard of the weights the checkpoint holds, re-established at load."""
    return {"stage": "1/2", "reductions": state.reductions, "weight_step": state.weight_step}


def restore(optimizer, state: State, saved: dict | None) -> None:
    """After DeepSpeed loaded a checkpoint (weights first): the saved steps, and the
    references set up again from the loaded weights. Collective."""
    if saved is not None:
        if saved.get("stage") != "1/2":
            raise Sdp4bitError(f"this checkpoint holds sdp4bit's ZeRO stage {saved.get('stage')} "
                               "state; the engine loading it runs ZeRO stage 1/2")
        state.reductions, state.weight_step = saved["reductions"], saved["weight_step"]
    if state.settings.config.compresses_weights:
        set_up_weights(optimizer)


def _install() -> None:
    from deepspeed.runtime.zero import stage_1_and_2

    cls = stage_1_and_2.DeepSpeedZeroOptimizer
    if _PATCHES.installed("step"):
        return
    _PATCHES.install(cls, "reduce_independent_p_g_buckets_and_remove_grads", _take_gradient)
    _PATCHES.install(cls, "independent_gradient_partition_epilogue", _epilogue)
    _PATCHES.install(cls, "setup_buckets", _setup_buckets)
    _PATCHES.install(cls, "step", _step)
    _PATCHES.install(stage_1_and_2, "all_gather_dp_groups", _all_gather_dp_groups)


def _grads_state(optimizer) -> State | None:
    state = getattr(optimizer, "_sdp4bit", None)
    return state if isinstance(state, State) and state.settings.config.compresses_grads else None


def _setup_buckets(self):
    """DeepSpeed's set-up for a backward pass, less its IPG buffers (``reduce_bucket_size``
    elements, two with overlap_comm), which sdp4bit's buckets replace."""
    _PATCHES.original("setup_buckets")(self)
    if _grads_state(self) is not None:
        for bucket in self.ipg_buckets.values():
            bucket.buffer.clear()


def _take_gradient(self, param, i):
    """Instead of DeepSpeed's IPG bucket: copies `param`'s gradient into its bucket's buffer,
    frees it, and starts the bucket's reduce-scatter once its last gradient is in."""
    state = _grads_state(self)
    if state is None:
        return _PATCHES.original("reduce_independent_p_g_buckets_and_remove_grads")(self, param, i)
    if param.numel() == 0 or not getattr(param, "ds_grad_is_ready", True):
        return None
    grad = self.get_gradient_for_reduction(param)
    if grad is None:
        return None
    bucket, offset = state.per_group[i].slot[id(param)]
    if bucket.started or id(param) in bucket.arrived:
        raise Sdp4bitError(
            f"a gradient of parameter group {i} (shape {tuple(param.shape)}) arrived twice in "
            "one backward pass; DeepSpeed's ZeRO 1/2 reduces each gradient once per pass, and "
            "so does sdp4bit")
    if bucket.buffer is None:
        bucket.buffer = torch.zeros(bucket.span.padded, dtype=state.dtype, device=grad.device)
    with torch.no_grad():
        bucket.buffer[offset:offset + param.numel()].copy_(grad.detach().reshape(-1))
    bucket.arrived.add(id(param))
    self.clear_grad_attribute(param)
    param.grad = None
    if len(bucket.arrived) == len(bucket.span.params):
        _start(self, state, state.per_group[i], bucket)
    return None


def _start(optimizer, state: State, group: _GroupState, bucket: _Bucket) -> None:
    """Starts `bucket`'s reduce-scatter (of zeros where no gradient arrived); without
    overlap_comm waits for it at once, with it first waits for the oldest of two in flight."""
    if bucket.buffer is None:
        bucket.buffer = torch.zeros(bucket.span.padded, dtype=state.dtype,
                                    device=group.device)
    if optimizer.gradient_average:
        bucket.buffer.div_(state.groups.size / float(optimizer.sequence_parallel_size))
    while state.overlap and len(state.in_flight) >= _IN_FLIGHT:
        _complete_oldest(state)
    shard = local_shard(bucket.buffer, state.groups.rank, state.groups.size)
    handle = bucket.reduce_scatter.start(bucket.buffer, shard, state.reductions)
    bucket.started = True
    state.in_flight.append((group, bucket, handle))
    if not state.overlap:
        _complete_oldest(state)


def _complete_oldest(state: State) -> None:
    """Waits for the oldest bucket in flight and adds its shard into the group's store (every
    bucket is reduced in every reduction, so the first one of a step writes each place)."""
    group, bucket, handle = state.in_flight.popleft()
    handle.wait()
    state.wire.add_grad(bucket.reduce_scatter, state.reductions)
    if group.store is None:
        group.store = torch.empty(group.store_size, dtype=state.dtype, device=group.device)
    shard = local_shard(bucket.buffer, state.groups.rank, state.groups.size)
    summed = shard[:bucket.stored.stop - bucket.stored.start]
    if bucket.holds_sums:
        group.store[bucket.stored].add_(summed)
    else:
        group.store[bucket.stored].copy_(summed)
        bucket.holds_sums = True
    bucket.buffer = None


def _epilogue(self):
    """After a backward pass that reduced gradients: reduce-scatters the buckets still waiting
    (whose gradients did not all arrive), completes every reduction, and at the accumulation
    boundary moves the summed shards into this rank's ZeRO partitions, which the step reads
    as DeepSpeed's flat gradient partitions."""
    state = _grads_state(self)
    if state is None:
        return _PATCHES.original("independent_gradient_partition_epilogue")(self)
    # DeepSpeed's flag, set at the end of an epilogue and cleared by the next forward: set
    # here, an earlier phase of this backward pass (reentrant checkpointing) already ran one.
    later_phase = bool(self._epilogue_ran_this_backward)
    buckets = [b for g in state.per_group for b in g.buckets]
    if any(b.started or b.arrived for b in buckets):
        for group in state.per_group:
            for bucket in group.buckets:
                if not bucket.started:
                    _start(self, state, group, bucket)
        while state.in_flight:
            _complete_oldest(state)
        for bucket in buckets:
            bucket.started = False
            bucket.arrived.clear()
        state.reductions += 1
    if self.is_gradient_accumulation_boundary() and any(g.store is not None
                                                         for g in state.per_group):
        from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

        for i, group_state in enumerate(state.per_group):
            partition = _to_partition(self, state, group_state)
            earlier = _hand_over(self, i, partition, later_phase)
            if earlier is None:
                self.averaged_gradients[i] = GradPartitionBufferGroup(
                    _partition_views(partition, self.params_in_partition[i],
                                     self.first_offset[i]), partition)
    for i in range(len(self.params_already_reduced)):
        self.params_already_reduced[i] = False
    self._release_ipg_buffers()  # as DeepSpeed's epilogue: the next backward sets up again
    self._clear_param_grad_only()
    self._epilogue_ran_this_backward = True


def _to_partition(optimizer, state: State, group: _GroupState) -> torch.Tensor:
    """This rank's ZeRO partition of the summed gradients: every rank sends each piece of its
    store to the partition holding it (one all-to-all, exact values) and the receiver places
    the pieces. The store is released; the next reduction starts a new one."""
    rank, size = state.groups.rank, group.store.element_size()
    receive_sizes = [sum(run.length for run in runs) for runs in group.receives]
    received = torch.empty(sum(receive_sizes), dtype=state.dtype, device=group.device)
    dist.all_to_all_single(received.view(torch.uint8), group.store.view(torch.uint8),
                           [n * size for n in receive_sizes], [n * size for n in group.sends],
                           group=optimizer.dp_process_group)
    state.wire.add_exact((group.store_size - group.sends[rank]) * size)
    group.store = None
    for bucket in group.buckets:
        bucket.holds_sums = False
    partition = torch.empty(group.partition_size, dtype=state.dtype, device=group.device)
    first, at = rank * group.partition_size, 0
    for runs in group.receives:
        for run in runs:
            partition[run.start - first:run.start - first + run.length].copy_(
                received[at:at + run.length])
            at += run.length
    return partition


def _hand_over(optimizer, i: int, partition: torch.Tensor, later_phase: bool):
    """In a later phase of a backward pass, adds `partition` (this phase's sums) into the
    partition of group `i` an earlier phase handed over, and returns that one; else None (the
    caller hands `partition` over)."""
    earlier = optimizer.averaged_gradients.get(i) if later_phase else None
    if earlier is None:
        return None
    earlier.flat_partition.add_(partition)
    return earlier


def _partition_views(partition: torch.Tensor, params, first_offset: int) -> list[torch.Tensor]:
    """Views of `partition` (a flat ZeRO gradient partition) per parameter in it, the first
    starting `first_offset` elements into its parameter, then the padding (marked as such),
    the layout DeepSpeed's norm and overflow checks read."""
    views, current = [], 0
    for k, param in enumerate(params):
        start = first_offset if k == 0 else 0
        count = min(param.numel() - start, partition.numel() - current)
        view = partition.narrow(0, current, count)
        if start == 0 and count == param.numel():
            view = view.view(param.shape)
        views.append(view)
        current += count
    if current < partition.numel():
        pad = partition.narrow(0, current, partition.numel() - current)
        pad._zero_padding = True
        views.append(pad)
    return views


def _step(self, closure=None):
    token = _STEPPING.set(self)
    try:
        return _PATCHES.original("step")(self, closure)
    finally:
        _STEPPING.reset(token)


def _all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group,
                          start_alignment_factor, allgather_bucket_size):
    """The all-gather of updated weights: compressed inside an attached optimizer's step,
    unless the weights were written outside the step; elsewhere (checkpoint loading) and then
    DeepSpeed's exact one, after which the weight codec sets up again from the gathered
    values (collective, like the all-gather itself)."""
    stepping = _STEPPING.get()
    state = getattr(stepping, "_sdp4bit", None)
    compressed = (isinstance(state, State) and state.settings.config.compresses_weights
                  and groups_flat is stepping.bit16_groups_flat)
    if compressed and _written_outside_step(stepping, state):
        compressed = False
        state.resyncs += 1
        logger.warning("sdp4bit: the weights were written outside the optimizer step (e.g. "
                       "load_state_dict); this all-gather runs exact on every rank and qWD "
                       "restarts from its result")
    if compressed:
        handles = [ag.start(flat, state.weight_step)
                   for ag, flat in zip(state.weight_gathers, groups_flat)]
        for ag, handle in zip(state.weight_gathers, handles):
            handle.wait()
            state.wire.add_weight(ag)
        state.weight_step += 1
        return None
    result = _PATCHES.original("all_gather_dp_groups")(groups_flat, partitioned_param_groups,
                                               dp_process_group, start_alignment_factor,
                                               allgather_bucket_size)
    for optimizer in list(_ATTACHED):
        if (optimizer.bit16_groups_flat is groups_flat
                and optimizer._sdp4bit.settings.config.compresses_weights):
            set_up_weights(optimizer)  # qWD restarts from these exact values
    return result
