"""sdp4bit: 4-bit communication for sharded data parallelism.

Compressed versions of the two collectives of ZeRO-style training, over torch.distributed:
the gradient reduce-scatter and the parameter all-gather of flat buckets, run by a Rust core
(SDP4Bit, QSDP, Global-QSGD, ZeRO++-style and uncompressed codecs)::

    groups = sdp4bit.ProcessGroups.create(dp_group)          # once per DP group
    rs = sdp4bit.GradReduceScatter(groups, sdp4bit.Config("sdp4bit"), numel, bucket_id=0)
    handle = rs.start(bucket, shard, step)                    # runs on a background thread
    handle.wait()                                             # shard holds the reduced sum

Integrations: :mod:`sdp4bit.deepspeed` (ZeRO stages 1-3), :mod:`sdp4bit.fsdp` (PyTorch
FSDP2), ``megatron_patch`` (megatron-core's distributed optimizer, Megatron-LM flags and
launcher); the first two are imported when first used as ``sdp4bit.deepspeed`` /
``sdp4bit.fsdp`` (so ``import sdp4bit`` does not import DeepSpeed). The cost model:
``python -m sdp4bit.plan``.
"""

import importlib

from . import _native
from .collectives import CrossGroupAllReduce, GradReduceScatter, Handle, WeightAllGather, WireBytes
from .config import Config, Knob, Limits, Resolved, knobs, limits, presets
from .errors import Sdp4bitError
from .groups import ProcessGroups

_native.load()  # registers torch.ops.sdp4bit and torch.classes.sdp4bit

__all__ = [
    "Config",
    "CrossGroupAllReduce",
    "GradReduceScatter",
    "Handle",
    "Knob",
    "Limits",
    "ProcessGroups",
    "Resolved",
    "Sdp4bitError",
    "WeightAllGather",
    "WireBytes",
    "knobs",
    "limits",
    "presets",
]

#: Subpackages imported on first use (they import their frameworks).
_INTEGRATIONS = ("deepspeed", "fsdp")


def __getattr__(name: str):
    if name in _INTEGRATIONS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
