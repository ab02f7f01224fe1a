"""Deprecated alias of :mod:`sdp4bit.deepspeed` (the DeepSpeed integration moved there); it
goes in the next release."""

import warnings

from sdp4bit.deepspeed import (  # noqa: F401
    SECTION,
    attach,
    detach,
    initialize,
    settings_from_config,
    wire_bytes,
)

warnings.warn("megatron_patch.deepspeed_zero moved to sdp4bit.deepspeed; the alias goes in the "
              "next release", DeprecationWarning, stacklevel=2)
