"""Which codecs to use: a preset and typed, documented knobs, validated by the Rust core.

    Config("sdp4bit")                              # the SDP4Bit preset
    Config("sdp4bit", grad_inter_bits=8)           # one knob changed
    Config("baseline", grad_codec="tlq-hs")        # an ablation: TLq-HS gradients only
    Config.from_knobs("sdp4bit", {"seed": "7"})    # knobs as text (flags, config files)

The fields after ``preset`` are the core's knobs, in the core's order (the codecs first:
setting a codec resets that side's knobs to the codec's defaults, then the other knobs apply);
``None`` keeps the preset's (or the chosen codec's) default. Knob names, accepted values and
docs come from the core (``torch.ops.sdp4bit.schema()``) and are never listed again in Python:
:func:`knobs` returns them, ``help(Config)`` shows them, and the Megatron flags and the
DeepSpeed config section are made from them.

Building a config checks the Python types only; the core validates and resolves it (preset,
knob values, combinations) in one call the first time it is asked (:attr:`Config.resolved`,
cached on the frozen config; :meth:`Config.validate`, :meth:`Config.values`, ...), raising
:class:`~sdp4bit.Sdp4bitError` naming the problem. The collectives validate it during their
collective set-up, so a config that is invalid on one rank only fails on every rank at once
(naming that rank) instead of leaving the others waiting.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from . import _native
from .errors import Sdp4bitError, translated_errors


@dataclass(frozen=True)
class Knob:
    """One knob of the core: its name, what it does and the values it accepts (exactly one of
    `names`, `integers` and `range` is set)."""

    name: str
    doc: str
    names: tuple[str, ...] | None = None
    integers: tuple[int, ...] | None = None
    range: tuple[int, int, int] | None = None  # (min, max, multiple of)

    @property
    def type(self) -> type:
        """The Python type of its values: ``str`` for names, ``int`` otherwise."""
        return str if self.names is not None else int

    def accepted(self) -> str:
        """The accepted values, as text for docs and help messages."""
        if self.names is not None:
            return ", ".join(self.names)
        if self.integers is not None:
            return ", ".join(map(str, self.integers))
        low, high, step = self.range
        text = f"{low} to {high}" if high < 2**64 - 1 else f"{low} or more"
        return text + (f", multiple of {step}" if step > 1 else "")


@dataclass(frozen=True)
class Limits:
    """Limits of the core's random-stream numbering."""

    max_bucket_id: int  # bucket ids run from 0 to this
    max_rank: int  # DP ranks run from 0 to this


def _knob(entry: dict) -> Knob:
    values = entry["values"]
    if "names" in values:
        return Knob(entry["name"], entry["doc"], names=tuple(values["names"]))
    if "integers" in values:
        return Knob(entry["name"], entry["doc"], integers=tuple(values["integers"]))
    return Knob(entry["name"], entry["doc"],
                range=(values["min"], values["max"], values["multiple_of"]))


@functools.cache
def knobs() -> tuple[Knob, ...]:
    """Every knob of the core, in the order a config applies them."""
    return tuple(_knob(entry) for entry in _native.schema()["knobs"])


@functools.cache
def presets() -> tuple[str, ...]:
    """The presets' names."""
    return tuple(_native.schema()["presets"])


@functools.cache
def limits() -> Limits:
    """The core's limits on bucket ids and ranks."""
    return Limits(**_native.schema()["limits"])


@dataclass(frozen=True)
class Resolved:
    """A config as the core resolved it, in one call, cached on the :class:`Config`: what the
    integrations ask on every parameter and step, without calling into the core again."""

    weight_codec: str  # e.g. "qwd"; "none" where the all-gather is not compressed
    grad_codec: str  # e.g. "tlq-hs"; "none" where the reduce-scatter is not compressed
    compresses_weights: bool
    compresses_grads: bool  # (from grad_quant_start_step)
    keeps_reference: bool  # every rank keeps the previous weights between steps (qWD)
    grad_quant_start_step: int
    exact_params: str
    values: tuple[tuple[str, str | None], ...]  # every knob's value, None where unused
    canonical: str  # what the fingerprint hashes
    fingerprint: int  # the cross-rank fingerprint (64 bits, unsigned)


class _ConfigMethods:
    """The methods of :class:`Config` (whose fields are made from the core's knobs)."""

    def __post_init__(self) -> None:
        by_name = {knob.name: knob for knob in knobs()}
        for name in by_name:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError(f"sdp4bit: knob {name} takes {by_name[name].accepted()}, "
                                f"got {value!r}")
            if by_name[name].type is str and isinstance(value, int):
                object.__setattr__(self, name, str(value))  # e.g. global_qsgd_bits=8
        if not isinstance(self.preset, str):
            raise TypeError(f"sdp4bit: preset must be a name, got {self.preset!r}")
        for part in (self.preset, *(str(v) for _, v in self.overrides())):
            if any(c in part for c in ";="):
                raise ValueError(f"sdp4bit: config value {part!r} contains ';' or '='")

    @functools.cached_property
    def resolved(self) -> Resolved:
        """The config as the core resolves it (validates it: raises :class:`Sdp4bitError`
        naming the first bad preset, knob or combination); computed once per config."""
        with translated_errors():
            record = json.loads(_native.ops().resolve_config(self.spec()))
        record["values"] = tuple(map(tuple, record["values"]))
        return Resolved(**record)

    def validate(self) -> Config:
        """Checks the config with the core (:attr:`resolved`). Returns the config."""
        self.resolved  # noqa: B018
        return self

    @classmethod
    def from_knobs(cls, preset: str = "sdp4bit", overrides: dict | None = None) -> Config:
        """A config from a preset and knobs given by name, as text or values (flags, config
        files); an unknown knob name raises :class:`Sdp4bitError` naming the known ones."""
        overrides = dict(overrides or {})
        by_name = {knob.name: knob for knob in knobs()}
        unknown = sorted(set(overrides) - set(by_name))
        if unknown:
            raise Sdp4bitError(f"unknown knob(s) {unknown}; known knobs: {sorted(by_name)}")
        typed = {}
        for name, value in overrides.items():
            if by_name[name].type is int and isinstance(value, str) and value.strip().isdigit():
                value = int(value)
            typed[name] = value
        return cls(preset, **typed)

    def overrides(self) -> list[tuple[str, object]]:
        """The knobs set explicitly (not ``None``), in the order the core applies them."""
        return [(knob.name, getattr(self, knob.name)) for knob in knobs()
                if getattr(self, knob.name) is not None]

    def spec(self) -> str:
        """The text form the extension parses: ``preset;knob=value;...``."""
        return ";".join([self.preset, *(f"{k}={v}" for k, v in self.overrides())])

    def values(self) -> dict[str, str | None]:
        """Every knob's effective value as the core reports it (text), ``None`` where the
        configured codecs do not use the knob."""
        return dict(self.resolved.values)

    def codecs(self) -> tuple[str, str]:
        """(weight codec, gradient codec), ``"none"`` where a side is not compressed (e.g.
        ``("qwd", "tlq-hs")`` for the sdp4bit preset)."""
        return self.resolved.weight_codec, self.resolved.grad_codec

    @property
    def compresses_weights(self) -> bool:
        """Whether the parameter all-gather is compressed."""
        return self.resolved.compresses_weights

    @property
    def compresses_grads(self) -> bool:
        """Whether the gradient reduce-scatter is compressed (from ``grad_quant_start_step``)."""
        return self.resolved.compresses_grads

    def describe(self) -> str:
        """The canonical form the core hashes into the cross-rank fingerprint."""
        return self.resolved.canonical

    def fingerprint(self) -> int:
        """The cross-rank fingerprint (64 bits, as an unsigned int)."""
        return self.resolved.fingerprint

    def __repr__(self) -> str:
        knobs_set = "".join(f", {name}={value!r}" for name, value in self.overrides())
        return f"Config({self.preset!r}{knobs_set})"

    def replace(self, **changes) -> Config:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


def _make_config_class() -> type:
    fields = [("preset", str, dataclasses.field(default="sdp4bit"))]
    lines = []
    for knob in knobs():
        fields.append((knob.name, knob.type | None, dataclasses.field(
            default=None, metadata={"doc": knob.doc, "accepts": knob.accepted()})))
        lines.append(f"    {knob.name}: {knob.doc} ({knob.accepted()})")
    cls = dataclasses.make_dataclass("Config", fields, bases=(_ConfigMethods,), frozen=True,
                                     repr=False)
    cls.__module__ = __name__  # where pickle finds it
    cls.__doc__ = (
        "A preset and knob overrides, validated by the Rust core (see the module doc).\n\n"
        f"    preset: one of {', '.join(presets())}\n" + "\n".join(lines) + "\n\n"
        "A knob left at None keeps the preset's value (or, when a codec knob is set, that "
        "codec's default)."
    )
    return cls


#: The codec configuration (see the module docstring); its fields are the core's knobs.
Config = _make_config_class()
