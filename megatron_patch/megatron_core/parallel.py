"""megatron-core's parallel layout as the integration reads it: a DDP model's bucket groups,
its tensor-parallel group, and the data-parallel group of a set of sdp4bit process groups."""

from __future__ import annotations

import torch.distributed as dist

from sdp4bit import ProcessGroups


def bucket_groups(ddp_model) -> list:
    """Every bucket group of `ddp_model`, dense ones first, then the expert-parallel ones."""
    return ddp_model.bucket_groups + ddp_model.expert_parallel_bucket_groups


def tensor_parallel_group(ddp_model):
    """The tensor-parallel group of a DDP model (its own where megatron-core keeps one)."""
    group = getattr(ddp_model, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def dp_group(groups: ProcessGroups):
    """The torch.distributed group `groups` were built for (the whole job where None)."""
    return groups.dp_group if groups.dp_group is not None else dist.group.WORLD
