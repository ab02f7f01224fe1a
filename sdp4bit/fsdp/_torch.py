"""What sdp4bit uses of PyTorch's FSDP2, found by feature detection rather than by version.

The public part: ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` (torch 2.9
and later) and the ``AllGather`` / ``ReduceScatter`` interfaces they take, which live in a
private module. The private part, read only: each unit's parameter group (which parameters it
manages, and the collectives it had, so that they can be put back). Every access goes through
this module, so a torch that moved something fails here with a message naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import Sdp4bitError

#: Where FSDP2's collective interfaces live.
_API_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_api"
_SETTERS = ("set_custom_all_gather", "set_custom_reduce_scatter")


@dataclass(frozen=True)
class Fsdp2:
    """The FSDP2 classes sdp4bit plugs into."""

    module_class: type  # FSDPModule: what fully_shard turns a module into
    all_gather_base: type  # AllGather: __call__(output, input, group, async_op) and allocate
    reduce_scatter_base: type  # ReduceScatter: __call__(output, input, group, op, async_op)


def fsdp2() -> Fsdp2:
    """FSDP2's classes, or :class:`Sdp4bitError` naming what this torch lacks (torch before 2.9
    has no custom collectives)."""
    missing = []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None
        missing.append("torch.distributed.fsdp.FSDPModule")
    if FSDPModule is not None:
        missing += [f"FSDPModule.{name}" for name in _SETTERS if not hasattr(FSDPModule, name)]
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_api as api

        bases = (api.AllGather, api.ReduceScatter)
    except (ImportError, AttributeError):
        missing.append(f"{_API_MODULE}.AllGather / ReduceScatter")
    if missing:
        raise Sdp4bitError(
            f"sdp4bit.fsdp needs PyTorch 2.9 or later (FSDP2's custom all-gather and "
            f"reduce-scatter); torch {torch.__version__} lacks {', '.join(missing)}")
    return Fsdp2(FSDPModule, *bases)


@dataclass
class Unit:
    """One module ``fully_shard`` was applied to that manages parameters of its own."""

    name: str  # its name in the model ("" for the root)
    module: nn.Module  # the FSDPModule
    param_group: object  # FSDP's FSDPParamGroup of the unit

    @property
    def label(self) -> str:
        """How messages name the unit."""
        return _label(self.name)

    def params(self) -> list[nn.Parameter]:
        """The sharded parameters (DTensors) the unit manages."""
        return [_attribute(p, "sharded_param", "FSDPParam") for p in self.fsdp_params()]

    def fsdp_params(self) -> list:
        """FSDP's FSDPParam of each parameter, in the order of the unit's flat buffers."""
        return list(_attribute(self.param_group, "fsdp_params", "FSDPParamGroup"))

    def shard_dim_names(self) -> tuple:
        """The names of the mesh the unit shards over (empty where unnamed)."""
        mesh_info = _attribute(self.param_group, "mesh_info", "FSDPParamGroup")
        return _attribute(mesh_info, "mesh", "FSDPMeshInfo").mesh_dim_names or ()

    def shard_group(self):
        """The process group the unit shards its parameters over; refuses a unit that also
        replicates them (HSDP, or replicate()), whose all-reduce would go uncompressed."""
        mesh_info = _attribute(self.param_group, "mesh_info", "FSDPParamGroup")
        if _attribute(mesh_info, "replicate_mesh_dim", "DataParallelMeshInfo") is not None:
            kind = "HSDP" if hasattr(mesh_info, "shard_process_group") else "replicate()"
            raise Sdp4bitError(
                f"{self.label} replicates its parameters over a mesh dimension ({kind}); "
                "FSDP's own all-reduce between replicas would go uncompressed: shard over the "
                "1-D shard dimension (fully_shard(..., mesh=mesh['shard'])) and pass the 2-D "
                "mesh to sdp4bit.fsdp.enable(model, mesh=mesh), which all-reduces across the "
                "replicate dimension compressed")
        return _attribute(mesh_info, "shard_process_group", "FSDPMeshInfo")

    def all_gather_extension(self) -> str | None:
        """The name of a parameter whose local tensor brings its own FSDP all-gather
        (``fsdp_pre_all_gather``: torchao's float8 all-gather), with its type; None if
        none does."""
        names = {id(param): name for name, param in self.module.named_parameters()}
        for fsdp_param in self.fsdp_params():
            local = _attribute(fsdp_param, "_sharded_local_tensor", "FSDPParam")
            if hasattr(local, "fsdp_pre_all_gather"):
                name = names.get(id(fsdp_param.sharded_param), "?")
                return f"{self.name + '.' if self.name else ''}{name} ({type(local).__name__})"
        return None

    def all_reduce_hook(self):
        """The hook FSDP runs after the unit's reduce-scatter (``set_all_reduce_hook``), or
        None."""
        return _attribute(self.param_group, "_all_reduce_hook", "FSDPParamGroup")

    def gradient_divide_factor(self) -> float | None:
        """What ``set_gradient_divide_factor`` set (None: not called, FSDP divides by the
        data-parallel size)."""
        return _attribute(self.param_group, "gradient_divide_factor", "FSDPParamGroup")

    def requires_all_reduce(self) -> bool:
        """False while ``set_requires_all_reduce(False)`` holds: native HSDP then keeps the
        reduce-scattered gradients and all-reduces their sum at the next micro-step that
        requires it."""
        return _attribute(self.param_group, "all_reduce_grads", "FSDPParamGroup")

    def comms(self) -> tuple[object, object]:
        """The all-gather and reduce-scatter the unit runs now."""
        return (_attribute(self.param_group, "_all_gather_comm", "FSDPParamGroup"),
                _attribute(self.param_group, "_reduce_scatter_comm", "FSDPParamGroup"))


def units(model: nn.Module, api: Fsdp2) -> list[Unit]:
    """The FSDP units of `model` that manage parameters, in module order (the same on every
    rank); modules ``fully_shard`` left without parameters of their own have no collectives."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, api.module_class):
            continue
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            _unknown("FSDPModule._get_fsdp_state")
        state = get_state()
        # torch 2.15 keeps a list, one group per mesh when shard_placement_fn gives
        # parameters meshes of their own; reading the single group then fails inside torch.
        every_group = getattr(state, "_fsdp_param_groups", None)
        if every_group is not None and len(every_group) > 1:
            raise Sdp4bitError(
                f"{_label(name)} has {len(every_group)} parameter groups (parameters on "
                "meshes of their own, from shard_placement_fn); sdp4bit serves one shard "
                "group per unit and FSDP takes no custom collectives for such a unit")
        group = _attribute(state, "_fsdp_param_group", "FSDPState")
        if group is not None:
            found.append(Unit(name, module, group))
    return found


def _label(name: str) -> str:
    """How messages name the unit at `name` in the model."""
    return f"FSDP unit '{name}'" if name else "the root FSDP unit"


def _attribute(owner: object, name: str, kind: str):
    if not hasattr(owner, name):
        _unknown(f"{kind}.{name}")
    return getattr(owner, name)


def _unknown(what: str):
    raise Sdp4bitError(f"torch {torch.__version__}'s FSDP2 has no {what}, which sdp4bit.fsdp "
                       "reads to find each unit's parameters and collectives; this torch's FSDP2 "
                       "internals are not supported")
