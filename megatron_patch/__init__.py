"""sdp4bit for PyTorch: compressed weight all-gather and gradient reduce-scatter over
torch.distributed, for Megatron-LM's distributed optimizer and DeepSpeed ZeRO.

    groups = Sdp4bitGroups.create(dp_group)                 # once per DP group
    rs = GradReduceScatter(groups, Sdp4bitConfig("sdp4bit"), numel=bucket.numel(), bucket_id=0)
    handle = rs.start(bucket, shard, step)                  # runs on a background thread
    handle.wait()                                           # shard holds the reduced sum
"""

from . import _native
from .collectives import GradReduceScatter, Handle, WeightAllGather, WireBytes
from .config import PRESETS, Sdp4bitConfig
from .errors import Sdp4bitError
from .groups import Sdp4bitGroups

_native.load()  # registers torch.ops.sdp4bit and torch.classes.sdp4bit

__all__ = [
    "PRESETS",
    "GradReduceScatter",
    "Handle",
    "Sdp4bitConfig",
    "Sdp4bitError",
    "Sdp4bitGroups",
    "WeightAllGather",
    "WireBytes",
]
