"""What ``enable()`` set up, held for every other module of the integration: the config and
options, the process groups built so far, the DDP models and bucket groups, the resume state.
One instance while sdp4bit is enabled (:func:`current`), None otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field

from sdp4bit import Config, ProcessGroups
from sdp4bit.telemetry import Telemetry


@dataclass
class Settings:
    config: Config
    local_world_size: int | None
    # sdp4bit's process groups, one set per (data-parallel group, instance), by the group's
    # name: the DP group inside an instance, and (with several instances) the group across
    # them (``across:`` and its name). Built when a DDP model is built (groups.py).
    groups: dict[str, ProcessGroups] = field(default_factory=dict)
    next_bucket_id: int = 0
    # Gradient steps to resume bucket groups at, by their first bucket's id (checkpoint.py).
    resume_steps: dict[int, int] = field(default_factory=dict)
    # The training loop's iteration, where it keeps one (Megatron-LM's args.iteration): a
    # bucket group set up after a resume starts counting there.
    iteration: object = None
    telemetry: Telemetry = field(default_factory=lambda: Telemetry(0))
    bucket_groups: list = field(default_factory=list)  # those set up, in set-up order
    models: list = field(default_factory=list)  # DDP models built since enable, in order
    attached: list = field(default_factory=list)  # their chunks' checkpoint hooks (checkpoint.py)
    replica_check_interval: int = 0  # check_replicated_params every N gradient syncs (0: never)
    replica_checks: int = 0  # gradient syncs of the first model so far


_CURRENT: Settings | None = None


def current() -> Settings | None:
    """The settings of the enabled integration, or None while it is disabled."""
    return _CURRENT


def install(settings: Settings | None) -> None:
    """Makes `settings` current (None: disabled)."""
    global _CURRENT
    _CURRENT = settings
