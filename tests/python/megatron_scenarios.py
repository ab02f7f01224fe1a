"""Rank code for the megatron-core tests: megatron-core's real GPTModel, DDP and
DistributedOptimizer on CPU with gloo (megatron_on_cpu/: megatron_cpu, megatron_gpt,
megatron_checkpoint), with and without the sdp4bit integration."""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_checkpoint
import megatron_cpu
import megatron_gpt as gpt
import megatron_patch.megatron_core as integration
import op_calls
from sdp4bit import Config, Sdp4bitError
from sdp4bit.integration import local_shard

#: Small enough for a step to cost tens of milliseconds, large enough for several buckets.
SHAPE = gpt.Shape(context=16, width=32, layers=2, heads=2)
BATCH = 4  # sequences per rank per step
BUCKET = 6000  # elements: several buckets and bucket groups under overlap_grad_reduce
LR = 1e-2
SEED = 1234


def needed_shims(rank, world):
    """The CPU shims the installed megatron-core needs, and its version."""
    import megatron.core

    return [shim.name for shim in megatron_cpu.SHIMS if shim.needed()], megatron.core.__version__


def _dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


#: Text to learn from (a loss that falls within a few steps): the sources of megatron_on_cpu.
TEXT = torch.frombuffer(bytearray(b"".join(
    Path(module.__file__).read_bytes() for module in (gpt, megatron_cpu, megatron_checkpoint))),
    dtype=torch.uint8).long()


def windows(step: int, dp_rank: int, batch: int = BATCH) -> torch.Tensor:
    """The training data of one step on one DP rank: byte windows of TEXT at random offsets,
    the same whichever run (or resumed run) asks for them."""
    g = torch.Generator().manual_seed(SEED * 1000 + step * 64 + dp_rank)
    starts = torch.randint(0, len(TEXT) - SHAPE.context - 1, (batch,), generator=g)
    return torch.stack([TEXT[s:s + SHAPE.context + 1] for s in starts.tolist()])


def _enable(preset, local_world_size=2, **kwargs):
    if preset is None:
        integration.disable()
    else:
        integration.enable(Config.from_knobs(preset, {"seed": 5}), local_world_size=local_world_size,
                           **kwargs)


def _replicas_identical(tensor: torch.Tensor) -> bool:
    """Whether every rank of this rank's DP group holds the same bits."""
    group = _dp_group()
    bits = tensor.view(torch.int16).to(torch.int32)
    gathered = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, bits, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _assert_replicas_identical(chunks) -> None:
    for chunk in chunks:
        for params in gpt.bucket_params(chunk):
            assert _replicas_identical(params), "param buffers differ between replicas"


def _param_bytes(chunk) -> bytes:
    params = torch.cat([p.detach().reshape(-1) for p in chunk.module.parameters()])
    return params.view(torch.int16).numpy().tobytes()


def _grad_snapshot(chunk) -> list[torch.Tensor]:
    return [b.grad_data.clone() for g in chunk.bucket_groups for b in g.buckets]


def _check_grad_shards_against_core(chunk, before):
    """Each bucket's reduced shard equals the Rust core's in-process reduce-scatter of every
    DP rank's (scaled) bucket, byte for byte (a bf16 bucket: of its fp32 values, rounded to
    bf16), but for the elements kept exact (``exact_params``), which hold the fp32 sums (DP =
    2 in these tests: a sum of two values is the same in either order)."""
    dp = _dp_group()
    rank, world = dist.get_rank(dp), dist.get_world_size(dp)
    buckets = [(g, i, b) for g in chunk.bucket_groups for i, b in enumerate(g.buckets)]
    for (group, idx, bucket), grad in zip(buckets, before):
        state = group._sdp4bit
        rs = state.grad[idx]
        step = state.grad_step - 1
        grad *= bucket.gradient_scaling_factor
        every = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(every, grad, group=dp)
        expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
            rs.config.spec(), state.groups.node_labels, rs.bucket_id, step,
            torch.stack(every).float())[rank]
        exact = state.exact[idx]
        if exact is not None:
            assert world == 2
            for start, end, _ in exact.own:
                expected[start - exact.first:end - exact.first] = (
                    torch.stack(every).float()[:, start:end].sum(0))
        expected = expected.to(grad.dtype)
        got = local_shard(bucket.grad_data, rank, world)
        bits = torch.int32 if got.dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits), expected.view(bits)), (
            f"bucket {rs.bucket_id} step {step} differs from the core")


@contextlib.contextmanager
def _grads_as_each_sync_starts(snapshots: dict):
    """Records every bucket group's gradient buckets as its sync starts (from a backward hook
    under ``overlap_grad_reduce``, or from ``finish_grad_sync``), keyed by the group: what
    each rank feeds the reduce-scatter, before anything is reduced in place."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    patched = _ParamAndGradBucketGroup.start_grad_sync

    def start_grad_sync(self, *args, **kwargs):
        snapshots[self] = [bucket.grad_data.clone() for bucket in self.buckets]
        return patched(self, *args, **kwargs)

    _ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
    try:
        yield snapshots
    finally:
        _ParamAndGradBucketGroup.start_grad_sync = patched


def _poison_one_gradient(chunk) -> None:
    """One NaN in this rank's gradient of the first parameter, as a bad backward makes it."""
    param = next(chunk.module.parameters())
    param.main_grad.view(-1)[7] = float("nan")


def _train_step(ddp, optimizer, step: int, rank: int) -> float:
    """One plain training step on `step`'s batch of data-parallel rank `rank`: gradients synced
    through the DDP's bucket groups, then the optimizer; returns the loss."""
    gpt.zero_grads([ddp], optimizer)
    loss = gpt.token_losses(ddp, windows(step, rank)).mean()
    loss.backward()
    gpt.finish_grad_sync([ddp])
    gpt.optimizer_step(optimizer)
    return loss.item()


def train(rank, world, preset, overlap_grad, overlap_param, steps, nan_step=None,
          check_against_core=False, bucket_size=BUCKET, grad_fp32=True):
    """Trains a few steps; returns (losses, stepped flags, final bf16 params as bytes, (bytes
    sent, uncompressed bytes) in one step, buckets). Plain Python values: tensors sent between
    processes would live in shared memory that ends with the rank."""
    gpt.initialize(SEED)
    _enable(preset)
    ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=overlap_grad,
                          overlap_param_gather=overlap_param, bucket_size=bucket_size,
                          check_for_nan_in_grad=False,  # the optimizer's check is under test
                          grad_reduce_in_fp32=grad_fp32)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    losses, stepped, snapshots = [], [], {}
    recording = _grads_as_each_sync_starts(snapshots) if check_against_core else (
        contextlib.nullcontext())
    with recording, op_calls.counted() as calls:
        for step in range(steps):
            gpt.zero_grads([ddp], optimizer)
            snapshots.clear()
            loss = gpt.token_losses(ddp, windows(step, rank)).mean()
            loss.backward()
            if step == nan_step and rank == 1:
                _poison_one_gradient(ddp)
            gpt.finish_grad_sync([ddp])
            if check_against_core:
                assert set(snapshots) == set(ddp.bucket_groups), "a bucket group did not sync"
                before = [grad for group in ddp.bucket_groups for grad in snapshots[group]]
                _check_grad_shards_against_core(ddp, before)
            ok, _ = gpt.optimizer_step(optimizer)
            stepped.append(ok)
            losses.append(loss.item())
    op_calls.assert_none(calls, "during the training steps")
    gpt.flush_param_sync([ddp])
    _assert_replicas_identical([ddp])
    sent, baseline = integration.wire_bytes(ddp, steps)
    buckets = sum(len(group.buckets) for group in ddp.bucket_groups)
    integration.disable()
    gpt.shutdown()
    return losses, stepped, _param_bytes(ddp), (sent, baseline), buckets


def train_with_checkpoint(rank, world, steps, save_at, directory, resume):
    """With sdp4bit, through megatron-core's dist_checkpointing (dp_reshardable), sdp4bit's
    state saved apart (:func:`integration.state_dict` in the common part): either trains steps
    [0, steps) and saves after `save_at` of them, or resumes from that checkpoint (sdp4bit's
    entry of the model state left out) and trains steps [save_at, steps). Returns (losses of
    the steps run, final params)."""
    gpt.initialize(SEED)
    _enable("sdp4bit")
    ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=True, bucket_size=BUCKET)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    first = 0
    if resume:
        common = megatron_checkpoint.load(directory, ddp, optimizer, without=("sdp4bit",))
        integration.load_state_dict(common["sdp4bit"])
        first = common["iteration"]
    losses = []
    for step in range(first, steps):
        losses.append(_train_step(ddp, optimizer, step, rank))
        if not resume and step + 1 == save_at:
            gpt.flush_param_sync([ddp])  # as Megatron-LM does before saving
            megatron_checkpoint.save(directory, ddp, optimizer, {
                "iteration": save_at, "sdp4bit": integration.state_dict(ddp)})
    gpt.flush_param_sync([ddp])
    _assert_replicas_identical([ddp])
    integration.disable()
    gpt.shutdown()
    return losses, _param_bytes(ddp)


def enable_none(rank, world):
    """``enable(config_from_args(args))`` with no sdp4bit flag given, then with a config, then
    ``disable()``. Returns after each (whether sdp4bit is enabled, whether the bucket group's
    start_grad_sync is not megatron-core's own)."""
    import argparse

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from megatron_patch.arguments import add_arguments, config_from_args

    own = _ParamAndGradBucketGroup.start_grad_sync

    def seen():
        return integration.is_enabled(), _ParamAndGradBucketGroup.start_grad_sync is not own

    integration.enable(config_from_args(add_arguments(argparse.ArgumentParser()).parse_args([])))
    after_none = seen()
    integration.enable(Config("sdp4bit"))
    after_config = seen()
    integration.disable()
    return after_none, after_config, seen()


def _failure(call) -> str:
    """'ExceptionType: message @ file:function' of what `call()` raises, or 'no error'."""
    try:
        call()
    except Exception as error:  # what megatron-core raises is the result
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{os.path.basename(frame.filename)}:{frame.name}"
        return f"{type(error).__name__}: {error} @ {where}"
    return "no error"


def _fresh(bucket_size):
    ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=True, bucket_size=bucket_size)
    return ddp, gpt.build_optimizer([ddp], lr=LR)


def checkpoint_bugs(rank, world, directory, bucket_size=BUCKET):
    """megatron-core's checkpoint formats on its torch.optim path, without sdp4bit (see
    megatron_on_cpu/megatron_checkpoint.py for the lines): what fails, and how. Returns a dict of
    findings."""
    gpt.initialize(SEED)
    found = {}
    ddp, optimizer = _fresh(bucket_size)
    # Bug 1: a never-stepped optimizer cannot give the state dict a load needs.
    found["load_into_fresh"] = _failure(lambda: megatron_checkpoint.sharded_state_dict(
        ddp, optimizer, "dp_reshardable", is_loading=True))
    steps = 2
    for step in range(steps):
        _train_step(ddp, optimizer, step, rank)
    found["padded_buckets"] = sum(
        b.numel_unpadded < b.grad_data.numel() for g in ddp.bucket_groups for b in g.buckets)
    found["buckets"] = sum(len(g.buckets) for g in ddp.bucket_groups)
    # Bug 3: fully_reshardable saves each parameter with the state at its padded offset.
    model_state = ddp.module.sharded_state_dict()
    model_params = {st.key: st.data for st in _sharded_tensors(model_state)}
    state = megatron_checkpoint.sharded_state_dict(ddp, optimizer, "fully_reshardable", False)
    matches = []
    for st in _sharded_tensors(state["optimizer"]["param_state"]):
        prefix = "optimizer.state.param."
        if st.key.startswith(prefix) and st.key[len(prefix):] in model_params:
            model = model_params[st.key[len(prefix):]]
            matches.append(bool(torch.equal(st.data.bfloat16(), model)))
    found["fully_reshardable_params_saved_right"] = (sum(matches), len(matches))
    # The default format fails at save.
    found["fully_sharded_model_space_save"] = _failure(lambda: megatron_checkpoint.save(
        os.path.join(directory, "fsms"), ddp, optimizer, {}, "fully_sharded_model_space"))
    for fmt in ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter"):
        megatron_checkpoint.save(os.path.join(directory, fmt), ddp, optimizer, {}, fmt)
    # Bug 2: dp_reshardable loads (with bug 1 worked around), but Adam's step is one tensor
    # shared by every parameter, holding the loading optimizer's step, not the saved one.
    loaded_ddp, loaded_opt = _fresh(bucket_size)
    megatron_checkpoint.prime_for_loading(loaded_opt)
    sharded = megatron_checkpoint.sharded_state_dict(loaded_ddp, loaded_opt, "dp_reshardable",
                                                     True)
    with megatron_cpu.cuda_as_cpu():
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(sharded, os.path.join(directory, "dp_reshardable"))
        loaded_ddp.module.load_state_dict(loaded["model"])
        loaded_opt.load_state_dict(loaded["optimizer"])
    adam_steps = [s["step"] for s in loaded_opt.optimizer.state.values()]
    found["adam_step_tensors_after_load"] = (len(adam_steps), len({id(s) for s in adam_steps}))
    found["adam_steps_after_load"] = sorted({float(s) for s in adam_steps})
    found["saved_step"] = megatron_checkpoint.saved_adam_step(loaded["optimizer"])
    megatron_checkpoint.restore_adam_steps(loaded_opt, loaded["optimizer"])
    steps_now = [s["step"] for s in loaded_opt.optimizer.state.values()]
    found["adam_steps_worked_around"] = (len({id(s) for s in steps_now}),
                                         sorted({float(s) for s in steps_now}))
    # Bug 4: the gathered formats fail to load, whatever is worked around before.
    for fmt in ("fully_reshardable", "dp_zero_gather_scatter"):
        fresh_ddp, fresh_opt = _fresh(bucket_size)
        found[f"{fmt}_load"] = _failure(lambda: megatron_checkpoint.load(
            os.path.join(directory, fmt), fresh_ddp, fresh_opt, fmt))
    gpt.shutdown()
    return found


def _sharded_tensors(tree):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(tree) if isinstance(v, ShardedTensor)]


class RecordingWriter:
    """A tensorboard writer that keeps what it is given."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step):
        self.scalars[(name, step)] = value


class RecordingWandb:
    """What Megatron-LM's get_wandb_writer returns (the ``wandb`` module): ``log(dict, step)``;
    keeps what it is given, as :class:`RecordingWriter` does."""

    def __init__(self):
        self.scalars = {}

    def log(self, values, step=None):
        self.scalars.update({(name, step): value for name, value in values.items()})


def telemetry(rank, world, steps, interval):
    """Trains with telemetry every `interval` steps; returns the scalars the tensorboard writer
    and the wandb writer (given as a getter, as Megatron-LM's) recorded."""
    gpt.initialize(SEED)
    writer, wandb = RecordingWriter(), RecordingWandb()
    integration.enable(Config("sdp4bit"), local_world_size=2, telemetry_interval=interval,
                       tensorboard_writer=writer, wandb_writer=lambda: wandb)
    ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=True, bucket_size=BUCKET)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    for step in range(steps):
        _train_step(ddp, optimizer, step, rank)
    integration.disable()
    gpt.shutdown()
    return writer.scalars, wandb.scalars


def tensor_parallel_and_chunks(rank, world, tp, chunks, steps):
    """TP = `tp`: DP groups of W / tp ranks, one per tensor-parallel rank, and several model
    chunks (DDP instances, one DistributedOptimizer over all) sharing them: every chunk's
    shards equal the core's, replicas within each DP group stay identical. Returns the
    losses."""
    from megatron.core import parallel_state

    gpt.initialize(SEED, tp=tp)
    integration.enable(Config("sdp4bit"), local_world_size=2)
    models = [gpt.build_model(SHAPE, SEED + c, overlap_grad_reduce=False) for c in range(chunks)]
    optimizer = gpt.build_optimizer(models, lr=LR)
    dp_rank = parallel_state.get_data_parallel_rank()
    losses = []
    for step in range(steps):
        gpt.zero_grads(models, optimizer)
        data = windows(step, dp_rank)
        loss = sum(gpt.token_losses(chunk, data).mean() for chunk in models)
        loss.backward()
        for chunk in models:
            before = _grad_snapshot(chunk)
            gpt.finish_grad_sync([chunk])
            _check_grad_shards_against_core(chunk, before)
        ok, _ = gpt.optimizer_step(optimizer)
        assert ok
        losses.append(loss.item())
    _assert_replicas_identical(models)
    groups = {g._sdp4bit.groups.size for chunk in models for g in chunk.bucket_groups}
    integration.disable()
    gpt.shutdown()
    return losses, groups


def pipeline_parallel(rank, world, steps):
    """PP = 2 on W = 4 through megatron-core's own 1F1B pipeline schedule: DP groups {0, 1}
    (stage 0) and {2, 3} (stage 1), each rank its own node. Each stage's shards equal the
    core's and replicas within each DP group stay identical. Returns (pipeline stage, DP group
    size, losses on the last stage)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gpt.initialize(SEED, pp=2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    integration.enable(Config("sdp4bit"), local_world_size=1)
    # Synchronous grad sync: the check below snapshots the buckets before the sync starts.
    ddp = gpt.build_model(SHAPE, SEED, pre_process=stage == 0, post_process=stage == 1,
                          overlap_grad_reduce=False)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    dp_rank = parallel_state.get_data_parallel_rank()
    schedule = get_forward_backward_func()

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        inputs = data[:, :-1] if stage == 0 else None
        labels = data[:, 1:] if stage == 1 else None
        positions = torch.arange(SHAPE.context).unsqueeze(0).expand(BATCH, SHAPE.context)
        output = model(inputs, positions, gpt.causal_mask(SHAPE.context), labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses = []
    for step in range(steps):
        gpt.zero_grads([ddp], optimizer)
        with megatron_cpu.cuda_as_cpu():  # the schedule counts tokens on "cuda"
            results = schedule(forward_step_func=forward_step,
                               data_iterator=iter([windows(step, dp_rank)]), model=[ddp],
                               num_microbatches=1, seq_length=SHAPE.context,
                               micro_batch_size=BATCH)
        before = _grad_snapshot(ddp)
        gpt.finish_grad_sync([ddp])
        _check_grad_shards_against_core(ddp, before)
        ok, _ = gpt.optimizer_step(optimizer)
        assert ok
        if stage == 1:
            losses.append(float(results[0]["loss"]))
    _assert_replicas_identical([ddp])
    sizes = {g._sdp4bit.groups.size for g in ddp.bucket_groups}
    integration.disable()
    gpt.shutdown()
    return stage, sizes, losses


class LogRecords(logging.Handler):
    """The messages logged to `logger` (by default the ``sdp4bit`` logger) while installed."""

    def __init__(self, logger: logging.Logger | None = None):
        super().__init__(logging.INFO)
        self.messages = []
        self.warnings = []  # those at WARNING or above
        logger = logger or logging.getLogger("sdp4bit")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record):
        self.messages.append(record.getMessage())
        if record.levelno >= logging.WARNING:
            self.warnings.append(record.getMessage())


def route_notice(rank, world, steps):
    """Nodes of unequal size (W = 3 as 2 + 1): each bucket group logs the degraded route once,
    at set-up. Returns (bucket groups, the messages logged)."""
    gpt.initialize(SEED)
    records = LogRecords()
    integration.enable(Config("sdp4bit"), local_world_size=2)
    ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=True, bucket_size=BUCKET)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    for step in range(steps):
        _train_step(ddp, optimizer, step, rank)
    integration.disable()
    gpt.shutdown()
    return len(ddp.bucket_groups), records.messages


def hybrid_sharding(rank, world, preset, knobs, overlap, steps, nan_step=None):
    """W = 4 as 2 distributed-optimizer instances of 2 ranks (one per node), `steps` steps with
    `preset` and `knobs` (None: Megatron's own collectives). After every step the parameters
    are compared across all 4 ranks, both instances; with a compressing preset each
    all-reduce across the instances is compared with the core's in-process one (the shard
    before it from both instances in, this rank's result out), byte for byte. Returns
    (losses, whether every step's parameters were identical on all ranks, (bytes sent,
    uncompressed) in one step, all-reduces compared, whether each step was taken). At
    `nan_step` rank 1 puts a NaN in one of its gradients before the sync."""
    from sdp4bit import CrossGroupAllReduce

    gpt.initialize(SEED, instances=2)
    if preset is not None:
        integration.enable(Config.from_knobs(preset, {"seed": 5, **knobs}), local_world_size=1)
    ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=overlap, bucket_size=BUCKET,
                          num_distributed_optimizer_instances=2)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    compared = []
    original = CrossGroupAllReduce.start

    def checked_start(self, data, step):
        every = [torch.empty_like(data) for _ in range(2)]
        dist.all_gather(every, data.clone(), group=self.groups.dp_group)
        handle = original(self, data, step)
        handle.wait()
        members = dist.get_process_group_ranks(self.groups.dp_group)
        want = torch.ops.sdp4bit.simulate_cross_group_all_reduce(
            self.config.spec(), self.bucket_id, step, members,
            torch.stack(every).float())[members.index(dist.get_rank())].to(data.dtype)
        compared.append(torch.equal(data.view(torch.int32), want.view(torch.int32)))
        return handle

    CrossGroupAllReduce.start = checked_start
    losses, identical, stepped = [], [], []
    try:
        for step in range(steps):
            gpt.zero_grads([ddp], optimizer)
            loss = gpt.token_losses(ddp, windows(step, rank)).mean()
            loss.backward()
            if step == nan_step and rank == 1:
                _poison_one_gradient(ddp)
            gpt.finish_grad_sync([ddp])
            stepped.append(gpt.optimizer_step(optimizer)[0])
            losses.append(loss.item())
            bits = torch.cat([p.view(torch.int16).to(torch.int32)
                              for p in gpt.bucket_params(ddp)])
            every = [torch.empty_like(bits) for _ in range(world)]
            dist.all_gather(every, bits)
            identical.append(all(torch.equal(b, every[0]) for b in every))
    finally:
        CrossGroupAllReduce.start = original
    sent = integration.wire_bytes(ddp, steps) if preset is not None else (0, 0)
    integration.disable()
    gpt.shutdown()
    return losses, all(identical), sent, compared, stepped


def exact_params_notice(rank, world, mode):
    """The GPT at W = 2 with ``exact_params=mode`` (no TP: only norms-biases-embeddings keeps
    anything exact), one step. Returns the WARNING records of the ``sdp4bit`` logger."""
    gpt.initialize(SEED)
    records = LogRecords()
    integration.enable(Config.from_knobs("sdp4bit", {"exact_params": mode}), local_world_size=2)
    ddp = gpt.build_model(SHAPE, SEED, bucket_size=BUCKET)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    _train_step(ddp, optimizer, 0, rank)
    integration.disable()
    gpt.shutdown()
    return records.warnings


#: What sdp4bit refuses when the model is built: (name, build_model options, or the wrapper
#: class to build, and what the error must name).
REFUSED = [
    ("no distributed optimizer", {"use_distributed_optimizer": False},
     "--use-distributed-optimizer"),
    ("fp16 gradient buffers", {"fp16": True, "grad_reduce_in_fp32": False},
     "gradient buffers of torch.float16"),
    ("fp16 parameters under qWD", {"fp16": True}, "['torch.float16']"),
    ("torch FSDP2 inside Megatron", "TorchFullyShardedDataParallel", "--use-torch-fsdp2"),
    ("Megatron-FSDP", "FullyShardedDataParallel", "--use-megatron-fsdp"),
]


def refused_settings(rank, world):
    """Builds a model in each setting of :data:`REFUSED` with sdp4bit enabled, and, as the
    control, with it disabled. Returns, per setting, (name, sdp4bit's error, and what
    happened without sdp4bit: None, or megatron-core's own error)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel)

    wrappers = {cls.__name__: cls for cls in (TorchFullyShardedDataParallel,
                                              FullyShardedDataParallel)}

    gpt.initialize(SEED)
    results = []
    for name, options, _ in REFUSED:
        errors = []
        for enabled in (True, False):
            if enabled:
                integration.enable(Config("sdp4bit"), local_world_size=2)
            try:
                if isinstance(options, dict):
                    gpt.build_model(SHAPE, SEED, bucket_size=BUCKET, **options)
                else:
                    wrappers[options](gpt.transformer_config(SHAPE),
                                      DistributedDataParallelConfig(), torch.nn.Linear(4, 4))
                errors.append(None)
            except Sdp4bitError as error:
                errors.append(str(error))
            except Exception as error:  # noqa: BLE001  (the control: megatron-core's own)
                errors.append(f"not sdp4bit's: {type(error).__name__}: {error}")
            finally:
                integration.disable()
        results.append((name, *errors))
    gpt.shutdown()
    return results


#: The layouts of :func:`copies_across_groups` on W = 4: (TP, PP, sequence parallelism, ranks
#: per node). TP = 2: DP groups {0, 2} and {1, 3}, a rank per node (one level between nodes)
#: or both on one node (one level inside it); PP = 2: stages {0, 1} and {2, 3}, embedding
#: groups {0, 2} and {1, 3}.
LAYOUTS = {"tp": (2, 1, False, 2), "tp-sp": (2, 1, True, 4), "pp": (1, 2, False, 1)}


def _same_across(tensors: list[torch.Tensor], group) -> list[bool]:
    """Whether each of `tensors` holds the same bits on every rank of `group`."""
    bits = torch.cat([t.detach().reshape(-1).view(torch.int16) for t in tensors]).to(torch.int32)
    every = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, bits, group=group)
    same = torch.stack([e == every[0] for e in every]).all(dim=0)
    return [bool(part.all()) for part in same.split([t.numel() for t in tensors])]


def _differing_copies(ddp) -> tuple[list[str], bool]:
    """(the parameters without ``tensor_model_parallel`` whose bits differ across the TP
    group, whether the word embedding tied across pipeline stages differs across the
    embedding group), compared bit for bit."""
    from megatron.core import parallel_state

    named = list(ddp.module.named_parameters())
    replicated = [(n, p) for n, p in named if not getattr(p, "tensor_model_parallel", False)]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    differing = []
    if tp_group.size() > 1:
        same = _same_across([p for _, p in replicated], tp_group)
        differing = [n for (n, _), alike in zip(replicated, same) if not alike]
    tied = [p for _, p in named if getattr(p, "shared_embedding", False)]
    tied_differs = bool(tied) and not all(_same_across(
        tied, parallel_state.get_embedding_group(check_initialized=False)))
    return differing, tied_differs


def _forward_step(first: bool, last: bool):
    """The pipeline schedule's forward step: inputs on the first stage, labels on the last."""

    def forward_step(data_iterator, model):
        data = next(data_iterator)
        positions = torch.arange(SHAPE.context).unsqueeze(0).expand(BATCH, SHAPE.context)
        output = model(data[:, :-1] if first else None, positions,
                       gpt.causal_mask(SHAPE.context), labels=data[:, 1:] if last else None)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    return forward_step


def copies_across_groups(rank, world, layout, variants, steps):
    """Trains each of `variants`, (name, preset or None for Megatron's own collectives, knobs,
    overlap of gradient and parameter syncs), `steps` steps on `layout` (LAYOUTS) as
    Megatron-LM does: megatron-core's schedule, then its finalize_model_grads (the DP gradient
    sync, the sequence-parallel norms' and the tied embedding's all-reduces). The copies
    Megatron keeps identical (:func:`_differing_copies`) are compared as every step's
    finalize starts (every parameter gathered by its forward: the previous step's update) and
    after the last step; sdp4bit's own check (``replica_check_interval=1``) runs there too,
    and a variant ends where it raises. The variant "tied ids differ" numbers the tied
    embedding's bucket apart on the last stage, as before both stages agreed on it. Returns,
    per variant: the comparisons, (step, message) of the check's error or None, the bytes one
    step sent and those of them that went exact, and how many parameters are replicated
    across the TP group."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from sdp4bit import Sdp4bitError, limits

    tp, pp, sequence_parallel, ranks_per_node = LAYOUTS[layout]
    gpt.initialize(SEED, tp=tp, pp=pp)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    dp_rank = parallel_state.get_data_parallel_rank()
    schedule = get_forward_backward_func()
    results = {}
    for name, preset, knobs, overlap in variants:
        if preset is not None:
            integration.enable(Config.from_knobs(preset, {"seed": 5, **knobs}),
                               local_world_size=ranks_per_node, replica_check_interval=1)
        ddp = gpt.build_model(SHAPE, SEED, pre_process=first, post_process=last,
                              sequence_parallel=sequence_parallel, overlap_grad_reduce=overlap,
                              overlap_param_gather=overlap, bucket_size=BUCKET)
        if name.startswith("tied ids differ") and last:
            for bucket in (b for buffer in ddp.buffers for b in buffer.buckets):
                if any(getattr(p, "shared_embedding", False) for p in bucket.params_list):
                    bucket.sdp4bit_bucket_id = limits().max_bucket_id - 1
        optimizer = gpt.build_optimizer([ddp], lr=LR)
        compared = []

        def finalize(*args, **kwargs):
            compared.append(_differing_copies(ddp))
            return finalize_model_grads(*args, **kwargs)

        ddp.config.finalize_model_grads_func = finalize
        check = None
        for step in range(steps):
            gpt.zero_grads([ddp], optimizer)
            try:
                with megatron_cpu.cuda_as_cpu():  # the schedule counts tokens on "cuda"
                    schedule(forward_step_func=_forward_step(first, last),
                             data_iterator=iter([windows(step, dp_rank)]), model=[ddp],
                             num_microbatches=1, seq_length=SHAPE.context,
                             micro_batch_size=BATCH)
            except Sdp4bitError as error:
                check = (step, str(error))
                break
            stepped, _ = gpt.optimizer_step(optimizer)
            assert stepped
        else:
            gpt.flush_param_sync([ddp])
            compared.append(_differing_copies(ddp))
        wire = (0, 0)
        if preset is not None:
            wire = (integration.wire_bytes(ddp, steps - 1)[0],
                    integration.exact_wire_bytes(ddp, steps - 1))
            integration.disable()
        replicated = sum(not getattr(p, "tensor_model_parallel", False)
                         for p in ddp.module.parameters())
        results[name] = {"compared": compared, "check": check, "wire": wire,
                         "replicated": replicated}
    gpt.shutdown()
    return results


def _index(ranges) -> torch.Tensor:
    """One int64 index per element of `ranges` (start, end): the structure exact elements were
    held in before they became ranges, the reference the ranges are compared with."""
    return torch.cat([torch.arange(start, end) for start, end in ranges])


def exact_elements_beside_qwd(rank, world, take_out, steps):
    """One bf16 bucket of 2 x 4096 elements all-gathered with qWD (W = 2) while elements
    in both shards travel exact (megatron_patch's ``ExactElements``), as the integration
    runs them, checked every step: after the compressed all-gather, before the exact values
    are written, the exact elements still hold their values from before it (this rank's own
    0, taken out at set-up and at every step); after, every rank holds every owner's exact
    new values (compared through a per-element index) and the replicas are bit-identical.
    `take_out` False leaves the values in (the control: qWD's differences are then not 0
    there). Returns per step whether the exact elements held their values through the
    compressed all-gather."""
    from megatron_patch.megatron_core import ExactElements
    from sdp4bit import ProcessGroups, WeightAllGather

    groups = ProcessGroups.create(local_world_size=1)
    numel, ranges = 2 * 4096, [(100, 164), (4000, 4200), (8000, 8192)]
    index = _index(ranges)
    params = torch.randn(numel, generator=torch.Generator().manual_seed(3)).bfloat16()
    exact = ExactElements(ranges, rank, numel // world)
    if take_out:
        own = exact.take_own(params)
        all_gather = WeightAllGather(groups, Config("sdp4bit"), params, bucket_id=0)
        exact.put_own(params, own)
    else:
        all_gather = WeightAllGather(groups, Config("sdp4bit"), params, bucket_id=0)
    first = rank * numel // world
    own_index = index[(index >= first) & (index < first + numel // world)]
    noise = torch.Generator().manual_seed(10 + rank)
    held = []
    for step in range(steps):
        local_shard(params, rank, world).sub_(
            1e-2 * torch.randn(numel // world, generator=noise).bfloat16())
        new = params[own_index].clone()
        if take_out:
            pending = exact.start_params(params, dist.group.WORLD)
        before = params[index].clone()
        all_gather.start(params, step).wait()
        held.append(torch.equal(params[index].view(torch.int16),
                                before.view(torch.int16)))
        if take_out:
            exact.finish_params(pending, params)
            every = [None] * world
            dist.all_gather_object(every, new)  # each rank owns another number of them
            assert torch.equal(params[index], torch.cat(every))
            assert _same_across([params], dist.group.WORLD) == [True]
    groups.close()
    return held


#: The 1M-element embedding of :func:`exact_ranges_of_an_embedding`, beside 8,192 elements
#: compressed, in a bucket split over W = 2.
EMBEDDING = 1 << 20


def exact_ranges_of_an_embedding(rank, world):
    """A bucket holding a 1M-element embedding kept exact and a compressed weight, as
    ``ExactElements`` holds them: returns (the bytes the structure holds, pickled, and
    whether it holds a tensor; the bytes one per-element int64 index of the same elements
    takes; the bytes the exact paths send per rank as counted, and as a ring all-reduce of
    an int64-indexed buffer would; whether the gradient sums and gathered values equal those
    of the per-element index)."""
    import pickle

    from megatron_patch.megatron_core import ExactElements
    from sdp4bit.integration import ring_all_reduce_bytes

    numel = EMBEDDING + 8192
    ranges = [(4096, 4096 + EMBEDDING)]
    exact = ExactElements(ranges, rank, numel // world)
    held = len(pickle.dumps(exact))
    holds_tensor = any(isinstance(v, torch.Tensor) for v in vars(exact).values())
    index = _index(ranges)
    index_bytes = index.numel() * index.element_size()
    sent = (exact.wire_bytes(world, 4), exact.wire_bytes(world, 2))
    indexed_sent = (ring_all_reduce_bytes(index.numel(), world, 4),
                    ring_all_reduce_bytes(index.numel(), world, 2))
    shard = numel // world
    first = rank * shard
    mine = index[(index >= first) & (index < first + shard)]
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    own_shard = local_shard(grads, rank, world).clone()
    exact.finish_grads(exact.start_grads(grads, dist.group.WORLD), own_shard)
    every = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(every, grads)
    sums_equal = torch.equal(own_shard[mine - first], torch.stack(every)[:, mine].sum(0))
    params = torch.randn(numel, generator=torch.Generator().manual_seed(7 + rank)).bfloat16()
    new = params[mine].clone()
    exact.finish_params(exact.start_params(params, dist.group.WORLD), params)
    owners = [None] * world
    dist.all_gather_object(owners, new)
    values_equal = torch.equal(params[index], torch.cat(owners))
    return held, holds_tensor, index_bytes, sent, indexed_sent, sums_equal and values_equal
