"""sdp4bit's state in DeepSpeed's own checkpoints.

``engine.save_checkpoint`` writes every DP rank's ZeRO optimizer state (``optimizer.state_dict()``)
to that rank's ``zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt``, and ``engine.load_checkpoint``
hands the list of them to ``optimizer.load_state_dict`` (after the module's weights are
loaded); Hugging Face Trainer's ``resume_from_checkpoint`` and ``_load_best_model`` go the same
way. sdp4bit adds its state under the key ``"sdp4bit"`` of that dict and restores it from the
loading rank's entry: what each stage keeps (:func:`.zero12.checkpoint_state`,
:func:`.zero3.checkpoint_state`) and re-establishes at load."""

from __future__ import annotations

import logging

import torch.distributed as dist

from .._patching import Patches
from ..errors import Sdp4bitError
from . import zero3, zero12

#: The key of sdp4bit's state in a ZeRO optimizer's state dict.
KEY = "sdp4bit"
#: The layout of that state; a checkpoint of another layout is refused.
FORMAT = 1

logger = logging.getLogger("sdp4bit")
# One set per optimizer class (a set holds each method name once).
_PATCHES: dict[str, Patches] = {}


def install() -> None:
    """Wraps ``state_dict`` and ``load_state_dict`` of DeepSpeed's ZeRO optimizers (stages
    1/2 and 3); optimizers sdp4bit is not attached to are left to DeepSpeed's own."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        patches = _PATCHES.setdefault(cls.__name__, Patches())
        for name, wrap in (("state_dict", _wrap_state_dict),
                           ("load_state_dict", _wrap_load_state_dict)):
            if not patches.installed(name):
                patches.install(cls, name, wrap(getattr(cls, name)))


def _stage(state):
    """The module of the stage `state` belongs to."""
    return zero3 if isinstance(state, zero3.State) else zero12


def _wrap_state_dict(original):
    def state_dict(self):
        saved = original(self)
        state = getattr(self, "_sdp4bit", None)
        if state is not None:
            saved[KEY] = {"format": FORMAT, **_stage(state).checkpoint_state(state)}
        return saved

    state_dict.__wrapped__ = original
    return state_dict


def _wrap_load_state_dict(original):
    def load_state_dict(self, state_dict_list, *args, **kwargs):
        result = original(self, state_dict_list, *args, **kwargs)
        state = getattr(self, "_sdp4bit", None)
        if state is not None:
            _restore(self, state, _saved_state(self, state_dict_list))
        return result

    load_state_dict.__wrapped__ = original
    return load_state_dict


def _saved_state(optimizer, state_dict_list) -> dict | None:
    """This DP rank's saved sdp4bit state, or None where the checkpoint has none (saved
    without sdp4bit, or a universal checkpoint, which carries no per-rank state)."""
    if not state_dict_list:
        return None
    rank = dist.get_rank(group=optimizer.dp_process_group)
    entry = state_dict_list[rank] if rank < len(state_dict_list) else None
    saved = entry.get(KEY) if isinstance(entry, dict) else None
    if saved is not None and saved.get("format") != FORMAT:
        raise Sdp4bitError(f"this checkpoint's sdp4bit state has format {saved.get('format')!r}; "
                           f"this sdp4bit reads format {FORMAT}")
    return saved


def _restore(optimizer, state, saved: dict | None) -> None:
    """Restores `saved` (every rank must have it, or none) and re-establishes what is
    derived from the loaded weights. Collective."""
    flags = [saved is not None]
    everyone = [None] * dist.get_world_size(optimizer.dp_process_group)
    dist.all_gather_object(everyone, flags, group=optimizer.dp_process_group)
    if len({tuple(f) for f in everyone}) != 1:
        raise Sdp4bitError("some DP ranks' checkpoint files hold sdp4bit state and others do "
                           "not; load a checkpoint saved by one run on every rank")
    if saved is None:
        logger.warning("sdp4bit: the loaded DeepSpeed checkpoint holds no sdp4bit state (saved "
                       "without sdp4bit, or a universal checkpoint): the step counters go on "
                       "from this process's, and the weight references are taken from the "
                       "loaded weights")
    _stage(state).restore(optimizer, state, saved)
