"""Rank code for the DeepSpeed tests of how the integration meets DeepSpeed: the config as
DeepSpeed's own loader reads it, ``deepspeed.initialize`` referenced before ``install()``,
``parameter_alignment``, and reentrant activation checkpointing (CPU, gloo)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from deepspeed import initialize as ds_init  # taken before install(), as some scripts do

from deepspeed_scenarios import HIDDEN, _ds_config, _model

#: A DeepSpeed config as an hjson file with comments, which json.load rejects.
HJSON = """{
  // ZeRO 2 in bf16, with the sdp4bit section
  "train_micro_batch_size_per_gpu": 8,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "torch_adam": true}},
  "zero_optimization": {"stage": 2},
  "steps_per_print": 1000000000,
  "sdp4bit": {"preset": "sdp4bit", "ranks_per_node": 1}  # qWD and TLq-HS
}
"""


def _join(rank, world):
    import deepspeed

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")


def _one_step(engine) -> None:
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(5))
    engine.backward(engine(x.bfloat16()).float().pow(2).mean())
    engine.step()


def installed_initialize(rank, world, hjson_path, base64_config):
    """After ``install()``: the module-level alias ``ds_init`` (taken before it) builds ZeRO 2
    from the hjson file `hjson_path` with the section; DeepSpeed's own ``initialize`` builds one
    from `base64_config` (no section); a reference held in a dict since before ``install()``
    is given a config with the section. Returns ((sent, uncompressed) of the first engine,
    whether the second has sdp4bit state, the third's error message)."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero
    from sdp4bit import Sdp4bitError

    _join(rank, world)
    held = {"initialize": deepspeed.initialize}
    deepspeed_zero.install()
    model = _model(1234)
    engine, optimizer, _, _ = ds_init(model=model, model_parameters=model.parameters(),
                                      config=hjson_path)
    _one_step(engine)
    sent = deepspeed_zero.wire_bytes(optimizer)
    deepspeed_zero.detach(optimizer)
    plain = _model(1234)
    engine, optimizer, _, _ = deepspeed.initialize(model=plain, config=base64_config,
                                                   model_parameters=plain.parameters())
    _one_step(engine)
    plain_state = hasattr(optimizer, "_sdp4bit")
    try:
        held["initialize"](model=_model(1234), config=_ds_config(2, 1, {"ranks_per_node": 1}))
    except Sdp4bitError as error:
        return sent, plain_state, str(error)
    raise AssertionError("the reference taken before install() built an engine")


def parameter_alignment_refused(rank, world):
    """ZeRO 2 with ``parameter_alignment`` on a model whose parameters it pads (7 outputs):
    refused when sdp4bit attaches. Returns the error's message."""
    import sdp4bit.deepspeed as deepspeed_zero
    from sdp4bit import Sdp4bitError

    _join(rank, world)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 7), torch.nn.GELU(),
                                torch.nn.Linear(7, 8))
    config = _ds_config(2, 1, {"preset": "sdp4bit", "ranks_per_node": 1},
                        zero={"parameter_alignment": True})
    try:
        deepspeed_zero.initialize(model=model, model_parameters=model.parameters(),
                                  config=config)
    except Sdp4bitError as error:
        return str(error)
    raise AssertionError("parameter_alignment was not refused")


class _PartlyCheckpointed(torch.nn.Module):
    """The test model with its last three modules in a reentrant activation checkpoint when
    `checkpointed` is set."""

    def __init__(self, model: torch.nn.Sequential):
        super().__init__()
        self.first, self.rest = model[0], torch.nn.Sequential(*model[1:])
        self.checkpointed = False

    def forward(self, x):
        hidden = self.first(x)
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self.rest, hidden, use_reentrant=True)
        return self.rest(hidden)


def reentrant_partitions(rank, world, section, hand_over=True):
    """ZeRO 2 in buckets of 5000 elements, DeepSpeed's epilogue run from its gradient hooks
    (``engine.scale(loss).backward()``) without the autograd engine's post-backward callback
    (DeepSpeed's fallback), so that with reentrant checkpointing it runs once per backward
    phase. One batch's backward pass without checkpointing, then with it, no step between.
    Returns (the two gradient partitions, epilogues run by each backward pass).
    `hand_over` False (the control): each phase's partition replaces the earlier ones'."""
    from deepspeed.runtime.base_optimizer import BackwardHookStateManager

    import sdp4bit.deepspeed as deepspeed_zero
    from sdp4bit.deepspeed import zero12

    _join(rank, world)
    BackwardHookStateManager.queue_post_backward_callback = lambda self: False
    if not hand_over:
        zero12._hand_over = lambda optimizer, i, partition, later_phase: None
    model = _PartlyCheckpointed(_model(1234))
    init = deepspeed_zero.initialize if section is not None else ds_init
    engine, optimizer, _, _ = init(model=model, model_parameters=model.parameters(),
                                   config=_ds_config(2, 1, section,
                                                     zero={"reduce_bucket_size": 5000}))
    epilogues = [0]
    epilogue = optimizer.independent_gradient_partition_epilogue

    def counted_epilogue():
        epilogues[0] += 1
        epilogue()

    optimizer.independent_gradient_partition_epilogue = counted_epilogue
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(800 + rank))
    partitions, counts = [], []
    for checkpointed in (False, True):
        model.checkpointed = checkpointed
        epilogues[0] = 0
        loss = engine(x.bfloat16().requires_grad_()).float().pow(2).mean()
        engine.scale(loss).backward()
        grads = optimizer.averaged_gradients[0]
        partition = getattr(grads, "flat_partition", None)
        if partition is None:
            partition = torch.cat([t.reshape(-1) for t in grads])
        partitions.append(partition.float().tolist())
        counts.append(epilogues[0])
    dist.barrier()
    if section is not None:
        deepspeed_zero.detach(optimizer)
    return partitions, counts
