"""The megatron-core methods the integration replaces, each with its original (installed by
``enable()``, restored by ``disable()``)."""

from __future__ import annotations

from sdp4bit._patching import Patches

#: _ParamAndGradBucketGroup's start_grad_sync / start_param_sync, and
#: DistributedDataParallel's __init__ and finish_grad_sync.
PATCHES = Patches()
#: The bucket group's methods whose names the DDP class's patches also use (finish_grad_sync).
GROUP_PATCHES = Patches()
#: The data-parallel wrappers sdp4bit refuses, by class name (each __init__ in a set of its
#: own: a set names each attribute once).
WRAPPER_PATCHES: dict[str, Patches] = {}


def restore_all() -> None:
    """Puts every original back."""
    PATCHES.restore()
    GROUP_PATCHES.restore()
    for patches in WRAPPER_PATCHES.values():
        patches.restore()
