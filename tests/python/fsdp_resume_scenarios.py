"""Rank code for resuming FSDP2 training with sdp4bit through torch.distributed.checkpoint (DCP),
and for weights loaded between steps: W = 4 as replicate 2 x shard 2 (sdp4bit's default
preset: QSDP weights and TLq-HS gradients in each shard group, Global-QSGD across the
replicas), the three-unit model of fsdp_scenarios, batches that depend on the step and the
rank only. Every step checks that the two replicas hold the same shards, bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import fsdp_scenarios as fs
import sdp4bit.fsdp


class Training:
    """The model and its optimizer as one DCP ``Stateful`` (torchtitan's ``ModelWrapper`` and
    ``OptimizersContainer`` in one), through torch's distributed state-dict helpers."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizer"])


def _mesh(world):
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def _enabled(mesh, seed: int):
    """The model from `seed`, sharded over the mesh's shard dimension, sdp4bit enabled."""
    model = fs.build(seed, mesh=mesh["shard"])
    sdp4bit.fsdp.enable(model, mesh=mesh)
    return model


def _replicas_identical(model, replicate: dist.ProcessGroup) -> bool:
    """Whether this rank's shards equal the other replica's, bit for bit."""
    mine = torch.cat([fs._bits(p.to_local().detach()).reshape(-1).to(torch.int32)
                      for p in model.parameters()])
    every = [torch.empty_like(mine) for _ in range(replicate.size())]
    dist.all_gather(every, mine, group=replicate)
    return all(torch.equal(every[0], other) for other in every[1:])


def _train(model, optimizer, replicate, steps: range) -> list[bool]:
    """Trains `steps` (each its own batch), returns whether the replicas were identical after
    each."""
    identical = []
    for step in steps:
        x, y = fs.batch(torch.Generator().manual_seed(1000 * step + dist.get_rank()))
        (model(x).float() - y).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        identical.append(_replicas_identical(model, replicate))
    return identical


def _full(model) -> list:
    """Every parameter, gathered exactly (DTensor.full_tensor), as numpy arrays (a tensor
    would go back to the test through shared memory this process releases when it exits)."""
    return [p.full_tensor().detach().numpy().copy() for p in model.parameters()]


def _checkpointed(model, optimizer, with_sdp4bit: bool) -> dict:
    """The state dict given to dcp.save / dcp.load: the training state and, with
    `with_sdp4bit`, sdp4bit's (the one line docs/fsdp.md shows)."""
    state_dict = {"training": Training(model, optimizer)}
    if with_sdp4bit:
        state_dict["sdp4bit"] = sdp4bit.fsdp.stateful(model)
    return state_dict


def uninterrupted(rank, world, path, saved_at, steps):
    """Trains `steps` steps from seed 1234 with AdamW, saving a DCP checkpoint to `path` after
    `saved_at` of them, and one without sdp4bit's state beside it (``path-without``). Returns
    (the parameters saved, the final parameters, replicas identical after each step)."""
    mesh = _mesh(world)
    model = _enabled(mesh, 1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    identical = _train(model, optimizer, mesh.get_group(0), range(saved_at))
    dcp.save(_checkpointed(model, optimizer, True), checkpoint_id=path)
    dcp.save(_checkpointed(model, optimizer, False), checkpoint_id=f"{path}-without")
    saved = _full(model)
    identical += _train(model, optimizer, mesh.get_group(0), range(saved_at, steps))
    final = _full(model)
    sdp4bit.fsdp.disable(model)
    return saved, final, identical


def resumed(rank, world, path, saved_at, steps):
    """In fresh processes, a model built from another seed (4321) loads the checkpoint at
    `path` and trains the steps from `saved_at` to `steps`: once loading sdp4bit's state with
    the model's and the optimizer's, once (the control) without it. Returns (the parameters
    loaded, the final parameters, replicas identical after each step, the control's final
    parameters, the error of loading sdp4bit's state from the checkpoint saved without it)."""
    mesh = _mesh(world)
    model = _enabled(mesh, 4321)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        dcp.load(_checkpointed(model, optimizer, True), checkpoint_id=f"{path}-without")
        missing = None
    except CheckpointException as error:  # holding every rank's error
        missing = str(error)
    sdp4bit.fsdp.disable(model)
    results = []
    for with_sdp4bit in (True, False):
        model = _enabled(mesh, 4321)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        dcp.load(_checkpointed(model, optimizer, with_sdp4bit), checkpoint_id=path)
        loaded = _full(model)
        identical = _train(model, optimizer, mesh.get_group(0), range(saved_at, steps))
        results.append((loaded, _full(model), identical))
        sdp4bit.fsdp.disable(model)
    (loaded, final, identical), (_, control, _) = results
    return loaded, final, identical, control, missing


def loaded_between_steps(rank, world, before, after):
    """Trains `before` steps from seed 1234 with SGD (no optimizer state), loads the weights
    of a model built from seed 77 with ``model.load_state_dict``, and trains `after` more.
    Beside it, the continuation as it would run from the loaded weights: a model built from
    seed 77 with sdp4bit's state of the first at the load (its syncs), and the control, the
    same without that state. Returns (the parameters before the load, right after it, the
    loaded model's, the final parameters, replicas identical after each step, the
    continuation's final parameters, the control's)."""
    mesh = _mesh(world)
    replicate = mesh.get_group(0)

    def trained(model, steps):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        return _train(model, optimizer, replicate, steps), _full(model)

    model = _enabled(mesh, 1234)
    identical, before_load = trained(model, range(before))
    source = fs.build(77, mesh=mesh["shard"])
    model.load_state_dict(source.state_dict())
    after_load, syncs = _full(model), sdp4bit.fsdp.stateful(model).state_dict()
    more, final = trained(model, range(before, before + after))
    sdp4bit.fsdp.disable(model)
    continuations = []
    for with_syncs in (True, False):
        fresh = _enabled(mesh, 77)
        if with_syncs:
            sdp4bit.fsdp.stateful(fresh).load_state_dict(syncs)
        continuations.append(trained(fresh, range(before, before + after))[1])
        sdp4bit.fsdp.disable(fresh)
    continued, control = continuations
    return (before_load, after_load, _full(source), final, identical + more, continued,
            control)
