"""Hugging Face Trainer: sdp4bit's numbers in the Trainer's logs, so every ``report_to``
integration (tensorboard, wandb, mlflow, ...) and ``trainer.state.log_history`` get them.

    sdp4bit.huggingface.add_callback(trainer)

Every log the Trainer writes then carries, for this rank's compressed collectives since
DeepSpeed built the engine, ``sdp4bit/bytes_sent``, ``sdp4bit/bytes_uncompressed`` (what
ZeRO's own collectives would have sent) and ``sdp4bit/bytes_saved``, and the weight error
``sdp4bit/weight_rel_l2_error``: the relative L2 distance between this rank's part of the
weights the forward pass uses (after the compressed all-gather, bf16) and the optimizer's
fp32 master weights of that part (DeepSpeed ZeRO 1/2; ZeRO 3 logs the bytes only). A config
whose section asks for compression on an engine built without sdp4bit stops the job when
training starts.
"""

from __future__ import annotations

import torch.distributed as dist
from transformers import TrainerCallback

from .deepspeed import SECTION, settings_from_config, wire_bytes
from .errors import Sdp4bitError

PREFIX = "sdp4bit/"


def add_callback(trainer) -> Sdp4bitCallback:
    """Adds a :class:`Sdp4bitCallback` to `trainer` ahead of its other callbacks, so that the
    reporting integrations (which read the log in their own ``on_log``) see its numbers."""
    callback = Sdp4bitCallback()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


class Sdp4bitCallback(TrainerCallback):
    """Adds sdp4bit's numbers to each log of the Trainer (see the module's docstring). It must
    run before the reporting callbacks: add it with :func:`add_callback`. When training starts
    it stops the job if the DeepSpeed config asks for compression but DeepSpeed built the
    engine without sdp4bit (neither ``python -m sdp4bit.deepspeed`` nor ``install()``)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        config = _deepspeed_config(args)
        settings = settings_from_config(config) if config is not None else None
        compresses = settings is not None and (settings.config.compresses_weights
                                               or settings.config.compresses_grads)
        if compresses and _zero_optimizer(optimizer) is None:
            raise Sdp4bitError(
                f'the DeepSpeed config has an enabled "{SECTION}" section, but DeepSpeed built '
                "the Trainer's engine without sdp4bit, so nothing is compressed: launch with "
                "python -m sdp4bit.deepspeed (torchrun -m sdp4bit.deepspeed) or call "
                "sdp4bit.deepspeed.install() before the Trainer builds the engine")

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        zero = _zero_optimizer(optimizer)
        if zero is None or logs is None:
            return
        sent, uncompressed = wire_bytes(zero)
        values = {f"{PREFIX}bytes_sent": sent,
                  f"{PREFIX}bytes_uncompressed": uncompressed,
                  f"{PREFIX}bytes_saved": uncompressed - sent}
        error = weight_error(zero)
        if error is not None:
            values[f"{PREFIX}weight_rel_l2_error"] = error
        logs.update(values)
        # The Trainer appends a copy of the log to its history before the callbacks run.
        if state.log_history and all(state.log_history[-1].get(key) == value
                                     for key, value in logs.items() if key not in values):
            state.log_history[-1].update(values)


def _deepspeed_config(args) -> dict | None:
    """The DeepSpeed config the Trainer runs with: TrainingArguments' ``deepspeed``, or that
    of ``accelerate launch``'s DeepSpeed plugin; None without DeepSpeed."""
    given = getattr(args, "hf_deepspeed_config", None)
    if given is not None:
        return given.config
    from accelerate.state import AcceleratorState, is_initialized

    plugin = AcceleratorState().deepspeed_plugin if is_initialized() else None
    return plugin.deepspeed_config if plugin is not None else None


def _zero_optimizer(optimizer):
    """The ZeRO optimizer sdp4bit is attached to, inside the wrappers Accelerate puts around
    it; None when sdp4bit is not (the Trainer without DeepSpeed, the baseline preset)."""
    seen = 0
    while optimizer is not None and seen < 8:
        if getattr(optimizer, "_sdp4bit", None) is not None:
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def weight_error(zero) -> float | None:
    """Relative L2 distance between this rank's partition of the bf16 weights and the fp32
    master weights of that partition (ZeRO 1/2); None for an optimizer without them."""
    masters = getattr(zero, "single_partition_of_fp32_groups", None)
    partitions = getattr(zero, "parallel_partitioned_bit16_groups", None)
    if masters is None or partitions is None:
        return None
    diff_sq = ref_sq = 0.0
    for i, (master, parts) in enumerate(zip(masters, partitions)):
        weights = parts[dist.get_rank(group=zero.real_dp_process_group[i])]
        exact = master.detach().double()
        diff_sq += float((weights.detach().double() - exact).pow(2).sum())
        ref_sq += float(exact.pow(2).sum())
    return (diff_sq / ref_sq) ** 0.5 if ref_sq > 0 else 0.0
