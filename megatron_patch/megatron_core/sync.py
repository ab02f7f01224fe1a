"""The bucket group's syncs through sdp4bit: ``start_grad_sync`` (each bucket's compressed
reduce-scatter, the exact elements beside it, the all-reduce across instances),
``finish_grad_sync`` and ``start_param_sync`` (the compressed all-gather), each returning a
:class:`BucketGroupHandle` that Megatron's own finishing and overlap machinery waits on."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdp4bit import Handle, ProcessGroups
from sdp4bit.integration import WireCounter, local_shard
from sdp4bit.telemetry import ErrorStats

from .bucket_state import state as bucket_group_state
from .parallel import dp_group
from .patches import GROUP_PATCHES, PATCHES
from .settings import current


class BucketGroupHandle:
    """The compressed collectives of one bucket group; ``wait()`` completes all of them and
    then runs the group's finishing step (copying back bf16 gradients, averaging)."""

    def __init__(self, handles: list[Handle], finish=None) -> None:
        self._handles = handles
        self._finish = finish

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def _exact_reduce_scatter(data: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """Megatron's uncompressed reduce-scatter of `data` (for telemetry), into a new tensor."""
    out = torch.empty(data.numel() // groups.size, dtype=data.dtype, device=data.device)
    dist.reduce_scatter_tensor(out, data, group=dp_group(groups))
    return out


def _exact_all_gather(params: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """Every owner's current shard of `params`, all-gathered uncompressed (for telemetry)."""
    out = torch.empty_like(params)
    mine = local_shard(params, groups.rank, groups.size).clone()
    dist.all_gather_into_tensor(out, mine, group=dp_group(groups))
    return out


def _prepare_grads(self, force_all_reduce) -> None:
    """What megatron-core's start_grad_sync does before its reduction, for the versions this
    supports (0.16 to 0.19; the later steps are feature-detected): drain the predecessor
    bucket group (0.19), wait for CUDA-graph gradient events (0.19), copy extra main grads
    into the buffer (0.19), check the grads, scale them."""
    previous = getattr(self, "previous_grad_reduce_bucket_group", None)
    if previous is not None and previous.grad_reduce_handle is not None:
        previous.finish_grad_sync(force_all_reduce=force_all_reduce)
    assert self.grad_reduce_handle is None, (
        "Should not have multiple communication calls outstanding at once")
    events = {}
    for bucket in self.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None:
                events[id(event)] = event
    if events:
        stream = torch.cuda.current_stream()
        for event in events.values():
            stream.wait_event(event)
    for bucket in self.buckets:
        for param in getattr(bucket, "params_with_extra_main_grads", ()):
            copy_in = getattr(param, "main_grad_copy_in_grad_buffer", None)
            if copy_in is not None:
                copy_in.copy_(param.main_grad)
    cfg = self.ddp_config
    if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
        self.check_grads(
            check_for_nan_or_inf=cfg.check_for_nan_in_grad,
            check_for_large=cfg.check_for_large_grads,
        )
    with torch.no_grad():
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor


def start_grad_sync(self, force_all_reduce: bool | None = False):
    """_ParamAndGradBucketGroup.start_grad_sync through sdp4bit where it compresses."""
    if self.is_first_batch and self.grad_reduce_handle is not None:
        return  # already dispatched in the first batch (Megatron's own rule), nothing to count
    state = None if force_all_reduce else bucket_group_state(self)
    if state is not None:
        state.fresh = False
    if state is None or not state.compresses_grads_at(state.grad_step):
        if state is not None:
            state.grad_step += 1
        return PATCHES.original("start_grad_sync")(self, force_all_reduce)
    _prepare_grads(self, force_all_reduce)
    cfg = self.ddp_config
    rank, size = state.groups.rank, state.groups.size
    inside = dp_group(state.groups)
    step = state.grad_step
    telemetry = current().telemetry
    set_up = len(current().bucket_groups)  # bucket groups reporting each step
    reference = [] if telemetry.due(step) else None
    handles, pending = [], []
    for bucket, rs, exact in zip(self.buckets, state.grad, state.exact):
        # fp32 and bf16 buckets alike go straight in: a bf16 bucket is read as fp32 and its
        # shard rounded back to bf16 by the collective (docs/numerics.md §7.5).
        data = bucket.grad_data
        if reference is not None:
            # The reference sums the fp32 values, as the collective does.
            reference.append(_exact_reduce_scatter(data.float(), state.groups))
            if state.across is not None:
                dist.all_reduce(reference[-1], group=state.across.group)
        # Read before the collective overwrites this rank's shard of the bucket.
        pending.append(exact.start_grads(data, inside) if exact is not None else None)
        handles.append(rs.start(data, local_shard(data, rank, size), step))
    state.grad_step += 1

    def finish():
        shards = [local_shard(b.grad_data, rank, size) for b in self.buckets]
        exact_sums = pending
        if state.across is not None:
            # The exact sums inside the instance, summed across the instances, issued before
            # the shards' all-reduce across them and written after it.
            exact_sums = [exact.continue_grads(started, state.across.group)
                          if exact is not None else None
                          for exact, started in zip(state.exact, pending)]
            state.across.run(shards, step)
        for shard, exact, started in zip(shards, state.exact, exact_sums):
            if exact is not None:
                exact.finish_grads(started, shard)
        if reference is not None:
            wire = WireCounter()
            state.count_grads(wire, step)
            telemetry.report("grad", step, set_up, wire.sent, wire.uncompressed,
                             ErrorStats.of(shards, reference), exact=wire.exact)
        if cfg.average_in_collective:
            instances = state.across.size if state.across is not None else 1
            for shard in shards:
                shard.div_(size * instances)

    handle = BucketGroupHandle(handles, finish)
    if cfg.overlap_grad_reduce:
        self.grad_reduce_handle = handle
    else:
        handle.wait()
        self.grad_reduce_handle = None


def finish_grad_sync(self, force_all_reduce: bool | None = False):
    """megatron-core's finish_grad_sync, which with several distributed-optimizer instances
    joins its communication stream instead of waiting for the handle; then sdp4bit's handle,
    if one is pending, is waited for (every reduction, across the instances included, has
    then completed)."""
    result = GROUP_PATCHES.original("finish_grad_sync")(self, force_all_reduce)
    if isinstance(self.grad_reduce_handle, BucketGroupHandle):
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None
    return result


def start_param_sync(self, force_sync: bool = False):
    """_ParamAndGradBucketGroup.start_param_sync through sdp4bit where weights are
    compressed."""
    state = bucket_group_state(self)
    if state is None or not state.config.compresses_weights:
        return PATCHES.original("start_param_sync")(self, force_sync)
    if force_sync:
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            _post_param_sync(self)
            return
    else:
        assert self.param_gather_handle is None
    if state.fresh:
        # No optimizer step since set-up, resume or a load: every replica holds the same
        # parameters (checked then), so there is nothing to gather.
        self.param_gather_handle = None
        self.param_gather_dispatched = True
        return
    # Numbered by the gradient step whose update it carries, so that the random streams do
    # not depend on how often Megatron syncs (e.g. the forward hooks of overlapped gathers).
    step = state.grad_step - 1
    telemetry = current().telemetry
    set_up = len(current().bucket_groups)  # bucket groups reporting each step
    reference = None
    if telemetry.due(step):
        reference = [_exact_all_gather(b.param_data, state.groups) for b in self.buckets]
    inside = dp_group(state.groups)
    # The exact elements leave the buckets before the compressed all-gather reads them.
    pending = [exact.start_params(bucket.param_data, inside) if exact is not None else None
               for bucket, exact in zip(self.buckets, state.exact)]
    handles = [ag.start(bucket.param_data, step) for bucket, ag in zip(self.buckets, state.weight)]

    def finish():
        for bucket, exact, started in zip(self.buckets, state.exact, pending):
            if exact is not None:
                exact.finish_params(started, bucket.param_data)
        if reference is not None:
            wire = WireCounter()
            state.count_weights(wire)
            got = [bucket.param_data for bucket in self.buckets]
            telemetry.report("param", step, set_up, wire.sent, wire.uncompressed,
                             ErrorStats.of(got, reference), exact=wire.exact)

    handle = BucketGroupHandle(handles, finish)
    if self.ddp_config.overlap_param_gather and not force_sync:
        self.param_gather_handle = handle
    else:
        handle.wait()
        self.param_gather_handle = None
    if force_sync and self.ddp_config.overlap_param_gather:
        _post_param_sync(self)
    self.param_gather_dispatched = True


def _post_param_sync(bucket_group) -> None:
    """megatron-core 0.19's processing after a completed param gather, where it has one (a
    no-op for the buckets sdp4bit gathers: they hold no quantized parameters)."""
    post = getattr(bucket_group, "_post_param_sync", None)
    if post is not None:
        post()
