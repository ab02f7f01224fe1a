"""The ``"sdp4bit"`` section of a DeepSpeed config: parsed, validated by the core, and checked
against the ZeRO stage before DeepSpeed builds anything."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..config import Config, knobs, presets
from ..errors import Sdp4bitError
from ..integration import refuse_exact_embeddings

#: The section's name (top level: DeepSpeed rejects unknown keys in zero_optimization).
SECTION = "sdp4bit"

#: Keys of the section besides the core's knobs.
SETTINGS = ("enabled", "preset", "ranks_per_node", "telemetry_interval")


@dataclass(frozen=True)
class Settings:
    """The parsed section: the codec config, the node size (None: ``LOCAL_WORLD_SIZE``) and
    how often the bytes are reported to DeepSpeed's monitor (optimizer steps; 0: never)."""

    config: Config
    ranks_per_node: int | None = None
    telemetry_interval: int = 0


def settings_from_config(ds_config: dict) -> Settings | None:
    """The ``"sdp4bit"`` section of a DeepSpeed config dict, validated, or None when the
    section is absent or ``"enabled": false``. Its keys are ``preset``, ``ranks_per_node``,
    ``telemetry_interval``, ``enabled`` and the core's knobs (:func:`sdp4bit.knobs`). Raises :class:`Sdp4bitError`
    naming the problem."""
    section = ds_config.get(SECTION)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise Sdp4bitError(f'the "{SECTION}" config section must be an object, got {section!r}')
    knob_names = [knob.name for knob in knobs()]
    unknown = sorted(set(section) - set(knob_names) - set(SETTINGS))
    if unknown:
        raise Sdp4bitError(f'unknown key(s) {unknown} in the "{SECTION}" config section; known: '
                           f"{sorted([*SETTINGS, *knob_names])}")
    enabled = section.get("enabled", True)
    if not isinstance(enabled, bool):
        raise Sdp4bitError(f'"{SECTION}.enabled" must be true or false, got {enabled!r}')
    if not enabled:
        return None
    preset = section.get("preset", "sdp4bit")
    if preset not in presets():
        raise Sdp4bitError(f'"{SECTION}.preset" {preset!r} is not one of {list(presets())}')
    ranks_per_node = section.get("ranks_per_node")
    if ranks_per_node is not None and not _is_int_at_least(ranks_per_node, 1):
        raise Sdp4bitError(f'"{SECTION}.ranks_per_node" must be a positive integer, got '
                           f"{ranks_per_node!r}")
    telemetry_interval = section.get("telemetry_interval", 0)
    if not _is_int_at_least(telemetry_interval, 0):
        raise Sdp4bitError(f'"{SECTION}.telemetry_interval" must be a non-negative integer, got '
                           f"{telemetry_interval!r}")
    overrides = {name: section[name] for name in knob_names if name in section}
    config = Config.from_knobs(preset, overrides).validate()
    refuse_exact_embeddings(config, "the DeepSpeed integration")
    return Settings(config, ranks_per_node, telemetry_interval)


def _is_int_at_least(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def load_config(config) -> dict:
    """A DeepSpeed config given as a dict or a JSON file path, as a dict."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    raise Sdp4bitError(f"a DeepSpeed config must be a dict or a JSON file path, got "
                       f"{type(config).__name__}")


def check_stage(settings: Settings, ds_config: dict) -> None:
    """Refuses what the configured ZeRO stage cannot do, before DeepSpeed builds anything."""
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    config = settings.config
    if stage == 3 and config.resolved.keeps_reference:
        raise Sdp4bitError(
            "qWD (the weight codec of the sdp4bit preset) needs every replica to keep the "
            "previous weights, but ZeRO stage 3 frees gathered parameters; use a direct weight "
            'codec ("weight_codec": "qw", "qsdp" or "zeropp") or ZeRO stage 1/2')
    if stage not in (1, 2, 3) and (config.compresses_weights or config.compresses_grads):
        raise Sdp4bitError(f"sdp4bit compresses ZeRO's collectives; this config has ZeRO stage "
                           f"{stage} (use stage 1 or 2)")
    if config.compresses_weights or config.compresses_grads:
        zero = ds_config.get("zero_optimization", {})
        offloaded = [key for key in ("offload_optimizer", "offload_param")
                     if (zero.get(key) or {}).get("device", "none") not in ("none", None)]
        problems = [f"{key} to {zero[key]['device']}" for key in offloaded]
        problems += [f"ZeRO++'s {key}" for key in ("zero_quantized_weights",
                                                   "zero_quantized_gradients") if zero.get(key)]
        if int(zero.get("zero_hpz_partition_size", 1)) > 1:
            problems.append("ZeRO++'s zero_hpz_partition_size > 1")
        if problems:
            raise Sdp4bitError(
                f"sdp4bit does not compress ZeRO's collectives with {', '.join(problems)} "
                "(zero_optimization); turn them off, or use the baseline preset")
