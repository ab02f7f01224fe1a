"""ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``).

Each parameter group's gradients are accumulated, over the micro-steps of a step, in a
buffer laid out like the group's flat bf16 parameter buffer, of DeepSpeed's own accumulation
dtype (the optimizer's ``gradient_accumulation_dtype``: the config's
``data_types.grad_accum_dtype``, by default the model's dtype, so bf16 for a bf16 model; fp32
for an fp16 model, which the collective does not take), and reduce-scattered with the
gradient codec at the gradient-accumulation boundary (a bf16 buffer straight from bf16,
docs/numerics.md §7.5), so each rank receives exactly its ZeRO partition, in that dtype as
DeepSpeed's own is (which the optimizer step then reads as DeepSpeed's flat gradient
partition).
After the step the flat parameter buffer is all-gathered with the weight codec (qWD included:
every replica keeps the previous weights in that buffer). All-gathers outside the step
(checkpoint loading) stay exact and restart the weight codec from the gathered values.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field

import torch

from .._patching import Patches
from ..collectives import GradReduceScatter, WeightAllGather
from ..errors import Sdp4bitError
from ..groups import ProcessGroups
from ..integration import WireCounter, local_shard, log_route_notice, require_bf16
from ..replicas import check_replicas_identical
from .section import Settings

_PATCHES = Patches()
# The ZeRO optimizer whose step() is running (its all-gather of updated weights is compressed).
_STEPPING: contextvars.ContextVar = contextvars.ContextVar("sdp4bit_stepping", default=None)
# Attached optimizers, for the all-gathers DeepSpeed runs outside a step.
_ATTACHED: weakref.WeakSet = weakref.WeakSet()


@dataclass
class _GroupState:
    """One parameter group's buffers and compressed collectives."""

    grads: torch.Tensor | None  # the layout of the group's flat bf16 buffer, accumulation dtype
    offsets: dict[int, int]  # id(param) -> element offset in the flat buffer
    reduce_scatter: GradReduceScatter | None
    all_gather: WeightAllGather | None = None  # with a weight codec, after set-up


@dataclass
class State:
    """sdp4bit's state on an attached stage 1/2 optimizer (``optimizer._sdp4bit``)."""

    settings: Settings
    groups: ProcessGroups
    per_group: list[_GroupState]
    grad_step: int = 0  # gradient reductions so far
    weight_step: int = 0  # compressed all-gathers since the weight codec set up
    pending: bool = False  # gradients accumulated since the last reduction
    wire: WireCounter = field(default_factory=WireCounter)


def attach(optimizer, settings: Settings) -> None:
    """Routes a stage 1/2 optimizer's gradient reduction and post-step all-gather through
    sdp4bit. Collective: every DP rank calls it."""
    problems = [name for name, present in (
        ("CPU offload", optimizer.cpu_offload),
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
    per_group = []
    for i, flat in enumerate(flats):
        offsets = {id(p): (p.data_ptr() - flat.data_ptr()) // flat.element_size()
                   for p in optimizer.bit16_groups[i]}
        grads = rs = None
        if config.compresses_grads:
            grads = torch.zeros(flat.numel(), dtype=_accumulation_dtype(optimizer),
                                device=flat.device)
            rs = GradReduceScatter(groups, config, flat.numel(), bucket_id=i, device=flat.device)
        per_group.append(_GroupState(grads, offsets, rs))
    log_route_notice("ZeRO stage 1/2 parameter groups",
                     [g.reduce_scatter for g in per_group if g.reduce_scatter is not None])
    optimizer._sdp4bit = State(settings, groups, per_group)
    if config.compresses_weights:
        _set_up_weights(optimizer)
    _ATTACHED.add(optimizer)


def _accumulation_dtype(optimizer) -> torch.dtype:
    """The dtype gradients accumulate in: DeepSpeed's own (``gradient_accumulation_dtype``)
    where the gradient collective takes it (bf16, fp32), else fp32."""
    dtype = getattr(optimizer, "gradient_accumulation_dtype", torch.float32)
    return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32


def detach(optimizer) -> None:
    """Forgets `optimizer` (its state is already removed by the caller)."""
    _ATTACHED.discard(optimizer)


def _set_up_weights(optimizer) -> None:
    """(Re)builds the weight all-gathers from the flat buffers as every replica holds them."""
    state = optimizer._sdp4bit
    check_replicas_identical(list(optimizer.bit16_groups_flat), optimizer.dp_process_group)
    for i, (flat, group_state) in enumerate(zip(optimizer.bit16_groups_flat, state.per_group)):
        group_state.all_gather = WeightAllGather(state.groups, state.settings.config, flat,
                                                 bucket_id=i)
    state.weight_step = 0


def _install() -> None:
    from deepspeed.runtime.zero import stage_1_and_2

    cls = stage_1_and_2.DeepSpeedZeroOptimizer
    if _PATCHES.installed("step"):
        return
    _PATCHES.install(cls, "reduce_independent_p_g_buckets_and_remove_grads", _accumulate)
    _PATCHES.install(cls, "independent_gradient_partition_epilogue", _epilogue)
    _PATCHES.install(cls, "step", _step)
    _PATCHES.install(stage_1_and_2, "all_gather_dp_groups", _all_gather_dp_groups)


def _grads_state(optimizer) -> State | None:
    state = getattr(optimizer, "_sdp4bit", None)
    return state if isinstance(state, State) and state.settings.config.compresses_grads else None


def _accumulate(self, param, i):
    """Instead of bucketing `param`'s gradient for DeepSpeed's reduction: adds it into the
    group's accumulation buffer at the parameter's place and frees it."""
    state = _grads_state(self)
    if state is None:
        return _PATCHES.original("reduce_independent_p_g_buckets_and_remove_grads")(self, param, i)
    if param.numel() == 0 or not getattr(param, "ds_grad_is_ready", True):
        return None
    grad = self.get_gradient_for_reduction(param)
    if grad is None:
        return None
    group_state = state.per_group[i]
    start = group_state.offsets[id(param)]
    with torch.no_grad():
        group_state.grads[start:start + param.numel()].add_(grad.detach().reshape(-1))
    self.clear_grad_attribute(param)
    param.grad = None
    state.pending = True
    return None


def _epilogue(self):
    """At the gradient-accumulation boundary: reduce-scatters every group's accumulated
    gradients with the gradient codec and hands this rank's partition to the step as
    DeepSpeed's flat gradient partition."""
    state = _grads_state(self)
    if state is None:
        return _PATCHES.original("independent_gradient_partition_epilogue")(self)
    from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

    if self.is_gradient_accumulation_boundary() and state.pending:
        rank, size = state.groups.rank, state.groups.size
        divisor = size / float(self.sequence_parallel_size) if self.gradient_average else 1.0
        handles = []
        for group_state in state.per_group:
            if divisor != 1.0:
                group_state.grads.div_(divisor)
            shard = local_shard(group_state.grads, rank, size)
            handles.append(group_state.reduce_scatter.start(group_state.grads, shard,
                                                            state.grad_step))
        for i, (group_state, handle) in enumerate(zip(state.per_group, handles)):
            handle.wait()
            state.wire.add_grad(group_state.reduce_scatter, state.grad_step)
            partition = local_shard(group_state.grads, rank, size).clone()
            group_state.grads.zero_()
            self.averaged_gradients[i] = GradPartitionBufferGroup(
                _partition_views(partition, self.params_in_partition[i], self.first_offset[i]),
                partition)
        state.grad_step += 1
        state.pending = False
    for i in range(len(self.params_already_reduced)):
        self.params_already_reduced[i] = False
    self._clear_param_grad_only()
    self._epilogue_ran_this_backward = True


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
    """The all-gather of updated weights: compressed inside an attached optimizer's step;
    elsewhere (checkpoint loading) DeepSpeed's exact one, after which the weight codec sets up
    again from the gathered values (collective, like the all-gather itself)."""
    stepping = _STEPPING.get()
    state = getattr(stepping, "_sdp4bit", None)
    if (isinstance(state, State) and state.settings.config.compresses_weights
            and groups_flat is stepping.bit16_groups_flat):
        handles = [g.all_gather.start(flat, state.weight_step)
                   for g, flat in zip(state.per_group, groups_flat)]
        for g, handle in zip(state.per_group, handles):
            handle.wait()
            state.wire.add_weight(g.all_gather)
        state.weight_step += 1
        return None
    result = _PATCHES.original("all_gather_dp_groups")(groups_flat, partitioned_param_groups,
                                               dp_process_group, start_alignment_factor,
                                               allgather_bucket_size)
    for optimizer in list(_ATTACHED):
        if (optimizer.bit16_groups_flat is groups_flat
                and optimizer._sdp4bit.settings.config.compresses_weights):
            _set_up_weights(optimizer)  # qWD restarts from these exact values
    return result
