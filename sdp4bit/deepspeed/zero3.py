"""ZeRO stage 3 (``DeepSpeedZeroOptimizer_Stage3``).

Stage 3 gathers parameters on demand (module by module, prefetched) and frees them, so no
replica keeps a previous copy: qWD cannot apply (refused by the section check). With a direct
weight codec (qw, qsdp, zeropp) every gather the parameter coordinator makes for compute goes
through it, and every gradient bucket's reduce-scatter through the gradient codec. Both use
DeepSpeed's equal-split flat buffers, so each distinct bucket shape gets its own compressed
collective, set up (collectively) the first time it is seen; every rank sees the buckets in the
same order. Other gathers (``GatheredParameters``, checkpoints) stay exact.

A checkpoint keeps, per bucket shape, its bucket id and how often it ran (the codecs' steps,
which their rounding streams follow): after a load, each shape sets up with its saved id and
goes on from its saved count when it is first seen again. The direct weight codecs keep no
references, so nothing is derived from the loaded weights.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._patching import Patches
from ..collectives import GradReduceScatter, WeightAllGather
from ..config import limits
from ..errors import Sdp4bitError
from ..groups import ProcessGroups
from ..integration import WireCounter, local_shard, log_route_notice, require_bf16
from .section import Settings

_PATCHES = Patches()
# Inside the parameter coordinator's fetch: its all-gathers are the compressed ones.
_FETCHING: contextvars.ContextVar = contextvars.ContextVar("sdp4bit_fetching", default=False)
# The attached optimizers' states, by their DP group's global ranks (DeepSpeed hands the same
# group around under different wrappers).
_ATTACHED: dict[tuple, State] = {}
# The coordinator's (name-mangled) method that gathers parameters for compute.
_FETCH = "_PartitionedParameterCoordinator__all_gather_params_"


@dataclass
class _Collectives:
    """The compressed collectives of one bucket shape, and how often each ran."""

    collective: GradReduceScatter | WeightAllGather
    calls: int = 0


@dataclass
class State:
    """sdp4bit's state on an attached stage 3 optimizer (``optimizer._sdp4bit``)."""

    settings: Settings
    groups: ProcessGroups
    grad_buckets: dict[tuple, _Collectives] = field(default_factory=dict)  # by tensor numels
    weight_buckets: dict[int, _Collectives] = field(default_factory=dict)  # by bucket numel
    wire: WireCounter = field(default_factory=WireCounter)
    # From a loaded checkpoint, by shape: (bucket id, calls) of shapes not set up again yet.
    saved_grad: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    saved_weight: dict[int, tuple[int, int]] = field(default_factory=dict)


def checkpoint_state(state: State) -> dict:
    """What a checkpoint keeps: every bucket shape's id and calls (also those loaded and not
    seen again yet)."""
    def entries(live: dict, saved: dict) -> list:
        kept = {**saved, **{key: (entry.collective.bucket_id, entry.calls)
                            for key, entry in live.items()}}
        return [[key, bucket_id, calls] for key, (bucket_id, calls) in kept.items()]

    return {"stage": "3", "grad": entries(state.grad_buckets, state.saved_grad),
            "weight": entries(state.weight_buckets, state.saved_weight)}


def restore(optimizer, state: State, saved: dict | None) -> None:
    """After DeepSpeed loaded a checkpoint: the saved shapes' ids and calls, taken up when each
    shape is first seen (a shape already set up in this process goes on from the saved
    count)."""
    if saved is None:
        return
    if saved.get("stage") != "3":
        raise Sdp4bitError(f"this checkpoint holds sdp4bit's ZeRO stage {saved.get('stage')} "
                           "state; the engine loading it runs ZeRO stage 3")
    for live, pending, entries, as_key in (
            (state.grad_buckets, state.saved_grad, saved["grad"], tuple),
            (state.weight_buckets, state.saved_weight, saved["weight"], int)):
        for key, bucket_id, calls in entries:
            key = as_key(key)
            if key in live:
                if live[key].collective.bucket_id != bucket_id:
                    raise Sdp4bitError(
                        f"ZeRO stage 3 bucket shape {key} has bucket id "
                        f"{live[key].collective.bucket_id} here and {bucket_id} in the "
                        "checkpoint; load the checkpoint before the first step")
                live[key].calls = calls
            else:
                pending[key] = (bucket_id, calls)


def _new_entry(live: dict, pending: dict, key, ids: range, what: str) -> tuple[int, int]:
    """The bucket id and first call of a shape seen for the first time: the checkpoint's, else
    the lowest id of `ids` no other shape has (live or saved)."""
    if key in pending:
        return pending.pop(key)
    used = {entry.collective.bucket_id for entry in live.values()}
    used |= {bucket_id for bucket_id, _ in pending.values()}
    for bucket_id in ids:
        if bucket_id not in used:
            return bucket_id, 0
    raise Sdp4bitError(f"more than {len(ids)} distinct ZeRO stage 3 {what}")


def _bucket_id_ranges() -> tuple[range, range]:
    """Bucket ids of the gradient and the weight buckets: the core's id space, halved."""
    end = limits().max_bucket_id + 1
    return range(0, end // 2), range(end // 2, end)


def attach(optimizer, settings: Settings) -> None:
    """Routes a stage 3 optimizer's on-demand parameter gathers and gradient reduce-scatters
    through sdp4bit. Collective: every DP rank calls it."""
    problems = [name for name, present in (
        ("parameter or optimizer offload", optimizer.offload_param or optimizer.offload_optimizer),
        ("ZeRO++ quantized weights (zero_quantized_weights)",
         optimizer.parameter_offload.zero_quantized_weights),
        ("ZeRO++ quantized gradients (zero_quantized_gradients)",
         optimizer.all2all_process_group is not None),
        ("hierarchical partitioning (zero_hpz_partition_size > 1)",
         optimizer.zero_hpz_partition_size > 1),
        ("MoE layers", getattr(optimizer, "has_moe_layers", False)),
    ) if present]
    if problems:
        raise Sdp4bitError(f"sdp4bit does not handle {', '.join(problems)} in ZeRO stage 3; "
                           "turn it off or use the baseline preset")
    if settings.config.compresses_weights:
        require_bf16((p.ds_tensor.dtype for group in optimizer.fp16_groups for p in group),
                     "this model's partitions are", 'enable "bf16" in the DeepSpeed config')
    _install()
    groups = ProcessGroups.create(optimizer.dp_process_group, settings.ranks_per_node)
    optimizer._sdp4bit = State(settings, groups)
    _ATTACHED[_group_key(optimizer.dp_process_group)] = optimizer._sdp4bit


def detach(optimizer) -> None:
    """Forgets `optimizer` (its state is already removed by the caller)."""
    _ATTACHED.pop(_group_key(optimizer.dp_process_group), None)


def _install() -> None:
    from deepspeed.runtime.zero import partition_parameters, partitioned_param_coordinator, stage3

    coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
    if _PATCHES.installed("reduce_scatter_coalesced"):
        return
    _PATCHES.install(stage3, "reduce_scatter_coalesced", _reduce_scatter_coalesced)
    _PATCHES.install(partition_parameters, "_dist_allgather_fn", _dist_allgather_fn)
    _PATCHES.install(coordinator, _FETCH, _fetch_params)


def _group_key(group) -> tuple:
    """A process group's global ranks."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _state(group) -> State | None:
    """The attached stage 3 state of DP group `group`; raises if stage 3 optimizers are
    attached but `group` is none of theirs (it would otherwise go uncompressed)."""
    if not _ATTACHED:
        return None
    state = _ATTACHED.get(_group_key(group))
    if state is None:
        raise Sdp4bitError("a ZeRO stage 3 collective ran over a process group that is not the "
                           "DP group sdp4bit was attached to (sub-group partitioning is not "
                           "supported)")
    return state


def _reduce_scatter_coalesced(tensors, group=None):
    """Stage 3's gradient reduce-scatter of a bucket of parameters' gradients: DeepSpeed's
    interleaved layout (rank r's chunk of every tensor, padded to equal size, then rank r+1's),
    pre-divided by the DP size, reduced with the gradient codec."""
    state = _state(group)
    if state is None or not state.settings.config.compresses_grads:
        return _PATCHES.original("reduce_scatter_coalesced")(tensors, group)
    rank, size = state.groups.rank, state.groups.size
    chunks = [-(-t.numel() // size) for t in tensors]
    flat = torch.zeros(size * sum(chunks), dtype=torch.float32, device=tensors[0].device)
    offset = 0
    for r in range(size):
        for t, chunk in zip(tensors, chunks):
            piece = t.reshape(-1)[r * chunk:(r + 1) * chunk]
            flat[offset:offset + piece.numel()].copy_(piece)
            offset += chunk
    flat.div_(size)
    key = tuple(t.numel() for t in tensors)
    entry = state.grad_buckets.get(key)
    if entry is None:
        bucket_id, calls = _new_entry(state.grad_buckets, state.saved_grad, key,
                                      _bucket_id_ranges()[0],
                                      "gradient bucket shapes; raise reduce_bucket_size")
        rs = GradReduceScatter(state.groups, state.settings.config, flat.numel(), bucket_id,
                               device=flat.device)
        log_route_notice("ZeRO stage 3 gradient bucket", [rs])
        entry = state.grad_buckets[key] = _Collectives(rs, calls)
    shard = local_shard(flat, rank, size)
    entry.collective.start(flat, shard, entry.calls).wait()
    state.wire.add_grad(entry.collective, entry.calls)
    entry.calls += 1
    outputs, offset = [], 0
    for t, chunk in zip(tensors, chunks):
        mine = min(chunk, max(t.numel() - rank * chunk, 0))
        outputs.append(shard[offset:offset + mine].to(t.dtype))
        offset += chunk
    return outputs


def _fetch_params(self, params, forward, quantize=False):
    """The coordinator's on-demand parameter gather: its all-gathers are the ones sdp4bit
    compresses (other gathers, e.g. GatheredParameters for checkpoints, stay exact)."""
    token = _FETCHING.set(True)
    try:
        return _PATCHES.original(_FETCH)(self, params, forward, quantize)
    finally:
        _FETCHING.reset(token)


def _dist_allgather_fn(input_tensor, output_tensor, group=None):
    """Stage 3's all-gather of a flat, equal-split parameter buffer: with a direct weight codec
    when the coordinator fetches parameters for compute."""
    state = _state(group) if _FETCHING.get() else None
    if state is None or not state.settings.config.compresses_weights:
        return _PATCHES.original("_dist_allgather_fn")(input_tensor, output_tensor, group)
    rank, size = state.groups.rank, state.groups.size
    mine = local_shard(output_tensor, rank, size)
    if mine.data_ptr() != input_tensor.data_ptr():
        mine.copy_(input_tensor)
    entry = state.weight_buckets.get(output_tensor.numel())
    if entry is None:
        bucket_id, calls = _new_entry(state.weight_buckets, state.saved_weight,
                                      output_tensor.numel(), _bucket_id_ranges()[1],
                                      "parameter bucket sizes")
        entry = state.weight_buckets[output_tensor.numel()] = _Collectives(
            WeightAllGather(state.groups, state.settings.config, output_tensor, bucket_id),
            calls)
    calls = entry.calls
    entry.calls += 1
    state.wire.add_weight(entry.collective)
    return entry.collective.start(output_tensor, calls)
