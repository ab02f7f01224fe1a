"""Which codecs to use: a preset plus knob overrides, validated by the Rust core."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _native
from .errors import translated_errors

#: The presets of SPEC section 6.
PRESETS = ("sdp4bit", "qsdp", "global-qsgd", "zeropp", "baseline")

@dataclass(frozen=True)
class Sdp4bitConfig:
    """A preset and knob overrides, e.g. ``Sdp4bitConfig("sdp4bit", {"weight_bits": 4})``.

    Knobs are applied in order, so ``{"grad_codec": "tlq", ...}`` first resets the gradient
    knobs to that codec's defaults. Invalid names or values raise :class:`Sdp4bitError` when
    the config is validated (``describe()``, or when a collective is set up).
    """

    preset: str = "sdp4bit"
    knobs: dict[str, object] = field(default_factory=dict)

    def spec(self) -> str:
        """The text form the extension parses: ``preset;knob=value;...``."""
        for key, value in self.knobs.items():
            if any(c in f"{key}{value}" for c in ";="):
                raise ValueError(f"sdp4bit knob {key}={value!r} contains ';' or '='")
        return ";".join([self.preset, *(f"{k}={v}" for k, v in self.knobs.items())])

    def describe(self) -> str:
        """The canonical form the Rust core hashes into the cross-rank fingerprint."""
        with translated_errors():
            return _native.ops().describe_config(self.spec())

    def codecs(self) -> tuple[str, str]:
        """(weight codec, gradient codec) names after validation, ``"none"`` where a side is
        not compressed (e.g. ``("qwd", "tlq-hs")`` for the sdp4bit preset)."""
        fields = dict(part.split("=", 1) for part in self.describe().split(";")[1:3])
        return fields["weight"].split("(", 1)[0], fields["grad"].split("(", 1)[0]

    def fingerprint(self) -> int:
        """The cross-rank fingerprint (64 bits, as an unsigned int)."""
        with translated_errors():
            return _native.ops().config_fingerprint(self.spec()) & (2**64 - 1)
