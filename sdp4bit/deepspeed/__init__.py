"""DeepSpeed ZeRO integration: a top-level ``"sdp4bit"`` section of the DeepSpeed config
compresses ZeRO's gradient reduction and its parameter all-gathers.

    import sdp4bit.deepspeed
    engine, optimizer, _, _ = sdp4bit.deepspeed.initialize(model=model, config=ds_config, ...)

or, for code that calls ``deepspeed.initialize`` itself (Hugging Face Trainer, Accelerate),
:func:`install` or the launcher prefix ``python -m sdp4bit.deepspeed SCRIPT`` (also
``deepspeed --module sdp4bit.deepspeed SCRIPT``, ``torchrun -m sdp4bit.deepspeed SCRIPT``).

with, in the config (whatever ``deepspeed.initialize`` takes: a dict, a JSON or hjson file, a
base64 string; read by DeepSpeed's own loader)::

    "sdp4bit": {"preset": "sdp4bit", "ranks_per_node": 8, "grad_inter_bits": 4, ...}

The section takes ``preset``, ``ranks_per_node`` (default: the launcher's, e.g.
``LOCAL_WORLD_SIZE``), ``enabled`` and the core's knobs (:func:`sdp4bit.knobs`). Stages 1 and 2:
:mod:`.zero12`; stage 3: :mod:`.zero3`; sdp4bit's state in DeepSpeed's checkpoints:
:mod:`.checkpoint`; the tested DeepSpeed versions: :mod:`.compat`. Features the integration
does not handle (offload, MoE, ZeRO++'s own quantization, hierarchical partitioning,
``parameter_alignment`` that pads) are refused with an error: nothing falls back to
uncompressed traffic silently. So is model parallelism (an ``mpu`` with tensor or pipeline
parallelism, as Megatron-DeepSpeed passes): its ranks hold copies of parameters (norms, biases,
tied embeddings) that each rank's DP group would compress differently.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys

import torch.distributed as dist

from ..errors import Sdp4bitError
from . import checkpoint, zero3, zero12
from .compat import TESTED_DEEPSPEED, check_deepspeed_version
from .section import (SECTION, Settings, check_stage, config_argument, load_config,
                      settings_from_config)

__all__ = ["SECTION", "TESTED_DEEPSPEED", "Settings", "attach", "detach", "initialize",
           "install", "resynchronize", "settings_from_config", "wire_bytes"]

# Inside sdp4bit's initialize: the engine DeepSpeed builds there gets the section applied.
_INITIALIZING: contextvars.ContextVar = contextvars.ContextVar("sdp4bit_initializing",
                                                               default=False)


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the config's ``"sdp4bit"`` section applied to the ZeRO
    optimizer it builds; same arguments and return value. Every rank must call it. A config
    without the section (or with ``"enabled": false``) runs DeepSpeed's own path untouched."""
    original = _deepspeed_initialize()
    arguments = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    config = config_argument(arguments)
    ds_config = load_config(config) if config is not None else None
    settings = settings_from_config(ds_config) if ds_config is not None else None
    if settings is not None:
        if settings.config.compresses_weights or settings.config.compresses_grads:
            check_deepspeed_version()  # the baseline preset replaces nothing of DeepSpeed's
        check_stage(settings, ds_config)
    token = _INITIALIZING.set(True)
    try:
        result = original(*args, **kwargs)
    finally:
        _INITIALIZING.reset(token)
    if settings is not None:
        from deepspeed.utils import log_dist

        engine = result[0]
        attach(engine.optimizer, settings)
        log_dist(f"sdp4bit enabled for {type(engine.optimizer).__name__}: "
                 f"{settings.config.describe()}", ranks=[0])
        if settings.telemetry_interval:
            _report_bytes(engine, settings.telemetry_interval)
    return result


def _report_bytes(engine, interval: int) -> None:
    """Every `interval` optimizer steps, rank 0 reports the bytes sdp4bit has sent since set-up
    and what ZeRO's own collectives would have sent: as events of DeepSpeed's monitor (the
    config's tensorboard, wandb, csv_monitor or comet; x axis the samples, as DeepSpeed's own
    events) and a log_dist line."""
    from deepspeed.utils import log_dist

    step_engine = engine.step
    reported = [engine.global_steps]

    @functools.wraps(step_engine)
    def step(*args, **kwargs):
        result = step_engine(*args, **kwargs)
        steps = engine.global_steps
        if steps != reported[0] and steps % interval == 0 and engine.global_rank == 0:
            reported[0] = steps
            sent, uncompressed = wire_bytes(engine.optimizer)
            if engine.monitor.enabled:
                engine.monitor.write_events([
                    ("sdp4bit/bytes_sent", sent, engine.global_samples),
                    ("sdp4bit/bytes_uncompressed", uncompressed, engine.global_samples)])
            ratio = f"{uncompressed / sent:.2f}x less" if sent else "nothing sent"
            log_dist(f"sdp4bit step {steps}: {sent:,d} B sent since set-up vs "
                     f"{uncompressed:,d} B ({ratio})", ranks=[0])
        return result

    engine.step = step


def _deepspeed_initialize():
    """DeepSpeed's own ``deepspeed.initialize`` (also after :func:`install`)."""
    import deepspeed

    return getattr(deepspeed.initialize, "sdp4bit_original", deepspeed.initialize)


def install() -> None:
    """Makes ``deepspeed.initialize`` itself apply the config's ``"sdp4bit"`` section, as
    :func:`initialize` does, for code that calls DeepSpeed directly (Hugging Face Trainer,
    Accelerate): ``deepspeed.initialize`` and every module-level name bound to it in an
    imported module (``from deepspeed import initialize``, also ``... as ds_init``) are
    replaced. A reference held elsewhere (a closure, an attribute, a default argument) cannot
    be found; if it builds an engine from a config with an enabled section, DeepSpeed's engine
    raises :class:`Sdp4bitError` before it builds anything instead of running uncompressed.
    ``python -m sdp4bit.deepspeed SCRIPT`` calls it before running SCRIPT. Without the section,
    DeepSpeed's own path runs unchanged."""
    import deepspeed

    original = _deepspeed_initialize()

    @functools.wraps(original)
    def initialize_with_sdp4bit(*args, **kwargs):
        return initialize(*args, **kwargs)

    initialize_with_sdp4bit.sdp4bit_original = original
    for module in list(sys.modules.values()):
        # The module's own namespace: no module-level __getattr__ runs.
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                setattr(module, name, initialize_with_sdp4bit)
    deepspeed.initialize = initialize_with_sdp4bit
    _guard_engine_construction()


def _guard_engine_construction() -> None:
    """Makes DeepSpeed's engine refuse a config with an enabled ``"sdp4bit"`` section when it is
    built outside sdp4bit's initialize (through a reference to DeepSpeed's own taken before
    :func:`install`), before it builds anything."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    build = DeepSpeedEngine.__init__
    if getattr(build, "sdp4bit_guarded", False):
        return

    @functools.wraps(build)
    def guarded(self, *args, **kwargs):
        section = (kwargs.get("config") or {}).get(SECTION) if isinstance(
            kwargs.get("config"), dict) else None
        if (not _INITIALIZING.get() and isinstance(section, dict)
                and section.get("enabled", True) is not False):
            raise Sdp4bitError(
                f'this DeepSpeed config has an enabled "{SECTION}" section, but the engine is '
                "built by a reference to DeepSpeed's own deepspeed.initialize taken before "
                "sdp4bit.deepspeed.install() ran, so sdp4bit would not apply; call install() "
                "(or use python -m sdp4bit.deepspeed) before that reference is taken, or call "
                "sdp4bit.deepspeed.initialize")
        return build(self, *args, **kwargs)

    guarded.sdp4bit_guarded = True
    DeepSpeedEngine.__init__ = guarded


def attach(optimizer, settings: Settings) -> None:
    """Routes `optimizer`'s gradient reduction and parameter all-gathers through sdp4bit: a
    ZeRO stage 1/2 ``DeepSpeedZeroOptimizer`` or a stage 3 ``DeepSpeedZeroOptimizer_Stage3``.
    Collective: every DP rank calls it."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    config = settings.config
    if not (config.compresses_weights or config.compresses_grads):
        return  # the baseline preset: DeepSpeed's own collectives, untouched
    check_deepspeed_version()
    model_parallel = getattr(optimizer, "model_parallel_group", None)
    if model_parallel is not None and dist.get_world_size(model_parallel) > 1:
        raise Sdp4bitError(
            f"this ZeRO optimizer has a model-parallel group of "
            f"{dist.get_world_size(model_parallel)} ranks (the mpu's tensor or pipeline "
            "parallelism): they hold copies of parameters (norms, biases, tied embeddings) "
            "that sdp4bit would compress separately in each rank's DP group, so the copies "
            "would drift apart; sdp4bit's DeepSpeed integration supports data parallelism "
            "only (Megatron models: megatron_patch, whose exact_params keeps them identical)")
    checkpoint.install()
    if type(optimizer) is DeepSpeedZeroOptimizer_Stage3:
        return zero3.attach(optimizer, settings)
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return zero12.attach(optimizer, settings)
    raise Sdp4bitError(f"sdp4bit compresses ZeRO stages 1-3 (DeepSpeedZeroOptimizer, "
                       f"DeepSpeedZeroOptimizer_Stage3); this engine's optimizer is "
                       f"{type(optimizer).__name__}")


def detach(optimizer) -> None:
    """Gives `optimizer` back to DeepSpeed's own collectives and closes sdp4bit's groups. Call
    it on every rank before ``torch.distributed.destroy_process_group()``."""
    state = getattr(optimizer, "_sdp4bit", None)
    if state is None:
        return
    del optimizer._sdp4bit
    (zero3 if isinstance(state, zero3.State) else zero12).detach(optimizer)
    state.groups.close()


def resynchronize(optimizer) -> None:
    """Takes the weights every replica holds now as the weight codec's references (qWD): for
    code that writes a stage 1/2 model's weights in a way PyTorch does not count (through
    ``.data`` or raw memory). Writes it counts (``load_state_dict``, in-place ops on the
    parameters) and DeepSpeed's checkpoint loading are handled without it. Collective: every DP
    rank calls it; raises :class:`Sdp4bitError` if the replicas differ."""
    state = getattr(optimizer, "_sdp4bit", None)
    if isinstance(state, zero12.State) and state.settings.config.compresses_weights:
        zero12.set_up_weights(optimizer)


def wire_bytes(optimizer) -> tuple[int, int]:
    """(bytes sent, bytes the uncompressed collectives would have sent) by this rank through
    sdp4bit's collectives since attach()."""
    state = getattr(optimizer, "_sdp4bit", None)
    return state.wire.pair() if state is not None else (0, 0)
