"""Rank code for the DeepSpeed tests: real DeepSpeed ZeRO engines on CPU (DS_ACCELERATOR=cpu,
gloo), with and without the config's "sdp4bit" section."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

import op_calls

HIDDEN = 64


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(4 * HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, 8),
    )


def _ds_config(stage: int, gas: int, section: dict | None,
               grad_accum_dtype: str | None = None, zero: dict | None = None) -> dict:
    """A bf16 AdamW config; `zero` adds to ``zero_optimization`` (e.g. ``reduce_bucket_size``,
    ``overlap_comm``)."""
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **(zero or {})},
        "steps_per_print": 10**9,
    }
    if section is not None:
        config["sdp4bit"] = section
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return config


def _flat_bits(optimizer) -> torch.Tensor:
    """Every parameter of this rank's replica, as int32-widened bf16 bits (gloo has no int16
    collectives)."""
    if hasattr(optimizer, "bit16_groups_flat"):
        return torch.cat([f.view(torch.int16).to(torch.int32) for f in optimizer.bit16_groups_flat])
    return torch.empty(0, dtype=torch.int32)


def _replicas_identical(bits: torch.Tensor) -> bool:
    every = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(every, bits)
    return all(torch.equal(e, every[0]) for e in every)


def _spy_on_reduce_scatters(optimizer, seen: list):
    """Records each gradient bucket as it enters its compressed reduce-scatter, with the
    events "start"/"wait" of every bucket in the order they happen."""
    for i, group_state in enumerate(optimizer._sdp4bit.per_group):
        for bucket in group_state.buckets:
            rs = bucket.reduce_scatter
            original = rs.start

            def start(buffer, shard, step, rs=rs, i=i, bucket=bucket, original=original):
                seen.append((i, bucket, step, buffer.clone()))
                return original(buffer, shard, step)

            rs.start = start


def _check_partitions_against_core(optimizer, seen: list) -> int:
    """At an accumulation boundary: each group's gradient partition, as the step reads it, is of
    DeepSpeed's accumulation dtype and equals what the Rust core's in-process reduce-scatter
    of every rank's buckets gives (of their fp32 values, rounded to bf16 for bf16 buckets),
    summed over the step's reductions in that dtype and cut into DeepSpeed's partitions, byte
    for byte. Returns how many partitions it compared."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = optimizer._sdp4bit
    labels = state.groups.node_labels
    expected = [torch.zeros(g.partition_size * world, dtype=state.dtype)
                for g in state.per_group]
    summed = set()
    for i, bucket, step, buffer in seen:
        every = [torch.empty_like(buffer) for _ in range(world)]
        dist.all_gather(every, buffer)
        shards = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
            bucket.reduce_scatter.config.spec(), labels, bucket.reduce_scatter.bucket_id, step,
            torch.stack(every).float()).to(buffer.dtype)
        span = bucket.span
        whole = shards.reshape(-1)[:span.hi - span.lo]
        target = expected[i][span.lo:span.hi]
        target.add_(whole) if id(bucket) in summed else target.copy_(whole)
        summed.add(id(bucket))
    for i, group_state in enumerate(state.per_group):
        got = optimizer.averaged_gradients[i].flat_partition
        assert got.dtype == optimizer.gradient_accumulation_dtype, got.dtype
        size = group_state.partition_size
        want = expected[i][rank * size:(rank + 1) * size]
        bits = torch.int32 if got.dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits), want.view(bits)), (
            f"group {i} differs from the core at reduction {seen[-1][2]}")
    seen.clear()
    return len(state.per_group)


def train(rank, world, stage, section, steps, gas=1, check_against_core=False,
          exact_gather_at=None, grad_accum_dtype=None, zero=None):
    """Trains `steps` optimizer steps of `gas` micro-batches; returns (losses, final params as
    bytes, (sent, uncompressed) bytes, partitions compared with the core). `section` None:
    plain deepspeed.initialize; `zero`: more ``zero_optimization`` entries."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    # What a launcher would set (the harness has already joined the gloo group).
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(1234)
    config = _ds_config(stage, gas, section, grad_accum_dtype, zero)
    init = deepspeed.initialize if section is None else deepspeed_zero.initialize
    engine, optimizer, _, _ = init(model=model, model_parameters=model.parameters(),
                                   config=config)
    seen, compared = [], 0
    if check_against_core:
        # The buckets and the shards' sums have DeepSpeed's accumulation dtype: bf16 (the
        # model's) by default, fp32 when the config asks for it; no fp32 copy of a bf16 buffer.
        wanted = torch.float32 if grad_accum_dtype == "fp32" else torch.bfloat16
        assert optimizer._sdp4bit.dtype == wanted, (optimizer._sdp4bit.dtype, wanted)
        _spy_on_reduce_scatters(optimizer, seen)
    g = torch.Generator().manual_seed(500 + rank)
    target = torch.nn.Linear(HIDDEN, 8)
    torch.nn.init.normal_(target.weight, std=HIDDEN**-0.5, generator=torch.Generator().manual_seed(9))
    losses = []
    with op_calls.counted() as calls:
        for step in range(steps):
            for _ in range(gas):
                x = torch.randn(8, HIDDEN, generator=g)
                y = target(x).detach()
                loss = (engine(x.bfloat16()).float() - y).pow(2).mean()
                engine.backward(loss)
                if check_against_core and engine.is_gradient_accumulation_boundary():
                    compared += _check_partitions_against_core(optimizer, seen)
                engine.step()
                losses.append(loss.item())
            if step == exact_gather_at:
                optimizer.update_lp_params()  # DeepSpeed's exact all-gather, outside the step
            assert _replicas_identical(_flat_bits(optimizer)), f"replicas differ after step {step}"
    op_calls.assert_none(calls, "during the training steps")
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    sent = deepspeed_zero.wire_bytes(optimizer)
    deepspeed_zero.detach(optimizer)
    return losses, params.numpy().tobytes(), sent, compared


def first_partition(rank, world, section):
    """ZeRO 2 in buckets of 5000 elements (`section` None: DeepSpeed's own path): one step's
    backward pass. Returns this rank's gradient partition as the step would read it (fp32
    values), and with `section`, per element of it the sum over ranks of the magnitudes
    reduced (|g_j| / W, from every rank's buckets)."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(1234)
    config = _ds_config(2, 1, section, zero={"reduce_bucket_size": 5000})
    init = deepspeed.initialize if section is None else deepspeed_zero.initialize
    engine, optimizer, _, _ = init(model=model, model_parameters=model.parameters(),
                                   config=config)
    seen = []
    if section is not None:
        _spy_on_reduce_scatters(optimizer, seen)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(800 + rank))
    engine.backward(engine(x.bfloat16()).float().pow(2).mean())
    grads = optimizer.averaged_gradients[0]
    partition = getattr(grads, "flat_partition", None)
    if partition is None:
        partition = torch.cat([t.reshape(-1) for t in grads])
    magnitudes = None
    if section is not None:
        size = optimizer._sdp4bit.per_group[0].partition_size
        flat = torch.zeros(size * world)
        for _, bucket, _, buffer in seen:
            every = [torch.empty_like(buffer) for _ in range(world)]
            dist.all_gather(every, buffer)
            total = torch.stack(every).float().abs().sum(0)
            flat[bucket.span.lo:bucket.span.hi] = total[:bucket.span.hi - bucket.span.lo]
        magnitudes = flat[rank * size:(rank + 1) * size]
        deepspeed_zero.detach(optimizer)
    # Plain lists: tensors sent between processes would live in shared memory that ends with
    # the rank.
    return partition.float().tolist(), None if magnitudes is None else magnitudes.tolist()


def reduction_timeline(rank, world, overlap):
    """ZeRO 2 in buckets of 5000 elements with `overlap` as ``overlap_comm``: one step.
    Returns the order of events: ("start", bucket) and ("wait", bucket) of each compressed
    reduce-scatter, ("epilogue",) where the backward pass ends (DeepSpeed's epilogue)."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(1234)
    config = _ds_config(2, 1, {"preset": "sdp4bit", "ranks_per_node": 1},
                        zero={"reduce_bucket_size": 5000, "overlap_comm": overlap})
    engine, optimizer, _, _ = deepspeed_zero.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    events = []
    for k, bucket in enumerate(optimizer._sdp4bit.per_group[0].buckets):
        rs, original = bucket.reduce_scatter, bucket.reduce_scatter.start

        def start(buffer, shard, step, k=k, original=original):
            events.append(("start", k))
            handle = original(buffer, shard, step)
            wait = handle.wait

            def recorded_wait():
                events.append(("wait", k))
                wait()

            handle.wait = recorded_wait
            return handle

        rs.start = start
    epilogue = optimizer.independent_gradient_partition_epilogue

    def recorded_epilogue():
        events.append(("epilogue",))
        epilogue()

    optimizer.independent_gradient_partition_epilogue = recorded_epilogue
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(900 + rank))
    engine.backward(engine(x.bfloat16()).float().pow(2).mean())
    engine.step()
    deepspeed_zero.detach(optimizer)
    return events


LAYERS, WIDTH = 16, 512  # the memory test's model: N = 16 x 512^2 elements


def _tensor_bytes() -> int:
    """Bytes of the storages of every tensor Python can reach (each storage once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory_held(rank, world, section, hold_full_buffer=False):
    """ZeRO 2, overlap_comm, buckets of one layer, on a bf16 model of LAYERS square layers:
    the bytes of every tensor Python can reach, less those before ``initialize``, as the
    second step's backward pass ends (where DeepSpeed's epilogue starts: the reduction's
    buffers are full) and after that step. `hold_full_buffer` (the control) keeps a gradient
    buffer the size of the model from set-up on, as sdp4bit's ZeRO 1/2 path did before it
    reduced by bucket."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(5)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(LAYERS)))
    config = _ds_config(2, 1, section,
                        zero={"reduce_bucket_size": WIDTH * WIDTH, "overlap_comm": True})
    init = deepspeed.initialize if section is None else deepspeed_zero.initialize
    g = torch.Generator().manual_seed(950 + rank)
    before = _tensor_bytes()
    engine, optimizer, _, _ = init(model=model, model_parameters=model.parameters(),
                                   config=config)
    full = torch.zeros(LAYERS * WIDTH * WIDTH, dtype=torch.bfloat16) if (
        hold_full_buffer) else None
    at_epilogue = []
    epilogue = optimizer.independent_gradient_partition_epilogue

    def measured_epilogue():
        at_epilogue.append(_tensor_bytes() - before)
        epilogue()

    optimizer.independent_gradient_partition_epilogue = measured_epilogue
    for _ in range(2):
        loss = engine(torch.randn(8, WIDTH, generator=g).bfloat16()).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    del loss
    after = _tensor_bytes() - before
    if section is not None:
        deepspeed_zero.detach(optimizer)
    del full
    return at_epilogue[-1], after


def nan_skips_the_step(rank, world, stage):
    """bf16 with DeepSpeed's overflow check on and the sdp4bit preset: a NaN in rank 1's batch
    reaches the check on every rank (through the compressed reduce-scatter), which skips that
    step. Returns (skipped steps, whether the parameters changed during the NaN step)."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(1234)
    config = _ds_config(stage, 1, {"preset": "sdp4bit", "ranks_per_node": 1})
    config["bf16"]["check_grad_overflow"] = True
    engine, optimizer, _, _ = deepspeed_zero.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(700 + rank)
    changed = None
    for step in range(3):
        x = torch.randn(8, HIDDEN, generator=g)
        if step == 1 and rank == 1:
            x[2, 3] = float("nan")
        before = _flat_bits(optimizer).clone()
        loss = engine(x.bfloat16()).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step == 1:
            changed = not torch.equal(before, _flat_bits(optimizer))
    skipped = engine.skipped_steps
    deepspeed_zero.detach(optimizer)
    return skipped, changed


def train_stage3(rank, world, section, steps):
    """ZeRO stage 3 with `section`: each compressed parameter gather leaves every rank with the
    same bits and each gradient bucket's partition equals the core's in-process reduce-scatter.
    Returns (losses, (sent, uncompressed) bytes, gathers checked, reductions checked)."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(1234)
    engine, optimizer, _, _ = deepspeed_zero.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(3, 1, section))
    state = optimizer._sdp4bit
    labels = state.groups.node_labels
    counts = {"gathers": 0, "reductions": 0}
    from sdp4bit.deepspeed import zero3

    gather, reduce = zero3._dist_allgather_fn, zero3._reduce_scatter_coalesced

    def checked_gather(input_tensor, output_tensor, group=None):
        handle = gather(input_tensor, output_tensor, group)
        if zero3._FETCHING.get():
            handle.wait()
            assert _replicas_identical(output_tensor.view(torch.int16).to(torch.int32))
            counts["gathers"] += 1
        return handle

    def checked_reduce(tensors, group=None):
        every = [[torch.empty_like(t) for _ in range(world)] for t in tensors]
        for t, gathered in zip(tensors, every):
            dist.all_gather(gathered, t.contiguous())
        outputs = reduce(tensors, group)
        key = tuple(t.numel() for t in tensors)
        entry = state.grad_buckets[key]
        rs, calls = entry.collective, entry.calls
        inputs = torch.zeros(world, rs.numel)
        for r in range(world):  # the interleaved, pre-divided layout of DeepSpeed
            chunks = [-(-t.numel() // world) for t in tensors]
            offset = 0
            for q in range(world):
                for gathered, chunk in zip(every, chunks):
                    piece = gathered[r].reshape(-1)[q * chunk:(q + 1) * chunk]
                    inputs[r, offset:offset + piece.numel()] = piece.float()
                    offset += chunk
        inputs /= world
        expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
            rs.config.spec(), labels, rs.bucket_id, calls - 1, inputs)[rank]
        offset = 0
        for t, out, chunk in zip(tensors, outputs, chunks):
            assert torch.equal(out, expected[offset:offset + out.numel()].to(t.dtype))
            offset += chunk
        counts["reductions"] += 1
        return outputs

    from deepspeed.runtime.zero import partition_parameters, stage3
    partition_parameters._dist_allgather_fn = checked_gather
    stage3.reduce_scatter_coalesced = checked_reduce
    g = torch.Generator().manual_seed(500 + rank)
    target = torch.nn.Linear(HIDDEN, 8)
    torch.nn.init.normal_(target.weight, std=HIDDEN**-0.5, generator=torch.Generator().manual_seed(9))
    losses = []
    try:
        with op_calls.counted() as calls:
            for _ in range(steps):
                x = torch.randn(8, HIDDEN, generator=g)
                loss = (engine(x.bfloat16()).float() - target(x).detach()).pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        op_calls.assert_none(calls, "during the training steps")
    finally:
        partition_parameters._dist_allgather_fn = gather
        stage3.reduce_scatter_coalesced = reduce
    sent = deepspeed_zero.wire_bytes(optimizer)
    deepspeed_zero.detach(optimizer)
    return losses, sent, counts["gathers"], counts["reductions"]


def _zero2_steps(rank, world, steps, initialize=None, section=None, monitor=None):
    """Builds ZeRO 2 with the "sdp4bit" section (the sdp4bit preset, 2 ranks a node, plus
    `section`) through `initialize` (default: sdp4bit.deepspeed.initialize) and DeepSpeed's
    `monitor` config entries, trains `steps` optimizer steps, detaches. Returns this rank's
    (bytes sent through sdp4bit, uncompressed bytes)."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(1234)
    config = _ds_config(2, 1, {"preset": "sdp4bit", "ranks_per_node": 2, **(section or {})})
    config.update(monitor or {})
    engine, optimizer, _, _ = (initialize or deepspeed_zero.initialize)(
        model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(700 + rank)
    for _ in range(steps):
        loss = engine(torch.randn(8, HIDDEN, generator=g).bfloat16()).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    sent = deepspeed_zero.wire_bytes(optimizer)
    deepspeed_zero.detach(optimizer)
    return sent


def route_notice(rank, world):
    """ZeRO 2 on nodes of unequal size (W = 3 as 2 + 1): the degraded route is logged once,
    at set-up. Returns the messages logged to the ``sdp4bit`` logger and those of DeepSpeed's
    logger that name sdp4bit."""
    from deepspeed.utils import logger as deepspeed_logger

    from megatron_scenarios import LogRecords

    records = LogRecords()
    deepspeed_records = LogRecords(deepspeed_logger)
    _zero2_steps(rank, world, 2)
    deepspeed_logger.removeHandler(deepspeed_records)
    return records.messages, [m for m in deepspeed_records.messages if "sdp4bit" in m]


def plain_initialize(rank, world, installed):
    """ZeRO 2 built by DeepSpeed's own ``deepspeed.initialize`` with the "sdp4bit" section, as
    Hugging Face Trainer and Accelerate build it, after :func:`sdp4bit.deepspeed.install` or
    (the control) without. Returns (bytes sent through sdp4bit, uncompressed bytes) over two
    steps."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    if installed:
        deepspeed_zero.install()
    # Looked up at the call, as those libraries do: install() has replaced it by then.
    return _zero2_steps(rank, world, 2, initialize=lambda **kw: deepspeed.initialize(**kw))


def monitor_telemetry(rank, world, csv_dir):
    """ZeRO 2 with ``"telemetry_interval": 2`` and DeepSpeed's csv_monitor writing to
    `csv_dir`: six optimizer steps. Returns this rank's final (bytes sent, uncompressed)."""
    return _zero2_steps(rank, world, 6, section={"telemetry_interval": 2}, monitor={
        "csv_monitor": {"enabled": True, "output_path": csv_dir, "job_name": "job"}})


class TensorParallelMpu:
    """What Megatron-DeepSpeed hands DeepSpeed as ``mpu``: W ranks as TP = 2 (consecutive
    ranks) x DP = W / 2."""

    def __init__(self, rank: int, world: int):
        tp = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        dp = [dist.new_group(list(range(t, world, 2))) for t in range(2)]
        self.tp, self.dp = tp[rank // 2], dp[rank % 2]

    def get_model_parallel_group(self):
        return self.tp

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.tp)

    def get_model_parallel_rank(self):
        return dist.get_rank(self.tp)

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.dp)

    def get_data_parallel_rank(self):
        return dist.get_rank(self.dp)


def model_parallel_refused(rank, world, stage):
    """The sdp4bit section with an mpu of TP = 2: refused once DeepSpeed built the ZeRO
    optimizer. Returns the error's message."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero
    from sdp4bit import Sdp4bitError

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(1234)
    try:
        deepspeed_zero.initialize(model=model, model_parameters=model.parameters(),
                                  config=_ds_config(stage, 1, {"preset": "qsdp"}),
                                  mpu=TensorParallelMpu(rank, world))
    except Sdp4bitError as error:
        return str(error)
    raise AssertionError("model parallelism was not refused")
