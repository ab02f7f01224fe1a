"""Rank code for FSDP2 hybrid sharding's gradients against native HSDP's (W = 4 as replicate 2
x shard 2): the same model, seed and batches, once with native HSDP (units sharded over the
2-D mesh) and once with sdp4bit (units sharded over the mesh's shard dimension, the 2-D mesh
given to sdp4bit.fsdp.enable), for a gradient divide factor, force-sum reductions and
micro-steps that skip the all-reduce (``set_requires_all_reduce(False)``). Where the settings
ask FSDP for PREMUL_SUM (a factor other than the shard size without force-sum), which gloo
lacks, native HSDP runs with force-sum, which divides by the same factor after its SUMs."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_scenarios as fs
import sdp4bit.fsdp
from sdp4bit import CrossGroupAllReduce
from sdp4bit.fsdp._torch import Unit


def _build(mesh, param_dtype, factor, force_sum) -> torch.nn.Module:
    """The three-unit model of fsdp_scenarios, fp32 reductions, `factor` and `force_sum` set
    on every unit."""
    torch.manual_seed(1234)
    model = fs.Net()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for unit in (*model.blocks, model):
        if factor is not None:
            unit.set_gradient_divide_factor(factor)
        unit.set_force_sum_reduction_for_comms(force_sum)
    return model


@contextlib.contextmanager
def _counted_all_reduces(replicate: dist.ProcessGroup):
    """Counts the all-reduces over the replicate dimension while active: torch's over
    `replicate` (native HSDP's, and sdp4bit's exact ones) and sdp4bit's compressed ones."""
    ranks = dist.get_process_group_ranks(replicate)
    calls = [0]
    all_reduce, start = dist.all_reduce, CrossGroupAllReduce.start

    def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is not None and dist.get_process_group_ranks(group) == ranks:
            calls[0] += 1
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    def counted_start(self, data, step):
        calls[0] += 1
        return start(self, data, step)

    dist.all_reduce, CrossGroupAllReduce.start = counted_all_reduce, counted_start
    try:
        yield calls
    finally:
        dist.all_reduce, CrossGroupAllReduce.start = all_reduce, start


@contextlib.contextmanager
def _blind_to_fsdps_settings(blind: bool):
    """With `blind`, sdp4bit's all-reduce hook sees no divide factor and an all-reduce
    required at every micro-step, whatever the units say (the control: sdp4bit before it
    read them)."""
    if not blind:
        yield
        return
    divide_factor, requires_all_reduce = Unit.gradient_divide_factor, Unit.requires_all_reduce
    Unit.gradient_divide_factor = lambda self: None
    Unit.requires_all_reduce = lambda self: True
    try:
        yield
    finally:
        Unit.gradient_divide_factor = divide_factor
        Unit.requires_all_reduce = requires_all_reduce


def _gradients(model, replicate, micro_steps: int) -> tuple[list[torch.Tensor], int]:
    """This rank's gradient shards after `micro_steps` backward passes (all but the last with
    ``set_requires_all_reduce(False)``), and the all-reduces over the replicate dimension."""
    with _counted_all_reduces(replicate) as calls:
        for micro in range(micro_steps):
            model.set_requires_all_reduce(micro == micro_steps - 1)
            x, y = fs.batch(torch.Generator().manual_seed(700 + 10 * dist.get_rank() + micro))
            (model(x).float() - y).pow(2).mean().backward()
    return [p.grad.to_local().detach().clone() for p in model.parameters()], calls[0]


def _ratio(ours: list[torch.Tensor], native: list[torch.Tensor]) -> float:
    """The least-squares ratio <ours, native> / <native, native> over every rank's shards."""
    sums = torch.zeros(2, dtype=torch.float64)
    for a, b in zip(ours, native):
        sums[0] += (a.double() * b.double()).sum()
        sums[1] += b.double().pow(2).sum()
    dist.all_reduce(sums)  # each shard is held by both replicas: the factor 2 cancels
    return (sums[0] / sums[1]).item()


def against_native(rank, world, setups):
    """For each (preset, knobs, cases, blind) of `setups`, sdp4bit running the preset with the
    knobs (parameters fp32 where it compresses no weights, else bf16; `blind`: the control,
    :func:`_blind_to_fsdps_settings`), and each (divide factor or None, force-sum,
    micro-steps) of its cases: (every gradient shard of this rank equal to native HSDP's, the
    ratio of sdp4bit's gradients to native HSDP's, all-reduces over the replicate dimension
    by sdp4bit, by native HSDP). One list per setup."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group(0)
    out = []
    for preset, knobs, cases, blind in setups:
        config = sdp4bit.fsdp.preset_config(preset, knobs)
        param_dtype = torch.bfloat16 if config.compresses_weights else None
        results = []
        for factor, force_sum, micro_steps in cases:
            premul_sum = not force_sum and factor not in (None, world // 2)
            native, native_calls = _gradients(
                _build(mesh, param_dtype, factor, force_sum or premul_sum), replicate,
                micro_steps)
            model = _build(mesh["shard"], param_dtype, factor, force_sum)
            sdp4bit.fsdp.enable(model, config, mesh=mesh)
            try:
                with _blind_to_fsdps_settings(blind):
                    ours, our_calls = _gradients(model, replicate, micro_steps)
            finally:
                sdp4bit.fsdp.disable(model)
            equal = all(torch.equal(a, b) for a, b in zip(ours, native))
            results.append((equal, _ratio(ours, native), our_calls, native_calls))
        out.append(results)
    return out
