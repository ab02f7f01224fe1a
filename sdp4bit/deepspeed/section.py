"""The ``"sdp4bit"`` section of a DeepSpeed config: read by DeepSpeed's own config loader,
validated by the core, and checked against the ZeRO stage before DeepSpeed builds anything."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, knobs, presets
from ..errors import Sdp4bitError
from ..groups import node_size
from ..integration import freed_weights_config, refuse_exact_embeddings

#: The section's name (top level: DeepSpeed rejects unknown keys in zero_optimization).
SECTION = "sdp4bit"

#: Keys of the section besides the core's knobs.
SETTINGS = ("enabled", "preset", "ranks_per_node", "telemetry_interval")

#: The setting that gives the node size, named by the error when no launcher says it.
RANKS_PER_NODE = f'"{SECTION}": {{"ranks_per_node": N}}'


@dataclass(frozen=True)
class Settings:
    """The parsed section: the codec config, the node size (the section's ``ranks_per_node``,
    else the launcher's: :func:`sdp4bit.groups.node_size`) and how often the bytes are
    reported to DeepSpeed's monitor (optimizer steps; 0: never)."""

    config: Config
    ranks_per_node: int
    telemetry_interval: int = 0


def settings_from_config(ds_config: dict) -> Settings | None:
    """The ``"sdp4bit"`` section of a DeepSpeed config dict, validated, or None when the
    section is absent or ``"enabled": false``. Its keys are ``preset``, ``ranks_per_node``,
    ``telemetry_interval``, ``enabled`` and the core's knobs (:func:`sdp4bit.knobs`); the node
    size is resolved here, so a launcher that does not say it fails now, naming
    ``ranks_per_node``. Raises :class:`Sdp4bitError` naming the problem."""
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
    if _stage(ds_config) == 3:
        config = freed_weights_config(preset, overrides, "ZeRO stage 3")
    else:
        config = Config.from_knobs(preset, overrides).validate()
    refuse_exact_embeddings(config, "the DeepSpeed integration")
    try:
        ranks_per_node = node_size(ranks_per_node, RANKS_PER_NODE)
    except ValueError as error:
        raise Sdp4bitError(str(error)) from None
    return Settings(config, ranks_per_node, telemetry_interval)


def _stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def _is_int_at_least(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def load_config(config) -> dict:
    """A DeepSpeed config as ``deepspeed.initialize`` takes it (a dict, the path of a JSON or
    hjson file, comments allowed, or a base64-encoded string), read by DeepSpeed's own loader,
    so that what DeepSpeed accepts is read the same way and what it refuses raises its error."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def config_argument(arguments: dict):
    """The config a ``deepspeed.initialize`` call passes (`arguments`: its bound arguments),
    found as DeepSpeed finds it: ``config``, else ``config_params``, else the ``args``
    namespace's ``deepspeed_config`` (or the older ``deepscale_config``); None when none."""
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    args = arguments.get("args")
    for name in ("deepspeed_config", "deepscale_config"):
        if config is None and getattr(args, name, None) is not None:
            config = getattr(args, name)
    return config


def check_stage(settings: Settings, ds_config: dict) -> None:
    """Refuses what the configured ZeRO stage cannot do, before DeepSpeed builds anything."""
    stage = _stage(ds_config)
    config = settings.config
    if stage == 3 and config.resolved.keeps_reference:
        raise Sdp4bitError(
            f'"{SECTION}.weight_codec": "qwd" needs every replica to keep the previous weights, '
            'but ZeRO stage 3 frees gathered parameters; set "weight_codec" to "qsdp", "qw", '
            '"zeropp" or "none", or use ZeRO stage 1/2')
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
