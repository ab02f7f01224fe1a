"""PyTorch FSDP2 (``fully_shard``, torch 2.9 and later): sdp4bit's codecs as every unit's
parameter all-gather and gradient reduce-scatter, through FSDP2's custom-collective setters.

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    sdp4bit.fsdp.enable(model)          # QSDP weights, TLq-HS gradients (two levels by node)
    ...                                 # train as usual
    sdp4bit.fsdp.disable(model)         # before torch.distributed.destroy_process_group()

Hybrid sharding (HSDP's layout, as torchtitan runs it: a 2-D mesh, replicate x shard):
shard each unit over the shard dimension and pass the mesh, and sdp4bit all-reduces the
reduce-scattered gradients over the replicate dimension compressed (Global-QSGD integers,
``cross_group_bits``), from FSDP's all-reduce hook::

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"], mp_policy=mp)
    fully_shard(model, mesh=mesh["shard"], mp_policy=mp)
    sdp4bit.fsdp.enable(model, mesh=mesh)

Its gradients are native HSDP's for every ``set_gradient_divide_factor`` and force-sum
setting, and micro-steps under ``set_requires_all_reduce(False)`` make no all-reduce across
the replicas, as under native HSDP (:class:`~sdp4bit.fsdp.comms.UnitAllReduceHook`).

Tensor parallelism (torchtitan's 2-D (dp, tp) mesh: ``parallelize_module`` on each block,
then ``fully_shard(..., mesh=mesh["dp"])``) is served: the units' collectives run
compressed over each dp group, and the elements of parameters every TP rank holds a copy of
(norms, row-wise biases) travel exact beside them, so the copies stay identical
(``exact_params=replicated``, the default; :mod:`sdp4bit.fsdp.tensor_parallel`).

Resume goes through torch.distributed.checkpoint: ``sdp4bit.fsdp.stateful(model)`` is the
``Stateful`` that goes into the state dict ``dcp.save`` / ``dcp.load`` take
(:mod:`sdp4bit.fsdp.state`).

FSDP frees gathered parameters after use, so no rank keeps a previous copy to take qWD's
differences against: the weight codecs here are the direct ones (qsdp, the default, qw,
zeropp, or none), QSDP's own setting: the exact sharded parameters stay with their owner and
the gathers bring every rank the same quantized bytes. The gradient codecs are all of the
core's. A preset given by name reads ``sdp4bit`` as qsdp weights (:func:`preset_config`); a
:class:`~sdp4bit.Config` with qWD weights is refused.

Refused with an error naming the problem, never run uncompressed: an unknown node size
(``ValueError`` naming ``local_world_size``, before any collective), units sharded with FSDP's
native HSDP or replicate() (FSDP's own all-reduce would go uncompressed; shard over the shard
dimension and pass the mesh instead), a unit with an all-reduce hook of its own, hybrid
sharding with tensor parallelism, more than one model-parallel mesh dimension,
``exact_params=norms-biases-embeddings`` (megatron-core only), re-gathers over a smaller
group (``reshard_after_forward=<int>``), and, with a weight codec, parameters with their own
all-gather (float8) and parameters not all-gathered as
bf16.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from ..config import Config
from ..errors import Sdp4bitError
from ..groups import ProcessGroups, node_size
from ..integration import freed_weights_config, refuse_exact_embeddings
from ..telemetry import Telemetry, announce
from ._torch import Unit, fsdp2, units
from .state import State
from .tensor_parallel import exact_ranges, tp_dimension

__all__ = ["State", "disable", "enable", "preset_config", "stateful", "wire_bytes"]

#: The attribute of the model that holds sdp4bit's state.
_ATTRIBUTE = "_sdp4bit_fsdp"


def preset_config(preset: str = "sdp4bit", overrides: dict | None = None) -> Config:
    """A preset and knobs (as for :meth:`Config.from_knobs`) as FSDP reads them: a preset
    whose weight codec is qWD gets QSDP's (qsdp) instead, unless `overrides` names a weight
    codec, and rank 0 logs one line saying so (the rule ZeRO-3 shares, docs/configuration.md).
    Validated."""
    return freed_weights_config(preset, dict(overrides or {}), "FSDP2")


def enable(model: nn.Module, config: Config | str = "sdp4bit", *,
           local_world_size: int | None = None, node_labels: list[int] | None = None,
           telemetry_interval: int = 0, tensorboard_writer=None, first_step: int = 0,
           mesh=None) -> State:
    """Routes every FSDP unit of `model` (a module ``fully_shard`` was applied to, with its
    submodules) through sdp4bit with `config`: a :class:`~sdp4bit.Config`, or a preset name
    read by :func:`preset_config`. Collective: every rank calls it, after ``fully_shard`` and
    before training.

    Nodes come from `node_labels` (one per rank of the shard group) or `local_world_size`
    (default: the launcher's, ``LOCAL_WORLD_SIZE``, ``LOCAL_SIZE`` or SLURM's, checked here
    before any collective). Each unit's collectives are set up when FSDP first calls them,
    with the cross-rank agreement check. Random streams are numbered by gradient syncs from
    `first_step`; a run resumed through torch.distributed.checkpoint continues them from the
    checkpoint instead (:func:`stateful`). Every `telemetry_interval`
    steps (0: never) the quantization error against FSDP's exact collectives and the bytes are
    reported (:mod:`sdp4bit.telemetry`: rank 0 shows them, :func:`~sdp4bit.telemetry.announce`)
    and written to `tensorboard_writer`.

    `mesh`, for hybrid sharding: the 2-D device mesh (replicate, shard) whose shard dimension
    the units are sharded over; the gradients are then all-reduced over its replicate
    dimension with ``cross_group_bits`` (docs/fsdp.md, "Hybrid sharding").
    """
    api = fsdp2()
    config = _fsdp_config(config)
    refuse_exact_embeddings(config, "sdp4bit.fsdp")
    if not isinstance(first_step, int) or first_step < 0:
        raise ValueError(f"sdp4bit: first_step must be a non-negative int, got {first_step!r}")
    if getattr(model, _ATTRIBUTE, None) is not None:
        raise Sdp4bitError("sdp4bit is already enabled on this model; disable() it first")
    found = units(model, api)
    if not found:
        raise Sdp4bitError("this model has no FSDP unit with parameters; apply fully_shard to "
                           "it (and its blocks) before sdp4bit.fsdp.enable")
    if node_labels is None:  # read here, before any collective
        local_world_size = node_size(local_world_size,
                                     "sdp4bit.fsdp.enable(model, local_world_size=...)")
    group = _shard_group(found)
    if config.compresses_weights:
        _refuse_own_all_gathers(found)
    tp_name = _tensor_parallel(found, mesh)
    exact_replicated = dict(config.resolved.values)["exact_params"] == "replicated"
    from . import comms  # its base classes are FSDP2's, whose presence fsdp2() checked

    replicate = _replicate_group(mesh, group, found) if mesh is not None else None
    groups = ProcessGroups.create(group, local_world_size, node_labels)
    with_grads = sum(any(p.requires_grad for p in unit.params()) for unit in found)
    shared = comms.Shared(config, groups, Telemetry(telemetry_interval, tensorboard_writer),
                          units=len(found), units_with_grads=with_grads,
                          quant_start=config.resolved.grad_quant_start_step)
    if replicate is not None:
        compressed = dict(config.resolved.values)["cross_group_bits"] != "exact"
        shared.across = comms.Across(replicate, ProcessGroups.create(
            replicate, node_labels=list(range(replicate.size()))) if compressed else None)
    state = State(shared, [])
    for index, unit in enumerate(found):
        unit_state = comms.UnitState(unit.label, index, shared, next_sync=first_step)
        if tp_name is not None and exact_replicated:
            unit_state.exact = exact_ranges(unit.fsdp_params(), tp_name)
        state.units.append((unit, unit_state, unit.comms()))
        unit.module.set_custom_all_gather(comms.UnitAllGather(unit_state))
        unit.module.set_custom_reduce_scatter(comms.UnitReduceScatter(unit_state, unit))
        if replicate is not None:
            unit.module.set_all_reduce_hook(comms.UnitAllReduceHook(unit_state, unit))
    setattr(model, _ATTRIBUTE, state)
    announce(f"sdp4bit enabled on {len(found)} FSDP units: {config.describe()}")
    return state


def disable(model: nn.Module) -> None:
    """Gives every unit of `model` back the collectives FSDP had and closes sdp4bit's groups.
    Call it on every rank before ``torch.distributed.destroy_process_group()``."""
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        return
    for unit, _, (all_gather, reduce_scatter) in state.units:
        unit.module.set_custom_all_gather(all_gather)
        unit.module.set_custom_reduce_scatter(reduce_scatter)
        if state.shared.across is not None:
            unit.module.set_all_reduce_hook(None)
    delattr(model, _ATTRIBUTE)
    state.groups.close()
    if state.shared.across is not None and state.shared.across.groups is not None:
        state.shared.across.groups.close()


def stateful(model: nn.Module) -> State:
    """sdp4bit's state on `model`, a ``Stateful`` for torch.distributed.checkpoint: put it in
    the state dict that ``dcp.save`` and ``dcp.load`` take, beside the model and the
    optimizer (docs/fsdp.md, "Checkpoints"), and a resumed run continues every unit's random
    streams where the saved run left them."""
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        raise Sdp4bitError("sdp4bit is not enabled on this model: call "
                           "sdp4bit.fsdp.enable(model) before building the checkpoint's state "
                           "dict")
    return state


def wire_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes sent, bytes FSDP's own collectives would have sent) by this rank through the
    units' collectives since :func:`enable`."""
    state = getattr(model, _ATTRIBUTE, None)
    return state.shared.wire.pair() if state is not None else (0, 0)


def _fsdp_config(config: Config | str) -> Config:
    if isinstance(config, str):
        return preset_config(config)
    if not isinstance(config, Config):
        raise TypeError(f"sdp4bit: config must be a sdp4bit.Config or a preset name, got "
                        f"{type(config).__name__}")
    if config.resolved.keeps_reference:
        raise Sdp4bitError(
            "qWD (weight_codec=qwd) needs every rank to keep the previous weights, but FSDP "
            "frees gathered parameters after use; set weight_codec to a direct codec (qsdp, "
            "qw, zeropp or none), or pass the preset by name (sdp4bit.fsdp.enable(model, "
            "'sdp4bit') reads it with qsdp weights)")
    return config


def _refuse_own_all_gathers(found: list[Unit]) -> None:
    """Under a weight codec: refuses parameters bringing their own all-gather (float8)."""
    for unit in found:
        extension = unit.all_gather_extension()
        if extension is not None:
            raise Sdp4bitError(
                f"{unit.label}: parameter {extension} brings its own FSDP all-gather "
                "(fsdp_pre_all_gather, e.g. torchao's Float8Linear with "
                "enable_fsdp_float8_all_gather=True): its float8 bytes are already "
                "compressed and the weight codec cannot quantize them again; set "
                "weight_codec=none (FSDP gathers the float8 bytes itself, the gradients "
                "stay compressed) or enable_fsdp_float8_all_gather=False")


def _tensor_parallel(found: list[Unit], mesh) -> str | None:
    """The TP dimension of the units' parameters (None: none), whose replicated parameters
    then travel exact (:mod:`sdp4bit.fsdp.tensor_parallel`); refuses hybrid sharding with
    TP."""
    meshes = [param.device_mesh for unit in found for param in unit.params()]
    tp_name = tp_dimension(meshes, found[0].shard_dim_names())
    if tp_name is not None and mesh is not None:
        raise Sdp4bitError(
            f"hybrid sharding (sdp4bit.fsdp.enable(mesh=...)) with tensor parallelism over "
            f"{tp_name!r} is not supported: the all-reduce across the replicas would compress "
            "the TP-replicated parameters' gradients differently on each TP rank; shard over "
            "the data-parallel dimension alone (a 2-D (dp, tp) mesh)")
    return tp_name


def _replicate_group(mesh, shard_group: dist.ProcessGroup,
                     found: list[Unit]) -> dist.ProcessGroup:
    """The replicate dimension's group of `mesh` (2-D: replicate, shard), whose shard
    dimension must be the group the units shard over; refuses units with hooks of their own."""
    if getattr(mesh, "ndim", None) != 2:
        raise Sdp4bitError(f"sdp4bit.fsdp.enable(mesh=...) takes the 2-D (replicate, shard) "
                           f"device mesh of hybrid sharding, got {mesh!r}")
    shard_ranks = dist.get_process_group_ranks(mesh.get_group(1))
    if shard_ranks != dist.get_process_group_ranks(shard_group):
        raise Sdp4bitError(
            f"the units are sharded over ranks {dist.get_process_group_ranks(shard_group)}, "
            f"but the mesh's shard dimension (its second) holds {shard_ranks}: shard each unit "
            "over mesh['shard'] (fully_shard(..., mesh=mesh['shard']))")
    for unit in found:
        if unit.all_reduce_hook() is not None:
            raise Sdp4bitError(f"{unit.label} has an all-reduce hook of its own; hybrid "
                               "sharding runs sdp4bit's all-reduce there")
    return mesh.get_group(0)


def _shard_group(found: list[Unit]) -> dist.ProcessGroup:
    """The one process group every unit shards its parameters over."""
    group = ranks = None
    for unit in found:
        mine = unit.shard_group()
        if group is None:
            group, ranks = mine, dist.get_process_group_ranks(mine)
        elif mine is not group and dist.get_process_group_ranks(mine) != ranks:
            raise Sdp4bitError(
                f"{unit.label} is sharded over ranks {dist.get_process_group_ranks(mine)}, "
                f"other units over {ranks}; sdp4bit serves one shard group per model")
    return group
