"""Rank code for the megatron-core tests: real megatron-core DDP and bucket groups on CPU,
with a small sharded SGD standing in for the CUDA-only DistributedOptimizer."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import megatron_patch.megatron_core as integration
from sdp4bit import Config
from sdp4bit.integration import local_shard

HIDDEN = 64


class _HostStream:
    """What megatron-core 0.19's grad sync asks of ``torch.cuda.current_stream()`` (it waits
    for CUDA-graph events there): on CPU there is nothing to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


if not torch.cuda.is_available():
    torch.cuda.current_stream = lambda device=None: _HostStream()


def build(overlap_grad: bool, overlap_param: bool, bucket_size: int = 4500, tp: int = 1,
          seed: int = 1234, out_features: int = 8):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, out_features),
    ).bfloat16()
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1,
                               bf16=True, params_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap_grad,
        overlap_param_gather=overlap_param,
        # Several buckets and bucket groups by default. Without overlap_grad_reduce megatron-core
        # puts everything in one bucket, whatever this says.
        bucket_size=bucket_size,
        check_for_nan_in_grad=False,  # the test exercises the optimizer's found-inf check
    )
    with integration.megatron_on_cpu():
        ddp = DistributedDataParallel(config, ddp_config, model)
    return ddp


class ShardedSGD:
    """The distributed optimizer's contract on CPU: fp32 main params for this rank's shard of
    every bucket, a found-inf check over the DP group, bf16 params written back into the
    param buffer, then the param all-gather."""

    def __init__(self, ddp, lr: float):
        from megatron.core import parallel_state

        self.ddp, self.lr = ddp, lr
        group = parallel_state.get_data_parallel_group()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.buckets = [b for g in ddp.bucket_groups for b in g.buckets]
        self.main = [local_shard(b.param_data, self.rank, self.size).float() for b in self.buckets]

    def step(self) -> bool:
        grads = [local_shard(b.grad_data, self.rank, self.size) for b in self.buckets]
        found_inf = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0])
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        if found_inf.item() == 0.0:
            for main, grad, bucket in zip(self.main, grads, self.buckets):
                main -= self.lr * grad
                local_shard(bucket.param_data, self.rank, self.size).copy_(main.bfloat16())
        if not self.ddp.ddp_config.overlap_param_gather:
            self.ddp.start_param_sync()
        # With overlap, the forward pre-hooks of the next step gather the params.
        return found_inf.item() == 0.0


def _replicas_identical(tensor: torch.Tensor) -> bool:
    """Whether every rank of this rank's DP group holds the same bits."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    bits = tensor.view(torch.int16).to(torch.int32)
    gathered = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, bits, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def train(rank, world, preset, overlap_grad, overlap_param, steps, nan_step=None,
          check_against_core=False, bucket_size=4500):
    """Trains a few steps; returns (losses, stepped flags, final bf16 params as bytes, (bytes
    sent, uncompressed bytes) per step). Plain Python values: tensors sent between processes
    would live in shared memory that ends with the rank."""
    if preset is None:
        integration.disable()
    else:
        integration.enable(Config.from_knobs(preset, {"seed": 5}), local_world_size=2)
    ddp = build(overlap_grad, overlap_param, bucket_size)
    opt = ShardedSGD(ddp, lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    losses, stepped = [], []
    for step in range(steps):
        x = torch.randn(16, HIDDEN, generator=g).bfloat16()
        if step == nan_step and rank == 1:
            x[3, 5] = float("nan")
        ddp.zero_grad_buffer()
        loss = ddp(x).float().pow(2).mean()
        loss.backward()
        before = [b.grad_data.clone() for g_ in ddp.bucket_groups for b in g_.buckets]
        ddp.finish_grad_sync()
        if check_against_core:
            _check_grad_shards_against_core(ddp, before)
        stepped.append(opt.step())
        losses.append(loss.item())
    if overlap_param:
        for bucket_group in ddp.bucket_groups:
            bucket_group.finish_param_sync(skip_next_bucket_dispatch=True)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    assert _replicas_identical(params), "replicas differ"
    for bucket_group in ddp.bucket_groups:
        for bucket in bucket_group.buckets:
            assert _replicas_identical(bucket.param_data), "param buffers differ"
    sent, baseline = integration.wire_bytes(ddp, steps)
    integration.disable()
    return losses, stepped, params.view(torch.int16).numpy().tobytes(), (sent, baseline)


def _check_grad_shards_against_core(ddp, before):
    """Each bucket's reduced shard equals the Rust core's in-process reduce-scatter of every
    DP rank's (scaled) bucket, byte for byte."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_group()
    rank, world = dist.get_rank(dp), dist.get_world_size(dp)
    buckets = [(g, i, b) for g in ddp.bucket_groups for i, b in enumerate(g.buckets)]
    for (group, idx, bucket), grad in zip(buckets, before):
        state = group._sdp4bit
        rs = state.grad[idx]
        step = state.grad_step - 1
        grad *= bucket.gradient_scaling_factor
        every = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(every, grad, group=dp)
        expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
            rs.config.spec(), state.groups.node_labels, rs.bucket_id, step,
            torch.stack(every))[rank]
        got = local_shard(bucket.grad_data, rank, world)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (
            f"bucket {rs.bucket_id} step {step} differs from the core")


def train_segment(rank, world, first, last, checkpoint_dir, overlap_param):
    """Trains steps [first, last) with sdp4bit; resumes from `checkpoint_dir` when first > 0
    and saves there at the end. Returns (losses, final params as bytes)."""
    import os

    integration.enable(Config.from_knobs("sdp4bit", {"seed": 9}), local_world_size=2)
    ddp = build(True, overlap_param)
    opt = ShardedSGD(ddp, lr=0.05)
    g = torch.Generator().manual_seed(300 + rank)
    path = os.path.join(checkpoint_dir, f"rank{rank}.pt")
    buckets = [b for group in ddp.bucket_groups for b in group.buckets]
    if first > 0:
        saved = torch.load(path)
        for bucket, data in zip(buckets, saved["param_buffers"]):
            bucket.param_data.copy_(data)
        for main, data in zip(opt.main, saved["main"]):
            main.copy_(data)
        g.set_state(saved["generator"])
        integration.load_state_dict(saved["sdp4bit"])
    losses = []
    for _ in range(first, last):
        x = torch.randn(16, HIDDEN, generator=g).bfloat16()
        ddp.zero_grad_buffer()
        loss = ddp(x).float().pow(2).mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    if overlap_param:  # flush the last gather, as a checkpoint save does
        for bucket_group in ddp.bucket_groups:
            bucket_group.finish_param_sync(skip_next_bucket_dispatch=True)
    torch.save({
        "param_buffers": [b.param_data.clone() for b in buckets],
        "main": [m.clone() for m in opt.main],
        "generator": g.get_state(),
        "sdp4bit": integration.state_dict(ddp),
    }, path)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    integration.disable()
    return losses, params.view(torch.int16).numpy().tobytes()


class RecordingWriter:
    """A tensorboard writer that keeps what it is given."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step):
        self.scalars[(name, step)] = value


def telemetry(rank, world, steps, interval):
    """Trains with telemetry every `interval` steps; returns the recorded scalars."""
    writer = RecordingWriter()
    integration.enable(Config("sdp4bit"), local_world_size=2,
                       telemetry_interval=interval, tensorboard_writer=writer)
    ddp = build(True, False)
    opt = ShardedSGD(ddp, lr=0.05)
    g = torch.Generator().manual_seed(500 + rank)
    for _ in range(steps):
        ddp.zero_grad_buffer()
        ddp(torch.randn(16, HIDDEN, generator=g).bfloat16()).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
    integration.disable()
    return writer.scalars


def tensor_parallel_and_chunks(rank, world, tp, chunks, steps):
    """DP groups per tensor-parallel rank (W / tp ranks each) and several model chunks (DDP
    instances) sharing them: every chunk's shards equal the core's, replicas within each DP
    group stay identical. Returns each chunk's losses."""
    integration.enable(Config("sdp4bit"), local_world_size=2)
    models = [build(False, False, tp=tp, seed=1234 + c) for c in range(chunks)]
    optimizers = [ShardedSGD(ddp, lr=0.05) for ddp in models]
    g = torch.Generator().manual_seed(700 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, HIDDEN, generator=g).bfloat16()
        for ddp in models:
            ddp.zero_grad_buffer()
        loss = sum(ddp(x).float().pow(2).mean() for ddp in models)
        loss.backward()
        for ddp in models:
            before = [b.grad_data.clone() for g_ in ddp.bucket_groups for b in g_.buckets]
            ddp.finish_grad_sync()
            _check_grad_shards_against_core(ddp, before)
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    for ddp in models:
        for bucket_group in ddp.bucket_groups:
            for bucket in bucket_group.buckets:
                assert _replicas_identical(bucket.param_data), "param buffers differ"
    integration.disable()
    return losses


def pipeline_parallel(rank, world, steps):
    """PP = 2 on W = 4: a two-stage pipeline (activations and their gradients sent between
    the stages), DP groups {0, 1} (stage 0) and {2, 3} (stage 1), each rank its own node.
    Each stage's shards equal the core's, and replicas within each DP group stay identical.
    Returns (pipeline stage, losses)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    integration.enable(Config("sdp4bit"), local_world_size=1)
    # Synchronous grad sync: the check below snapshots the buckets before the sync starts.
    ddp = build(False, False, seed=1234 + stage, out_features=HIDDEN if stage == 0 else 8)
    opt = ShardedSGD(ddp, lr=0.05)
    g = torch.Generator().manual_seed(900 + parallel_state.get_data_parallel_rank())
    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        if stage == 0:
            hidden = ddp(torch.randn(16, HIDDEN, generator=g).bfloat16())
            dist.send(hidden.detach().float(), parallel_state.get_pipeline_model_parallel_next_rank())
            grad = torch.empty(hidden.shape)
            dist.recv(grad, parallel_state.get_pipeline_model_parallel_prev_rank())
            hidden.backward(grad.bfloat16())
        else:
            received = torch.empty(16, HIDDEN)
            dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
            hidden = received.bfloat16().requires_grad_()
            loss = ddp(hidden).float().pow(2).mean()
            loss.backward()
            dist.send(hidden.grad.float(), parallel_state.get_pipeline_model_parallel_next_rank())
            losses.append(loss.item())
        before = [b.grad_data.clone() for g_ in ddp.bucket_groups for b in g_.buckets]
        ddp.finish_grad_sync()
        _check_grad_shards_against_core(ddp, before)
        opt.step()
    for bucket_group in ddp.bucket_groups:
        assert bucket_group._sdp4bit.groups.size == 2
        for bucket in bucket_group.buckets:
            assert _replicas_identical(bucket.param_data), "param buffers differ"
    integration.disable()
    return stage, losses


class LogRecords(logging.Handler):
    """The messages logged to the ``sdp4bit`` logger while installed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []
        logging.getLogger("sdp4bit").addHandler(self)
        logging.getLogger("sdp4bit").setLevel(logging.INFO)

    def emit(self, record):
        self.messages.append(record.getMessage())


def route_notice(rank, world, steps):
    """Nodes of unequal size (W = 3 as 2 + 1): each bucket group logs the degraded route once,
    at set-up. Returns (bucket groups, the messages logged)."""
    records = LogRecords()
    integration.enable(Config("sdp4bit"), local_world_size=2)
    ddp = build(True, False)
    opt = ShardedSGD(ddp, lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        ddp.zero_grad_buffer()
        ddp(torch.randn(16, HIDDEN, generator=g).bfloat16()).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        opt.step()
    integration.disable()
    return len(ddp.bucket_groups), records.messages
