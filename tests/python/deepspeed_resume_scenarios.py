"""Rank code for the DeepSpeed resume tests: ZeRO engines with the "sdp4bit" section saved and
loaded through DeepSpeed's own ``engine.save_checkpoint`` / ``engine.load_checkpoint``, and
weights written outside the optimizer step (DeepSpeed on CPU, gloo)."""

from __future__ import annotations

import os

import torch

from deepspeed_scenarios import HIDDEN, _ds_config, _model, _replicas_identical

TAG = "resume"
ZERO_3 = {"stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0,
          "stage3_max_reuse_distance": 0}


def _engine(rank, world, stage, section, seed):
    """A bf16 AdamW ZeRO engine of `stage` built by sdp4bit's initialize from the test model
    initialised with `seed`. ZeRO 3 without prefetching: the parameter coordinator then
    gathers each module's parameters alone in every step (with prefetching, the buckets a
    step gathers depend on the trace its process recorded in its first step)."""
    import deepspeed

    import sdp4bit.deepspeed as deepspeed_zero

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(seed)
    engine, optimizer, _, _ = deepspeed_zero.initialize(
        model=model, model_parameters=model.parameters(),
        config=_ds_config(stage, 1, section, zero=ZERO_3 if stage == 3 else None))
    return engine, optimizer


def _train_step(engine, rank: int) -> None:
    """One optimizer step on the batch of the engine's global step (so a resumed run sees the
    batches the uninterrupted one saw at the same steps)."""
    g = torch.Generator().manual_seed(1000 * (engine.global_steps + 1) + rank)
    target = torch.randn(HIDDEN, 8, generator=torch.Generator().manual_seed(9)) * HIDDEN**-0.5
    x = torch.randn(8, HIDDEN, generator=g)
    loss = (engine(x.bfloat16()).float() - x @ target).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _weights(engine, optimizer) -> torch.Tensor:
    """This rank's whole model as the forward pass sees it (bf16 bits, gathered exactly under
    ZeRO 3) followed by its fp32 master partition (bits): int32-widened for gloo."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        bf16 = torch.cat([p.detach().reshape(-1).view(torch.int16).to(torch.int32)
                          for p in params])
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None)
    if masters is None:
        masters = optimizer.fp32_partitioned_groups_flat
    fp32 = torch.cat([m.detach().reshape(-1).view(torch.int32) for m in masters])
    return torch.cat([bf16, fp32])


def _bf16_identical(engine) -> bool:
    """Whether every rank holds the same bf16 model (gathered exactly under ZeRO 3)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        bits = torch.cat([p.detach().reshape(-1).view(torch.int16).to(torch.int32)
                          for p in params])
    return _replicas_identical(bits)


def _drop(what: str | None) -> None:
    """The controls: `what` of sdp4bit's state is not restored at load. "counters": the steps
    (the weight references are still re-established); "references": nothing is restored and
    writes outside the step are not looked for (sdp4bit before resume support)."""
    from sdp4bit.deepspeed import checkpoint, zero3, zero12

    if what == "counters":
        for stage in (zero12, zero3):
            restore = stage.restore
            stage.restore = lambda optimizer, state, saved, restore=restore: restore(
                optimizer, state, None)
    elif what == "references":
        checkpoint._restore = lambda optimizer, state, saved: None
        zero12._written_outside_step = lambda optimizer, state: False


def resumable(rank, world, stage, section, seed, steps, save_after=None, directory=None,
              load=False, detour=0, drop=None):
    """Builds the engine from the model initialised with `seed`; with `load`, first trains
    `detour` steps (a best-model reload mid-run) and loads the checkpoint in `directory`
    (missing `drop` of sdp4bit's state: :func:`_drop`); then trains `steps` steps, saving
    the checkpoint to `directory` after step `save_after`. Returns (whether the replicas held
    the same bf16 model after each step, this rank's final weights as bytes)."""
    import sdp4bit.deepspeed as deepspeed_zero

    _drop(drop)
    engine, optimizer = _engine(rank, world, stage, section, seed)
    identical = []
    if load:
        for _ in range(detour):
            _train_step(engine, rank)
        path, _ = engine.load_checkpoint(directory, tag=TAG)
        assert path is not None, "the checkpoint was not loaded"
    for step in range(steps):
        _train_step(engine, rank)
        identical.append(_bf16_identical(engine))
        if step + 1 == save_after:
            engine.save_checkpoint(directory, tag=TAG)
    weights = _weights(engine, optimizer)
    deepspeed_zero.detach(optimizer)
    return identical, weights.numpy().tobytes()


def written_outside_the_step(rank, world, detect=True):
    """ZeRO 2 with qWD: a step, then every rank loads other weights with ``load_state_dict``, a
    step, then rank 0 alone scales its weights in place, a step; with `detect`, then every
    rank scales its weights through ``.data`` (not counted by PyTorch) and calls
    ``resynchronize``, a step. Returns (whether the replicas held the same bf16 model after
    each step, all-gathers run exact because of the writes). `detect` False (the control):
    the writes are not looked for."""
    import sdp4bit.deepspeed as deepspeed_zero
    from sdp4bit.deepspeed import zero12

    if not detect:
        zero12._written_outside_step = lambda optimizer, state: False
    engine, optimizer = _engine(rank, world, 2, {"preset": "sdp4bit", "ranks_per_node": 1}, 1234)
    identical = []
    _train_step(engine, rank)
    identical.append(_bf16_identical(engine))
    engine.module.load_state_dict(_model(77).bfloat16().state_dict())
    _train_step(engine, rank)
    identical.append(_bf16_identical(engine))
    if rank == 0:
        with torch.no_grad():
            for p in engine.module.parameters():
                p.mul_(0.5)
    _train_step(engine, rank)
    identical.append(_bf16_identical(engine))
    if detect:
        for p in engine.module.parameters():
            p.data.mul_(0.5)
        deepspeed_zero.resynchronize(optimizer)
        _train_step(engine, rank)
        identical.append(_bf16_identical(engine))
    resyncs = optimizer._sdp4bit.resyncs
    deepspeed_zero.detach(optimizer)
    return identical, resyncs
