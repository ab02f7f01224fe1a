"""Rank code for the hybrid-sharding tests (num_distributed_optimizer_instances > 1):
process groups shared by every bucket group, and tensor parallelism with exact elements
across the instances (megatron_on_cpu/, as megatron_scenarios.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import megatron_gpt as gpt
import megatron_patch.megatron_core as integration
from megatron_scenarios import LR, SEED, SHAPE, _differing_copies, windows
from sdp4bit import Config, Sdp4bitError


@contextlib.contextmanager
def _counted_new_groups():
    """Counts the calls of ``torch.distributed.new_group`` while installed (a list, one entry
    per call)."""
    original = dist.new_group
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("ranks"))
        return original(*args, **kwargs)

    dist.new_group = counted
    try:
        yield calls
    finally:
        dist.new_group = original


#: Three layers: over 20 buckets of 100 elements (two layers make 16).
DEEPER = gpt.Shape(context=SHAPE.context, width=SHAPE.width, layers=3, heads=SHAPE.heads)


def process_groups_per_bucket_count(rank, world, bucket_sizes, steps):
    """W = 4 as 2 instances of 2 ranks (one per node): for each of `bucket_sizes`, builds the
    three-layer GPT in buckets of that many elements (each bucket its own bucket group under
    ``overlap_grad_reduce``) and trains `steps` steps with sdp4bit, counting ``new_group``
    calls. Returns per size (buckets, bucket groups, groups created while the model was
    built, groups created while it trained: inside backward hooks, where none may be)."""
    gpt.initialize(SEED, instances=2)
    results = []
    for bucket_size in bucket_sizes:
        integration.enable(Config.from_knobs("sdp4bit", {"seed": 5}), local_world_size=1)
        with _counted_new_groups() as built:
            ddp = gpt.build_model(DEEPER, SEED, overlap_grad_reduce=True,
                                  bucket_size=bucket_size,
                                  num_distributed_optimizer_instances=2)
        optimizer = gpt.build_optimizer([ddp], lr=LR)
        with _counted_new_groups() as trained:
            for step in range(steps):
                gpt.zero_grads([ddp], optimizer)
                gpt.token_losses(ddp, windows(step, rank // 2)).mean().backward()
                gpt.finish_grad_sync([ddp])
                assert gpt.optimizer_step(optimizer)[0]
        shared = {id(r.groups) for g in ddp.bucket_groups for r in g._sdp4bit.across.reduces
                  if r is not None}
        assert len(shared) == 1, "bucket groups hold different groups across the instances"
        buckets = sum(len(g.buckets) for g in ddp.bucket_groups)
        results.append((buckets, len(ddp.bucket_groups), len(built), len(trained)))
        integration.disable()
    gpt.shutdown()
    return results


def _replicas_across_instances(ddp) -> bool:
    """Whether every rank of the whole data-parallel group (both instances) holds the same
    parameter bits."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    bits = torch.cat([b.view(torch.int16) for b in gpt.bucket_params(ddp)]).to(torch.int32)
    every = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, bits, group=group)
    return all(torch.equal(e, every[0]) for e in every)


def hybrid_with_tensor_parallelism(rank, world, variants, steps):
    """TP = 2 and 2 distributed-optimizer instances of one rank on W = 4 (the smallest
    layout where replicated parameters cross the instances' all-reduce): for each of
    `variants` (knobs of the sdp4bit preset), `steps` steps; after every step
    :func:`check_replicated_params` (the TP copies) and a comparison of both instances'
    parameters. Returns per variant: per step (the check's error or None, the replicated
    parameters that differ across the TP group, whether the instances hold the same bits),
    and the bytes one step sends and those of them that went exact."""
    from megatron.core import parallel_state

    gpt.initialize(SEED, tp=2, instances=2)
    dp_rank = parallel_state.get_data_parallel_rank()
    results = []
    for knobs in variants:
        integration.enable(Config.from_knobs("sdp4bit", {"seed": 5, **knobs}),
                           local_world_size=1)
        ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=True, bucket_size=6000,
                              num_distributed_optimizer_instances=2)
        optimizer = gpt.build_optimizer([ddp], lr=LR)
        per_step = []
        for step in range(steps):
            gpt.zero_grads([ddp], optimizer)
            gpt.token_losses(ddp, windows(step, dp_rank)).mean().backward()
            gpt.finish_grad_sync([ddp])
            assert gpt.optimizer_step(optimizer)[0]
            try:
                integration.check_replicated_params(ddp)
                error = None
            except Sdp4bitError as found:
                error = str(found)
            per_step.append((error, _differing_copies(ddp)[0], _replicas_across_instances(ddp)))
        results.append((per_step, (integration.wire_bytes(ddp, steps)[0],
                                   integration.exact_wire_bytes(ddp, steps))))
        integration.disable()
    gpt.shutdown()
    return results
