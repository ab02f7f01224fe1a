"""Rank code for tensor parallelism under FSDP2 with sdp4bit: W = 4 as a 2-D (dp 2, tp 2)
mesh, a tiny transformer-style model whose blocks are tensor-parallel over tp (column-wise,
then row-wise, as torchtitan's ``parallelize_llama`` does) with a norm every TP rank holds a
copy of, each block and the root ``fully_shard``-ed over dp."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import sdp4bit.fsdp
from sdp4bit import Sdp4bitError

WIDTH = 64
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Block(nn.Module):
    """Pre-norm feed-forward block: norm, up (column-wise), GELU, down (row-wise, its bias
    replicated over tp)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def mesh_2d(world: int):
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """torchtitan's order: tensor parallelism on each block, then fully_shard over dp per
    block and on the root."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["dp"], mp_policy=POLICY)
    fully_shard(model, mesh=mesh["dp"], mp_policy=POLICY)
    return model


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of data-parallel rank `dp_rank` at `step` (the same on its TP ranks)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(16, 16, generator=g)
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(99)) / 4
    return x, torch.tanh(x @ w)


def tp_replicated(param) -> bool:
    """Whether every TP rank holds a copy of `param` (not sharded over tp)."""
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    return "tp" not in names or not isinstance(param.placements[names.index("tp")], Shard)


def tp_copies_identical(model: nn.Module, tp_group: dist.ProcessGroup) -> bool:
    """Whether this rank's shards of the TP-replicated parameters equal the other TP ranks',
    bit for bit (torch.equal on each)."""
    identical = True
    for param in model.parameters():
        if not tp_replicated(param):
            continue
        mine = param.to_local().detach().contiguous()
        every = [torch.empty_like(mine) for _ in range(tp_group.size())]
        dist.all_gather(every, mine, group=tp_group)
        identical &= all(torch.equal(every[0], other) for other in every[1:])
    return identical


def train(rank, world, config, steps):
    """Trains `steps` with `config` (``None``: FSDP's own collectives); returns (losses,
    TP copies identical after each step, bytes sent and uncompressed). With
    ``exact_params=none`` in `config` (the control) no unit keeps exact elements."""
    mesh = mesh_2d(world)
    torch.manual_seed(1234)
    model = parallelize(Tiny(), mesh)
    if config is not None:
        state = sdp4bit.fsdp.enable(model, config)
        exact = dict(state.config.resolved.values)["exact_params"] == "replicated"
        assert all((s.exact is not None) == exact for _, s, _ in state.units)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = mesh.get_local_rank("dp")
    losses, identical = [], []
    for step in range(steps):
        x, y = batch(step, dp_rank)
        loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        identical.append(tp_copies_identical(model, mesh.get_group("tp")))
    sent = sdp4bit.fsdp.wire_bytes(model)
    if config is not None:
        sdp4bit.fsdp.disable(model)
    return losses, identical, sent


def float8_gathers(rank, world):
    """With a weight codec, parameters bringing their own FSDP all-gather (float8) are
    refused; with weight_codec=none (FSDP gathers them itself) sdp4bit is enabled."""
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(1234)
    model = parallelize(Tiny(), mesh_2d(world))
    block = model.blocks[0]
    assert isinstance(block, FSDPModule)
    fsdp_param = block._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    dtensor = fsdp_param.sharded_param
    dtensor._local_tensor = Float8Like.of(dtensor._local_tensor)
    seen = _expect("blocks.0.norm.weight (Float8Like) brings its own FSDP all-gather "
                   "(fsdp_pre_all_gather", lambda: sdp4bit.fsdp.enable(model))
    sdp4bit.fsdp.enable(model, sdp4bit.fsdp.preset_config("sdp4bit", {"weight_codec": "none"}))
    sdp4bit.fsdp.disable(model)
    return seen


class Float8Like(torch.Tensor):
    """The part of torchao's float8 training tensor FSDP2 looks for: a tensor subclass with
    its own all-gather (FSDP sends what ``fsdp_pre_all_gather`` returns and rebuilds the
    parameter with ``fsdp_post_all_gather``)."""

    @staticmethod
    def of(tensor: torch.Tensor) -> "Float8Like":
        return torch.Tensor._make_subclass(Float8Like, tensor)

    def fsdp_pre_all_gather(self, mesh):
        return (self.to(torch.float8_e4m3fn).view(torch.uint8),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        return data.view(torch.float8_e4m3fn).to(param_dtype), (data,)


def _expect(fragment: str, action) -> str:
    try:
        action()
    except Sdp4bitError as error:
        assert fragment in str(error), f"expected {fragment!r} in: {error}"
        return str(error)
    raise AssertionError(f"no Sdp4bitError containing {fragment!r}")
