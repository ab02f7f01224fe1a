"""megatron-core's GPTModel, DDP and DistributedOptimizer, built and stepped on CPU the way
Megatron-LM's pretrain_gpt.py does on GPUs (local layer spec: no Transformer Engine, no apex).

Shared by the multi-process tests, the main job (examples/gpt_cpu/train.py) and the
convergence study; on the CPU it relies on the shims of :mod:`megatron_cpu`, which
:func:`initialize` installs. :func:`initialize` can instead put megatron-core on a CUDA device
(the main job's ``--device cuda``), where it runs natively, without shims, as Megatron-LM runs
it. Byte-level language modelling: a vocabulary of 256, tokens are bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

import megatron_cpu

VOCAB = 256

#: Where :func:`initialize` put megatron-core: the CPU (with the shims) or a CUDA device.
_DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class Shape:
    """A GPT's size: context length, hidden width, transformer layers, attention heads."""

    context: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4


def initialize(seed: int, tp: int = 1, pp: int = 1, device: str | torch.device = "cpu",
               instances: int = 1) -> None:
    """After ``torch.distributed.init_process_group``: on the CPU the shims, on a CUDA `device`
    that device made current (megatron-core allocates its buffers and optimizer scratch on the
    current device, as Megatron-LM's initialize sets it); then megatron-core's model parallel
    groups (DP = world / (tp * pp), in `instances` distributed-optimizer instances) and its
    RNG states, seeded as Megatron-LM seeds them."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    global _DEVICE
    _DEVICE = torch.device(device)
    if _DEVICE.type == "cpu":
        megatron_cpu.install()
    else:
        torch.cuda.set_device(_DEVICE)
    parallel_state.initialize_model_parallel(
        tp, pp, num_distributed_optimizer_instances=instances)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Destroys megatron-core's process groups (before ``destroy_process_group``)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def _cuda_as_cpu():
    """The scoped CPU shim (:func:`megatron_cpu.cuda_as_cpu`) on the CPU; nothing on a CUDA
    device, where megatron-core's CUDA calls are real."""
    return megatron_cpu.cuda_as_cpu() if _DEVICE.type == "cpu" else contextlib.nullcontext()


def transformer_config(shape: Shape, sequence_parallel: bool = False, fp16: bool = False):
    """The model's config, with the parallel sizes :func:`initialize` set up (as Megatron-LM
    fills them in from its flags: the tied embedding and sequence parallelism read them); bf16
    unless `fp16` (Megatron-LM's --fp16)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    dtype = torch.float16 if fp16 else torch.bfloat16
    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.width, num_attention_heads=shape.heads,
        bf16=not fp16, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=_DEVICE.type == "cpu", hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
    )


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm for megatron-core under sequence parallelism, which its fallback
    without Apex or Transformer Engine (``WrappedTorchNorm``, ``transformer/torch_norm.py:32 /
    50``) refuses: as Apex's FusedLayerNorm does, each rank normalises its part of the sequence
    and the weight and bias are marked ``sequence_parallel``, so that finalize_model_grads sums
    their gradients over the tensor-parallel group."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel


def _layer_spec(layers: int, sequence_parallel: bool):
    """megatron-core's local layer spec; with sequence parallelism, the spec of a block of
    `layers` such layers whose norms (the final one too) are :class:`SequenceParallelLayerNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec()
    if not sequence_parallel:
        return spec
    norms = {"input_layernorm": SequenceParallelLayerNorm,
             "pre_mlp_layernorm": SequenceParallelLayerNorm}
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **norms))
    return TransformerBlockSubmodules(layer_specs=[layer] * layers,
                                      layer_norm=SequenceParallelLayerNorm)


def build_model(shape: Shape, seed: int, pre_process: bool = True, post_process: bool = True,
                sequence_parallel: bool = False, fp16: bool = False, **ddp_options):
    """A bf16 (or `fp16`) GPTModel (learned absolute positions, the output layer tied to the word
    embedding, as Megatron-LM ties them by default: across the first and the last pipeline
    stage when they are different) in ``Float16Module`` and megatron-core's DDP with the
    distributed optimizer's buffers; `sequence_parallel` with tensor parallelism (and one
    pipeline stage); `ddp_options` go to ``DistributedDataParallelConfig`` (e.g.
    ``overlap_grad_reduce``, ``overlap_param_gather``, ``bucket_size``; fp32 gradient buffers
    unless ``grad_reduce_in_fp32=False``; the distributed optimizer's unless
    ``use_distributed_optimizer=False``). The same `seed` gives every data-parallel replica
    the same initial weights. On a CUDA device the model is moved there before wrapping, as
    Megatron-LM's get_model does (the layers megatron-core does not allocate itself, e.g. the
    position embedding and layer norms, start on the CPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(shape, sequence_parallel, fp16)
    torch.manual_seed(seed)
    # The scoped shim: the last stage copies the tied embedding with Tensor.cuda() before
    # it all-reduces it from the first stage.
    with _cuda_as_cpu():
        gpt = GPTModel(config, _layer_spec(shape.layers, sequence_parallel), vocab_size=VOCAB,
                       max_sequence_length=shape.context, pre_process=pre_process,
                       post_process=post_process, share_embeddings_and_output_weights=True)
    if _DEVICE.type == "cuda":
        gpt.cuda(_DEVICE)
    ddp_config = DistributedDataParallelConfig(
        **{"use_distributed_optimizer": True, "grad_reduce_in_fp32": True, **ddp_options})
    return DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))


def build_optimizer(chunks: list, lr: float, min_lr: float | None = None,
                    weight_decay: float = 0.01, clip_grad: float = 1.0,
                    betas: tuple[float, float] = (0.9, 0.95)):
    """megatron-core's DistributedOptimizer (torch Adam underneath, bf16 params, fp32 main
    params) over the DDP model chunks, with a constant loss scale of 1, so that a NaN or Inf
    gradient anywhere skips the step through its found-inf check."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr if min_lr is None else min_lr,
        weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1],
        clip_grad=clip_grad, bf16=True, loss_scale=1.0, use_distributed_optimizer=True)
    with _cuda_as_cpu():
        return get_megatron_optimizer(config, chunks)


def lr_schedule(optimizer, lr: float, min_lr: float, warmup: int, steps: int,
                decay: str = "cosine", weight_decay: float = 0.01):
    """megatron-core's OptimizerParamScheduler: linear warm-up over `warmup` steps, then
    `decay` ("constant", or "cosine" to `min_lr` at `steps`); call its ``step(1)`` after each
    optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=steps, lr_decay_style=decay, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=steps, wd_incr_style="constant")


def causal_mask(context: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """megatron-core's attention mask convention: True where a position may not attend."""
    return torch.triu(torch.ones(1, 1, context, context, dtype=torch.bool, device=device),
                      diagonal=1)


def token_losses(model, windows: torch.Tensor) -> torch.Tensor:
    """Per-token next-byte cross entropy ([batch, context], fp32) of `model` (a DDP or
    Float16Module GPT holding both ends) on `windows` ([batch, context + 1] byte ids, on the
    model's device)."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    batch, context = inputs.shape
    positions = torch.arange(context, device=windows.device).unsqueeze(0).expand(batch, context)
    return model(inputs, positions, causal_mask(context, windows.device), labels=labels).float()


def zero_grads(chunks: list, optimizer) -> None:
    """The start of a training iteration, as Megatron-LM's train_step begins it."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def finish_grad_sync(chunks: list) -> None:
    """After backward: completes every chunk's gradient reduce-scatter (what Megatron-LM's
    finalize_model_grads does for data parallelism; without ``overlap_grad_reduce`` this is
    where it runs, so call it once per step)."""
    for chunk in chunks:
        chunk.finish_grad_sync()


def optimizer_step(optimizer) -> tuple[bool, float | None]:
    """Steps the distributed optimizer, which all-gathers the updated parameters (at once, or
    from the next forward's hooks with ``overlap_param_gather``). Returns (stepped, gradient
    norm): not stepped where its found-inf check saw a NaN or Inf gradient on any rank."""
    with _cuda_as_cpu():
        stepped, grad_norm, _ = optimizer.step()
    return bool(stepped), grad_norm


def flush_param_sync(chunks: list) -> None:
    """Completes the parameter all-gather still pending after the last step under
    ``overlap_param_gather`` (as Megatron-LM's disable_forward_pre_hook does before a
    checkpoint or evaluation); nothing to do otherwise."""
    for chunk in chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def bucket_params(chunk) -> list[torch.Tensor]:
    """Every parameter buffer of a DDP chunk's buckets, in bucket order."""
    return [bucket.param_data for group in chunk.bucket_groups for bucket in group.buckets]
