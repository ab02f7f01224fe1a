"""What sdp4bit cannot compress, refused when the model is built with an error naming the
setting to change: never a silent fallback to Megatron's own traffic (docs/megatron.md,
"What is refused, and why")."""

from __future__ import annotations

import torch

from sdp4bit import Config, Sdp4bitError
from sdp4bit.integration import require_bf16


def other_wrapper_classes() -> list:
    """megatron-core's data-parallel wrappers other than DistributedDataParallel, where this
    version has them: torch FSDP2 (--use-torch-fsdp2) and Megatron-FSDP (--use-megatron-fsdp)."""
    classes = []
    try:
        from megatron.core.distributed.torch_fully_sharded_data_parallel import (
            TorchFullyShardedDataParallel)
        classes.append(TorchFullyShardedDataParallel)
    except ImportError:
        pass
    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
        classes.append(FullyShardedDataParallel)
    except ImportError:
        pass
    return classes


def refuse_other_wrapper(self, *args, **kwargs):
    """The __init__ of the wrappers of :func:`other_wrapper_classes` while sdp4bit is enabled:
    their collectives are not the ones sdp4bit replaces."""
    name = type(self).__name__
    flag = "--use-torch-fsdp2" if name == "TorchFullyShardedDataParallel" else "--use-megatron-fsdp"
    raise Sdp4bitError(
        f"{name} ({flag}) runs collectives sdp4bit does not compress; with sdp4bit drop {flag} "
        "and use Megatron's DistributedDataParallel with --use-distributed-optimizer (or "
        "PyTorch FSDP2 through sdp4bit.fsdp, outside Megatron)")


def _quantized_params(params) -> list:
    """The FP8 (or, in 0.19, any quantized-storage) parameters among `params`."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.fp8_utils import is_float8tensor

    quantized = getattr(param_and_grad_buffer, "_param_uses_quantized_storage", is_float8tensor)
    return [p for p in params if quantized(p)]


def refuse_ddp_config(cfg, module) -> None:
    """Raises, naming the setting and what to change, where a DDP model of `module` with the
    DistributedDataParallelConfig `cfg` would run a collective sdp4bit cannot compress."""
    if not cfg.use_distributed_optimizer:
        raise Sdp4bitError(
            "sdp4bit compresses the distributed optimizer's reduce-scatter and all-gather, but "
            "this model does not use it: pass --use-distributed-optimizer "
            "(DistributedDataParallelConfig(use_distributed_optimizer=True))")
    if getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise Sdp4bitError(
            "reuse_grad_buf_for_mxfp8_param_ag gathers MXFP8 parameters through the gradient "
            "buffer, which sdp4bit does not compress; turn it off (no "
            "--reuse-grad-buf-for-mxfp8-param-ag)")
    quantized = _quantized_params(module.parameters())
    if quantized:
        raise Sdp4bitError(
            f"{len(quantized)} FP8 (quantized-storage) parameters: sdp4bit compresses bf16 "
            "parameters and fp32 or bf16 gradients; drop --fp8-param-gather")


def refuse_buffer_dtypes(ddp, config: Config) -> None:
    """Raises where the buffers of the DDP model `ddp` hold gradients sdp4bit does not reduce
    (fp16) or, with a weight codec, parameters it does not all-gather (not bf16)."""
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    grad_dtypes = sorted({str(b.grad_dtype) for b in buffers
                          if b.grad_dtype not in (torch.float32, torch.bfloat16)})
    if grad_dtypes:
        raise Sdp4bitError(
            f"gradient buffers of {', '.join(grad_dtypes)}: sdp4bit reduces float32 or "
            "bfloat16 gradients; train in bf16 (--bf16 instead of --fp16) or pass "
            "--accumulate-allreduce-grads-in-fp32")
    if config.compresses_weights:
        require_bf16((b.param_dtype for b in buffers), "this model's parameter buffers are",
                     "train in bf16 (--bf16 instead of --fp16)")
