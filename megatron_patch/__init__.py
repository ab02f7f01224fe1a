"""sdp4bit for Megatron: megatron-core's distributed optimizer with compressed collectives.

- :mod:`megatron_patch.megatron_core`: ``enable(config)`` patches megatron-core's bucket
  groups so that their reduce-scatter and all-gather go through :mod:`sdp4bit`;
- :mod:`megatron_patch.arguments`: the ``--sdp4bit*`` flags of Megatron-LM scripts;
- ``python -m megatron_patch SCRIPT``: runs an unmodified Megatron-LM script with the flags
  (:mod:`megatron_patch.launcher`).

The library itself (config, process groups, collectives, DeepSpeed, the cost model) is the
``sdp4bit`` package. The names this package exported before it moved there
(``Sdp4bitConfig``, ``Sdp4bitGroups``, ``GradReduceScatter``, ``WeightAllGather``, ``Handle``,
``WireBytes``, ``Sdp4bitError``, ``PRESETS``) and the modules ``megatron_patch.deepspeed_zero``
and ``megatron_patch.plan`` remain as deprecated aliases for one release.
"""

from __future__ import annotations

import warnings


def _deprecated_config(preset: str = "sdp4bit", knobs: dict | None = None):
    """``Sdp4bitConfig(preset, knobs)``: :meth:`sdp4bit.Config.from_knobs`."""
    import sdp4bit

    return sdp4bit.Config.from_knobs(preset, knobs)


def _presets():
    import sdp4bit

    return sdp4bit.presets()


# old name -> (where it lives now, how to get it)
_MOVED = {
    "Sdp4bitConfig": ("sdp4bit.Config (or Config.from_knobs)", lambda: _deprecated_config),
    "Sdp4bitGroups": ("sdp4bit.ProcessGroups", lambda: __import__("sdp4bit").ProcessGroups),
    "GradReduceScatter": ("sdp4bit.GradReduceScatter",
                          lambda: __import__("sdp4bit").GradReduceScatter),
    "WeightAllGather": ("sdp4bit.WeightAllGather", lambda: __import__("sdp4bit").WeightAllGather),
    "Handle": ("sdp4bit.Handle", lambda: __import__("sdp4bit").Handle),
    "WireBytes": ("sdp4bit.WireBytes", lambda: __import__("sdp4bit").WireBytes),
    "Sdp4bitError": ("sdp4bit.Sdp4bitError", lambda: __import__("sdp4bit").Sdp4bitError),
    "PRESETS": ("sdp4bit.presets()", _presets),
}


def __getattr__(name: str):
    if name in _MOVED:
        where, get = _MOVED[name]
        warnings.warn(f"megatron_patch.{name} moved to {where}; the alias goes in the next "
                      "release", DeprecationWarning, stacklevel=2)
        return get()
    raise AttributeError(f"module 'megatron_patch' has no attribute {name!r}")
