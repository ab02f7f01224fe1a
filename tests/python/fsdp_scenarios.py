"""Rank code for the FSDP2 tests: a small model wrapped with ``fully_shard`` (bf16 parameters,
three units with different reductions), trained with FSDP's own collectives or with
sdp4bit's, every compressed collective checked against the Rust core's in-process one."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import op_calls
import sdp4bit.fsdp
from sdp4bit import Config, Sdp4bitError
from sdp4bit.groups import NODE_SIZE_VARIABLES

WIDTH = 64
FP32_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(2))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(seed: int = 1234, mixed: bool = True, mesh=None, **shard_kwargs) -> nn.Module:
    """The model with three units: block 0 reduces in fp32 (AVG), block 1 in bf16 (AVG, through
    an fp32 copy), the root (embed and head) in fp32 with forced SUM reductions. `mixed` False:
    fp32 parameters everywhere, one policy."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = Net()
    policies = [FP32_REDUCE, BF16_REDUCE, FP32_REDUCE] if mixed else [MixedPrecisionPolicy()] * 3
    for block, policy in zip(model.blocks, policies):
        fully_shard(block, mp_policy=policy, mesh=mesh, **shard_kwargs)
    fully_shard(model, mp_policy=policies[2], mesh=mesh, **shard_kwargs)
    model.set_force_sum_reduction_for_comms(True)
    return model


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, generator=generator)
    teacher = torch.Generator().manual_seed(99)
    w = torch.randn(16, 8, generator=teacher) / 4
    return x, torch.tanh(x @ w)


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def full_params(model: nn.Module) -> bytes:
    """Every parameter, gathered exactly (DTensor.full_tensor), as bytes."""
    return b"".join(p.full_tensor().detach().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for p in model.parameters())


class _SpyReduceScatter(ReduceScatter):
    """Records each call of `inner` (sdp4bit's) with the unit's state before and after."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        unit, step, before = self.inner.state, self.inner.state.step, input_tensor.clone()
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.log.append(("rs", unit, step, before, output_tensor.clone(), op))
        return work


class _SpyAllGather(AllGather):
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        unit, step, before = self.inner.state, self.inner.state.step, input_tensor.clone()
        work = self.inner(output_tensor, input_tensor, group, async_op)
        self.log.append(("ag", unit, step, before, output_tensor.clone(), None))
        return work


def spy(state) -> list:
    """Puts a recorder around every unit's sdp4bit collectives; returns the record."""
    log = []
    for unit, _, _ in state.units:
        all_gather, reduce_scatter = unit.comms()
        unit.module.set_custom_all_gather(_SpyAllGather(all_gather, log))
        unit.module.set_custom_reduce_scatter(_SpyReduceScatter(reduce_scatter, log))
    return log


def _every_rank(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` of every rank, stacked (as int32 for 16-bit data: gloo gathers whole words)."""
    wide = tensor.view(torch.int16).to(torch.int32) if tensor.element_size() == 2 else tensor
    every = [torch.empty_like(wide) for _ in range(dist.get_world_size())]
    dist.all_gather(every, wide)
    if tensor.element_size() == 2:
        every = [e.to(torch.int16).view(tensor.dtype) for e in every]
    return torch.stack(every)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def check_against_core(log: list, config: Config, labels: list[int]) -> int:
    """Every recorded reduce-scatter's output equals the core's in-process reduce-scatter of
    every rank's input (then FSDP's AVG division, then the reduce dtype), and every recorded
    all-gather leaves every rank with the same bytes, the core's in-process all-gather of
    every rank's shard (the exact gather for weight_codec=none); byte for byte. Returns how
    many calls it compared."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = config.spec()
    for kind, unit, step, before, after, op in log:
        if kind == "rs":
            inputs = _every_rank(before).float()
            rs = unit.shared.reduce_scatters.get(before.numel())
            if not config.compresses_grads or step < unit.shared.quant_start:  # FSDP's own
                expected = inputs.sum(0).reshape(world, -1)[rank]
            else:
                expected = torch.ops.sdp4bit.simulate_grad_reduce_scatter(
                    spec, labels, rs.bucket_id, unit.stream_step(step), inputs)[rank]
            if op == dist.ReduceOp.AVG:
                expected.div_(world)
            expected = expected.to(after.dtype)
            assert torch.equal(_bits(after), _bits(expected)), (
                f"unit {unit.label} step {step}: the reduce-scatter differs from the core's")
        else:
            every_after = _every_rank(after)
            assert all(torch.equal(_bits(a), _bits(every_after[0])) for a in every_after), (
                f"unit {unit.label} step {step}: ranks hold different gathered bytes")
            targets = _every_rank(before).reshape(1, -1)
            expected = targets[0]  # weight_codec=none: FSDP's own all-gather
            if config.compresses_weights:
                expected = torch.ops.sdp4bit.simulate_weight_all_gather(
                    spec, labels, unit.shared.all_gathers[after.numel()].bucket_id,
                    unit.stream_step(step), torch.zeros_like(targets[0]), targets)[0, rank]
            assert torch.equal(_bits(after), _bits(expected)), (
                f"unit {unit.label} step {step}: the all-gather differs from the core's")
    compared = len(log)
    log.clear()
    return compared


class RecordingWriter:
    """A tensorboard writer that keeps what it is given."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step):
        self.scalars[(name, step)] = value


def train(rank, world, config, steps, check=False, nan_at=None, enable_kwargs=None):
    """Trains `steps` steps with plain torch AdamW, skipping a step whose gradient norm
    (clip_grad_norm_, as torchtitan computes it) is not finite. `config`: None for FSDP's own
    collectives, else what sdp4bit.fsdp.enable takes (with `enable_kwargs`). `nan_at`: the
    step at which rank 1's batch holds a NaN. Returns a dict of results."""
    model = build()
    state = (None if config is None
             else sdp4bit.fsdp.enable(model, config, **(enable_kwargs or {})))
    log = spy(state) if check else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(500 + rank)
    losses, skipped, compared, nonfinite_shards = [], [], 0, []
    with op_calls.counted() as calls:
        for step in range(steps):
            x, y = batch(g)
            if step == nan_at and rank == 1:
                x[3, 5] = float("nan")
            loss = (model(x).float() - y).pow(2).mean()
            loss.backward()
            if check:
                compared += check_against_core(log, state.config, state.groups.node_labels)
            if step == nan_at:  # before clipping, which scales every gradient by NaN
                nonfinite_shards.append(not all(torch.isfinite(p.grad.to_local()).all()
                                                for p in model.parameters()))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            before = full_params(model) if step == nan_at else None
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped.append(step)
            optimizer.zero_grad()
            if before is not None:
                assert full_params(model) == before, "the skipped step changed the parameters"
            losses.append(mean_over_ranks(loss.item()) if step != nan_at else float("nan"))
    op_calls.assert_none(calls, "during the training steps")
    result = {"losses": losses, "params": full_params(model), "skipped": skipped,
              "compared": compared, "nonfinite_shards": nonfinite_shards,
              "wire": sdp4bit.fsdp.wire_bytes(model)}
    if state is not None:
        result["node_labels"] = state.groups.node_labels
        sdp4bit.fsdp.disable(model)
    return result


def hybrid(rank, world, config, steps, cross_group_bits="8"):
    """W = 4 as replicate 2 x shard 2: each unit sharded over the mesh's shard dimension and
    sdp4bit given the 2-D mesh (`config` None: FSDP's native HSDP on the same mesh, the
    comparison). Every all-reduce over the replicate dimension is compared with the core's
    in-process one, byte for byte; after every step each rank's shards are compared with the
    other replica's. Returns (losses, shards identical across replicas every step, all-reduces
    compared, (bytes sent, uncompressed))."""
    from torch.distributed.device_mesh import init_device_mesh

    from sdp4bit import CrossGroupAllReduce

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if config is None:
        model = build(mesh=mesh)
    else:
        model = build(mesh=mesh["shard"])
        knobs = {"cross_group_bits": cross_group_bits}
        sdp4bit.fsdp.enable(model, sdp4bit.fsdp.preset_config(config, knobs), mesh=mesh)
    replicate = mesh.get_group(0)
    compared = []
    original = CrossGroupAllReduce.start

    def checked_start(self, data, step):
        every = [torch.empty_like(data) for _ in range(2)]
        dist.all_gather(every, data.clone(), group=replicate)
        handle = original(self, data, step)
        handle.wait()
        members = dist.get_process_group_ranks(replicate)
        want = torch.ops.sdp4bit.simulate_cross_group_all_reduce(
            self.config.spec(), self.bucket_id, step, members,
            torch.stack(every).float())[members.index(rank)].to(data.dtype)
        compared.append(torch.equal(_bits(data), _bits(want)))
        return handle

    CrossGroupAllReduce.start = checked_start
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(500 + rank)
    losses, identical = [], []
    try:
        for _ in range(steps):
            x, y = batch(g)
            loss = (model(x).float() - y).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean_over_ranks(loss.item()))
            mine = torch.cat([_bits(p.to_local().detach()).reshape(-1).to(torch.int32)
                              for p in model.parameters()])
            every = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(every, mine, group=replicate)
            identical.append(torch.equal(every[0], every[1]))
    finally:
        CrossGroupAllReduce.start = original
    sent = sdp4bit.fsdp.wire_bytes(model)
    sdp4bit.fsdp.disable(model)
    return losses, all(identical), compared, sent


def own_and_baseline(rank, world, steps):
    """FSDP's own collectives and the baseline preset, each training a fresh model from the
    same start on the same batches; after disable() the units run FSDP's own collectives
    (the objects they had) again. Returns both results."""
    own = train(rank, world, None, steps)
    model = build()
    before = [unit.comms() for unit in sdp4bit.fsdp._torch.units(model, sdp4bit.fsdp.fsdp2())]
    state = sdp4bit.fsdp.enable(model, "baseline")
    assert state.config.codecs() == ("none", "none")
    sdp4bit.fsdp.disable(model)
    after = [unit.comms() for unit in sdp4bit.fsdp._torch.units(model, sdp4bit.fsdp.fsdp2())]
    assert all(a is b for pair_a, pair_b in zip(before, after) for a, b in zip(pair_a, pair_b))
    baseline = train(rank, world, "baseline", steps)
    return own, baseline


def each_codec(rank, world, setups, steps):
    """One fresh model per setup (enable keyword arguments), every collective checked against
    the core for `steps` steps. Returns (codecs, calls compared, wire bytes) per setup."""
    out = []
    for setup in setups:
        config = setup.pop("config")
        result = train(rank, world, config, steps, check=True, enable_kwargs=setup)
        codecs = (config if isinstance(config, Config) else sdp4bit.fsdp.preset_config(config)
                  ).codecs()
        out.append((codecs, result["compared"], result["wire"]))
    return out


def telemetry(rank, world, steps, interval):
    """Trains with telemetry every `interval` steps; returns the recorded scalars."""
    writer = RecordingWriter()
    train(rank, world, "sdp4bit", steps,
          enable_kwargs={"telemetry_interval": interval, "tensorboard_writer": writer})
    return writer.scalars


def _tensor_parallel(mesh) -> nn.Module:
    """The model with each block tensor-parallel over ``mesh["tp"]`` (column-wise, then
    row-wise) and every unit sharded over ``mesh["dp"]``: FSDP2 on a 2-D mesh."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(1234)
    model = Net()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mp_policy=FP32_REDUCE, mesh=mesh["dp"])
    fully_shard(model, mp_policy=FP32_REDUCE, mesh=mesh["dp"])
    return model


def _expect_error(fragment: str, action, kind: type = Sdp4bitError) -> str:
    try:
        action()
    except kind as error:
        assert fragment in str(error), f"expected {fragment!r} in: {error}"
        return str(error)
    raise AssertionError(f"no {kind.__name__} containing {fragment!r}")


def _step(model):
    x, y = batch(torch.Generator().manual_seed(1))
    (model(x).float() - y).pow(2).mean().backward()


def _node_sizes(seen: list) -> None:
    """Without node_labels, enable reads the node size from the launcher: none set, it stops
    naming its argument before any collective (no process group made); DeepSpeed's launcher's
    LOCAL_SIZE gives it."""
    launcher = {name: os.environ.pop(name) for name in NODE_SIZE_VARIABLES if name in os.environ}
    new_group, made = dist.new_group, []

    def counted_new_group(*args, **kwargs):
        made.append(args)
        return new_group(*args, **kwargs)

    dist.new_group = counted_new_group
    try:
        seen.append(_expect_error("set sdp4bit.fsdp.enable(model, local_world_size=...)",
                                  lambda: sdp4bit.fsdp.enable(build()), ValueError))
        assert not made, made
    finally:
        dist.new_group = new_group
    os.environ["LOCAL_SIZE"] = "2"
    try:
        model = build()
        assert sdp4bit.fsdp.enable(model).groups.node_labels == [0, 0, 1, 1]
        sdp4bit.fsdp.disable(model)
    finally:
        del os.environ["LOCAL_SIZE"]
        os.environ.update(launcher)


def refusals(rank, world):
    """What sdp4bit cannot serve stops on every rank with a message naming it (needs W = 4:
    HSDP, and hybrid sharding with tensor parallelism on a 2-D mesh, over 2 x 2 ranks), an unknown node size
    before any collective; nodes of unequal size log the one-level route once. Returns the
    messages."""
    from torch.distributed.device_mesh import init_device_mesh

    seen = []
    _node_sizes(seen)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    seen.append(_expect_error("replicates its parameters over a mesh dimension (HSDP)",
                              lambda: sdp4bit.fsdp.enable(build(mesh=mesh))))
    seen.append(_expect_error("but the mesh's shard dimension (its second) holds",
                              lambda: sdp4bit.fsdp.enable(build(), mesh=mesh)))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    seen.append(_expect_error("hybrid sharding (sdp4bit.fsdp.enable(mesh=...)) with tensor "
                              "parallelism over 'tp' is not supported",
                              lambda: sdp4bit.fsdp.enable(_tensor_parallel(mesh), mesh=mesh)))

    def enable_and_step(model, fragment, config="sdp4bit"):
        sdp4bit.fsdp.enable(model, config)
        try:
            seen.append(_expect_error(fragment, lambda: _step(model)))
        finally:
            sdp4bit.fsdp.disable(model)

    enable_and_step(build(mixed=False), "all-gathers its parameters as ['torch.float32']")
    enable_and_step(build(reshard_after_forward=2), "reshard_after_forward=<int>")
    # Configs that differ between ranks: the first unit's set-up fails on every rank.
    enable_and_step(build(), "config fingerprint", Config("qsdp", seed=rank))
    model = build()
    sdp4bit.fsdp.enable(model)
    seen.append(_expect_error("already enabled", lambda: sdp4bit.fsdp.enable(model)))
    sdp4bit.fsdp.disable(model)

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sdp4bit").addHandler(handler)
    try:
        model = build()
        sdp4bit.fsdp.enable(model, node_labels=[0, 0, 0, 1])
        _step(model)
        sdp4bit.fsdp.disable(model)
    finally:
        logging.getLogger("sdp4bit").removeHandler(handler)
    notices = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(notices) == 1 and "unequal numbers" in notices[0], notices
    return seen
