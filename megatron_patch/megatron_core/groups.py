"""sdp4bit's process groups for megatron-core's bucket groups: one set per (data-parallel
group, distributed-optimizer instance), shared by every bucket group that reduces over it,
built when the DDP model is built (from the training thread, in the same order on every
rank), never from a backward hook."""

from __future__ import annotations

from sdp4bit import ProcessGroups, Sdp4bitError

from .parallel import bucket_groups
from .settings import Settings

#: Key prefix of the groups across distributed-optimizer instances.
_ACROSS = "across:"


def compresses_across(settings: Settings) -> bool:
    """Whether the all-reduce across instances is sdp4bit's (``cross_group_bits`` not exact)."""
    return dict(settings.config.resolved.values)["cross_group_bits"] != "exact"


def create_for_model(settings: Settings, ddp) -> None:
    """Builds the groups every bucket group of the DDP model `ddp` will use, where no earlier
    model built them: its instance's DP group and, with several instances and a compressed
    all-reduce across them, the group across the instances (each instance a node of its own).
    Collective over those groups: call it on every rank as the model is built."""
    on_cuda = any(b.grad_data.is_cuda for buffer in ddp.buffers + ddp.expert_parallel_buffers
                  for b in buffer.buckets)
    for bucket_group in bucket_groups(ddp):
        inside = bucket_group.intra_distributed_optimizer_instance_group
        _create(settings, inside.group_name, on_cuda,
                lambda: ProcessGroups.create(inside, settings.local_world_size))
        if (bucket_group.ddp_config.num_distributed_optimizer_instances > 1
                and compresses_across(settings)):
            across = bucket_group.inter_distributed_optimizer_instance_group
            _create(settings, _ACROSS + across.group_name, on_cuda,
                    lambda: ProcessGroups.create(across, node_labels=list(range(across.size()))))


def _create(settings: Settings, key: str, on_cuda: bool, create) -> None:
    if key in settings.groups:
        return
    groups = create()
    if on_cuda:
        groups.host_group()  # Global-QSGD's agreements beside CUDA buckets take it at set-up
    settings.groups[key] = groups


def inside_instance(settings: Settings, bucket_group) -> ProcessGroups:
    """The groups of `bucket_group`'s DP group inside its instance."""
    return _built(settings, bucket_group.intra_distributed_optimizer_instance_group.group_name)


def across_instances(settings: Settings, bucket_group) -> ProcessGroups:
    """The groups across the distributed-optimizer instances of `bucket_group`."""
    return _built(settings,
                  _ACROSS + bucket_group.inter_distributed_optimizer_instance_group.group_name)


def _built(settings: Settings, key: str) -> ProcessGroups:
    groups = settings.groups.get(key)
    if groups is None:
        raise Sdp4bitError(
            "this DDP model was built before megatron_patch.megatron_core.enable(); "
            "enable sdp4bit first, then build the model")
    return groups


def close_all(settings: Settings) -> None:
    """Closes every set of groups built (their collectives in flight complete first)."""
    for groups in settings.groups.values():
        groups.close()
    settings.groups.clear()
