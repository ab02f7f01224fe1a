"""Rank code for the resume tests: sdp4bit's state through megatron-core's
dist_checkpointing (the model chunk's sharded state dict), and weights loaded outside the
optimizer step (megatron_on_cpu/, as megatron_scenarios.py)."""

from __future__ import annotations

import torch

import megatron_checkpoint
import megatron_gpt as gpt
import megatron_patch.megatron_core as integration
from megatron_scenarios import (BUCKET, LR, SEED, SHAPE, _param_bytes, _replicas_identical,
                                _train_step)
from sdp4bit import Config, Sdp4bitError

#: The seed of the resumed runs' fresh processes: other initial weights and RNG states, which
#: the checkpoint must replace.
OTHER_SEED = SEED + 77


def _replicas_identical_now(ddp) -> bool:
    return all(_replicas_identical(params) for params in gpt.bucket_params(ddp))


def resume(rank, world, steps, save_at, directory, mode):
    """With the sdp4bit preset, through megatron-core's dist_checkpointing: `mode`
    "straight" trains steps [0, steps) and saves after `save_at` of them (the model chunk's
    sharded state dict carries sdp4bit's step counters); "resume" starts from `OTHER_SEED`,
    loads that checkpoint and trains steps [save_at, steps); "resume without steps" does
    the same but leaves sdp4bit's entry out of the load (the control). Returns (losses of the
    steps run, whether the replicas were identical after each, final params)."""
    seed = SEED if mode == "straight" else OTHER_SEED
    gpt.initialize(seed)
    integration.enable(Config.from_knobs("sdp4bit", {"seed": 5}), local_world_size=2)
    ddp = gpt.build_model(SHAPE, seed, overlap_grad_reduce=True, overlap_param_gather=True,
                          bucket_size=BUCKET)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    first = 0
    if mode != "straight":
        without = ("sdp4bit",) if mode == "resume without steps" else ()
        first = megatron_checkpoint.load(directory, ddp, optimizer, without=without)["iteration"]
    losses, identical = [], []
    for step in range(first, steps):
        losses.append(_train_step(ddp, optimizer, step, rank))
        gpt.flush_param_sync([ddp])  # as Megatron-LM does before saving or evaluating
        identical.append(_replicas_identical_now(ddp))
        if mode == "straight" and step + 1 == save_at:
            megatron_checkpoint.save(directory, ddp, optimizer, {"iteration": save_at})
    integration.disable()
    gpt.shutdown()
    return losses, identical, _param_bytes(ddp)


def reload_weights(rank, world, how, steps, reload_at):
    """Trains `steps` steps with the sdp4bit preset; before step `reload_at` the weights after
    step 0 are loaded again on every rank, then the optimizer's main parameters follow
    (``reload_model_params``, as Megatron-LM does after loading weights). `how`:
    "load_state_dict" loads through the model's load_state_dict; "behind its back" copies the
    values into the parameters directly (the control: sdp4bit sees no load, and its qWD
    references are stale); "different on rank 1" loads through load_state_dict but rank 1
    gets other values. Returns (whether the replicas were identical after each step, the
    error sdp4bit raised or None)."""
    gpt.initialize(SEED)
    integration.enable(Config.from_knobs("sdp4bit", {"seed": 5}), local_world_size=2)
    ddp = gpt.build_model(SHAPE, SEED, overlap_grad_reduce=True, bucket_size=BUCKET)
    optimizer = gpt.build_optimizer([ddp], lr=LR)
    identical, saved, error = [], None, None
    try:
        for step in range(steps):
            if step == reload_at:
                weights = {k: v.clone() for k, v in saved.items()}
                if how == "different on rank 1" and rank == 1:
                    next(v for v in weights.values() if v.is_floating_point()).add_(1.0)
                if how == "behind its back":
                    with torch.no_grad():
                        for name, param in ddp.module.module.named_parameters():
                            param.copy_(weights[name])
                else:
                    ddp.load_state_dict(weights, strict=False)
                optimizer.reload_model_params()
            _train_step(ddp, optimizer, step, rank)
            identical.append(_replicas_identical_now(ddp))
            if step == 0:
                saved = {k: v.detach().clone() for k, v in ddp.module.module.state_dict().items()
                         if isinstance(v, torch.Tensor)}
    except Sdp4bitError as raised:
        error = str(raised)
    integration.disable()
    gpt.shutdown()
    return identical, error
