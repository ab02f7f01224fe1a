"""sdp4bit's state on an FSDP2 model, and its part of a ``torch.distributed.checkpoint`` (DCP)
checkpoint: the :class:`State` is a DCP ``Stateful``, put in the state dict beside the model
and the optimizer (as torchtitan's ``CheckpointManager`` puts its ``Stateful`` objects)::

    state_dict = {"model": ..., "optimizer": ..., "sdp4bit": sdp4bit.fsdp.stateful(model)}
    dcp.save(state_dict, checkpoint_id=path)   # and dcp.load(state_dict, checkpoint_id=path)

What it holds: each unit's next gradient sync, which numbers the random streams of all its
collectives. Nothing else carries over a step: the direct weight codecs FSDP runs keep no
reference to earlier weights, and the core's collectives keep none of earlier gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from ..errors import Sdp4bitError
from ..groups import ProcessGroups
from ._torch import Unit

#: The key of the units' next gradient syncs in :meth:`State.state_dict`.
NEXT_SYNC = "next_sync"


@dataclass
class State:
    """sdp4bit's state on a model (what :func:`~sdp4bit.fsdp.enable` returns)."""

    shared: object  # comms.Shared: config, groups, telemetry, bytes counted
    units: list[tuple[Unit, object, tuple[object, object]]]  # (unit, UnitState, FSDP's comms)

    @property
    def config(self) -> Config:
        return self.shared.config

    @property
    def groups(self) -> ProcessGroups:
        return self.shared.groups

    def state_dict(self) -> dict[str, dict[str, int]]:
        """The next gradient sync of every unit, by module name (``(root)`` for the root):
        ``{"next_sync": {name: sync}}``, the same on every rank (DCP saves it once)."""
        return {NEXT_SYNC: {_key(unit): unit_state.next_sync
                            for unit, unit_state, _ in self.units}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continues every unit's random streams from a checkpoint's :meth:`state_dict`;
        refuses one saved from a model with other FSDP units."""
        saved = state_dict.get(NEXT_SYNC) if isinstance(state_dict, dict) else None
        names = [_key(unit) for unit, _, _ in self.units]
        if not isinstance(saved, dict) or sorted(saved) != sorted(names):
            found = sorted(saved) if isinstance(saved, dict) else saved
            raise Sdp4bitError(
                f"sdp4bit.fsdp.stateful(model).load_state_dict: the checkpoint holds the "
                f"gradient syncs of FSDP units {found}, this model has units {names}; load a "
                "checkpoint saved from this model")
        for unit, _, _ in self.units:
            sync = saved[_key(unit)]
            if not isinstance(sync, int) or isinstance(sync, bool) or sync < 0:
                raise Sdp4bitError(
                    f"sdp4bit.fsdp.stateful(model).load_state_dict: {unit.label}'s next "
                    f"gradient sync is {sync!r}, not a non-negative int")
        for unit, unit_state, _ in self.units:
            unit_state.next_sync = saved[_key(unit)]


def _key(unit: Unit) -> str:
    """The unit's key in :meth:`State.state_dict`: its module name, ``(root)`` for the root."""
    return unit.name or "(root)"
