"""Checkpoints of a megatron-core DDP model and DistributedOptimizer through megatron-core's
own ``dist_checkpointing``, as Megatron-LM writes them (model and optimizer sharded state
dicts, a common part saved once), with the workarounds that megatron-core's torch.optim path
(no apex, no Transformer Engine: torch Adam underneath) needs.

The optimizer's formats (``metadata['distrib_optim_sharding_type']``), megatron-core 0.16.1
and 0.19.2 alike (line numbers 0.16.1 / 0.19.2, all in optimizer/distrib_optimizer.py unless
named):

- ``dp_reshardable`` resumes bit for bit once two bugs are worked around here:
  (1) a never-stepped optimizer cannot load: ``sharded_state_dict(is_loading=True)`` calls
  ``state_dict()`` (:1246,1268 / :1532,1554), which collects torch Adam's per-parameter
  ``step`` and asserts there is exactly one (:641-642 / :838-839), and a fresh torch Adam has
  none; :func:`prime_for_loading` gives each main parameter the state torch Adam creates at
  its first step (step 0, zero moments) first.
  (2) after loading, Adam's step is wrong and shared: ``load_state_dict`` puts one tensor,
  made from the checkpoint's param-group step, into every parameter's state (:819-825 /
  :1026-1032), so torch Adam increments it once per parameter per step; then the
  dp_reshardable parameter state, whose ``step`` entries are not persistent but the loading
  optimizer's own (:1664-1667 / :1953-1956), is copied over it (:940 / :1225).
  :func:`restore_adam_steps` gives each parameter its own step, the checkpoint's.
- ``fully_reshardable`` does not work: (3) at save, the optimizer state is gathered into one
  tensor per buffer without the padding at the end of each bucket (:1118 / :1403) but sliced
  per parameter with offsets into the padded buffer (:1501 / :1790), so every parameter after
  a padded bucket is saved with another one's state; (4) at load, the state of every
  parameter is copied key by key from a source without ``step`` (:2101-2103 skip it) into a
  destination with it (set at :825 / :1032), which raises ``KeyError: 'step'`` (:940 / :1225).
- ``dp_zero_gather_scatter`` (deprecated) fails at load as in (4).
- ``fully_sharded_model_space`` (deprecated, and the default when none is named) fails at
  save: it describes the state with ``ShardedTensor(flattened_range=...)`` (:1748 / :2037),
  which dist_checkpointing rejects (dist_checkpointing/mapping.py:134).

The tests show each of these without sdp4bit (tests/python/megatron_scenarios.py).
"""

from __future__ import annotations

import os

import torch

import megatron_cpu

WORKING_FORMAT = "dp_reshardable"
FORMATS = ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter",
           "fully_sharded_model_space")


def sharded_state_dict(chunk, optimizer, fmt: str, is_loading: bool) -> dict:
    """Megatron-LM's checkpoint layout for one model chunk: ``model`` and ``optimizer``."""
    model = chunk.module.sharded_state_dict()
    with megatron_cpu.cuda_as_cpu():
        optim = optimizer.sharded_state_dict(
            model, is_loading=is_loading, metadata={"distrib_optim_sharding_type": fmt})
    return {"model": model, "optimizer": optim}


def save(directory: str, chunk, optimizer, common: dict, fmt: str = WORKING_FORMAT) -> None:
    """Writes a checkpoint of `chunk` and `optimizer` into `directory` (made if missing) on
    every rank; `common` (plain values, the same on every rank: the iteration, sdp4bit's
    state) is saved once."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    state = sharded_state_dict(chunk, optimizer, fmt, is_loading=False)
    state["common"] = common
    with megatron_cpu.cuda_as_cpu():
        dist_checkpointing.save(state, directory)


def load(directory: str, chunk, optimizer, fmt: str = WORKING_FORMAT,
         without: tuple[str, ...] = ()) -> dict:
    """Loads a checkpoint written by :func:`save` into a freshly built `chunk` and
    `optimizer` (working around bugs 1 and 2), leaving out the model state's entries named in
    `without` (a test's control: a piece of state not restored); returns the common part."""
    from megatron.core import dist_checkpointing

    prime_for_loading(optimizer)
    state = sharded_state_dict(chunk, optimizer, fmt, is_loading=True)
    state["common"] = None
    with megatron_cpu.cuda_as_cpu():
        loaded = dist_checkpointing.load(state, directory)
        for key in without:
            del loaded["model"][key]
        chunk.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(optimizer, loaded["optimizer"])
    return loaded["common"]


def _torch_adam(optimizer) -> torch.optim.Optimizer:
    inner = optimizer.optimizer
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"the workarounds are for torch Adam, not {type(inner).__name__}")
    return inner


def prime_for_loading(optimizer) -> None:
    """Workaround for bug 1: the state torch Adam creates at its first step (step 0, zero
    moments) for every main parameter that has none, so that the DistributedOptimizer's
    ``state_dict()`` finds one step."""
    adam = _torch_adam(optimizer)
    for group in adam.param_groups:
        for param in group["params"]:
            if not adam.state[param]:
                adam.state[param] = {"step": torch.tensor(0.0),
                                     "exp_avg": torch.zeros_like(param),
                                     "exp_avg_sq": torch.zeros_like(param)}


def saved_adam_step(optimizer_state: dict) -> float:
    """The optimizer step a loaded optimizer state dict was saved at (its param groups')."""
    steps = {group["step"] for group in optimizer_state["optimizer"]["param_groups"]}
    if len(steps) != 1:
        raise ValueError(f"param groups saved at different steps: {sorted(steps)}")
    return float(steps.pop())


def restore_adam_steps(optimizer, optimizer_state: dict) -> None:
    """Workaround for bug 2: every parameter its own step tensor, holding the step the
    checkpoint was saved at."""
    step = saved_adam_step(optimizer_state)
    for state in _torch_adam(optimizer).state.values():
        state["step"] = torch.tensor(step)
