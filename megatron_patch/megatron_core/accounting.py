"""Bytes on the wire: what one training step of a DDP model sends through sdp4bit against
Megatron's own collectives, the share the exact parameters take, and the line rank 0 shows
once a model's bucket groups are set up."""

from __future__ import annotations

import torch.distributed as dist

from sdp4bit.integration import WireCounter
from sdp4bit.telemetry import announce, logger

from .parallel import bucket_groups
from .settings import Settings


def _wire(ddp_model, step: int) -> WireCounter:
    wire = WireCounter()
    for bucket_group in bucket_groups(ddp_model):
        state = getattr(bucket_group, "_sdp4bit", None)
        if state is not None:
            state.count_grads(wire, step)
            state.count_weights(wire)
    return wire


def wire_bytes(ddp_model, step: int) -> tuple[int, int]:
    """(bytes sent, bytes the uncompressed collectives would send) by this rank in one training
    step of `ddp_model` (a megatron-core DistributedDataParallel), summed over bucket groups."""
    return _wire(ddp_model, step).pair()


def exact_wire_bytes(ddp_model, step: int) -> int:
    """Of the bytes :func:`wire_bytes` counts as sent, those that carried the parameters kept
    exact (the ``exact_params`` knob)."""
    return _wire(ddp_model, step).exact


def _left_uncompressed(ddp_model, step: int) -> list[tuple[str, int]]:
    """What the ``exact_params`` knob keeps out of the codecs in `ddp_model`: per bucket whose
    parameters are all exact, or that carries exact elements beside compressed ones, a
    description naming its parameters and the bytes one step sends for them at `step`."""
    names = {p: name for name, p in ddp_model.module.named_parameters()}
    left = []
    for bucket_group in bucket_groups(ddp_model):
        state = bucket_group._sdp4bit
        for k, bucket in enumerate(bucket_group.buckets):
            if state.all_exact[k]:
                params, what = bucket.params_list, "bucket"
                count = (state.grad[k].wire_bytes(step).total
                         + state.weight[k].wire_bytes().total)
            elif state.exact[k] is not None:
                params, what = bucket.sdp4bit_exact_params, "the exact elements of bucket"
                count = state.exact_grad_bytes(k, step) + state.exact_weight_bytes(k)
            else:
                continue
            shown = sorted(names.get(p, "?") for p in params)
            more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
            left.append((f"{what} {bucket.sdp4bit_bucket_id} ({', '.join(shown[:3])}{more})",
                         count))
    return left


def announce_when_set_up(settings: Settings, bucket_group) -> None:
    """Once every bucket group of the DDP model `bucket_group` belongs to is set up, rank 0
    shows one line for it: its buckets, those compressed, and the bytes one step sends once
    gradients are quantized, against Megatron's own collectives; and warns once naming what
    the ``exact_params`` knob leaves uncompressed."""
    chunk, model = next(((i, m) for i, m in enumerate(settings.models)
                         if any(g is bucket_group for g in bucket_groups(m))), (None, None))
    if model is None or any(getattr(g, "_sdp4bit", None) is None for g in bucket_groups(model)):
        return
    states = [g._sdp4bit for g in bucket_groups(model)]
    buckets = sum(len(s.grad) for s in states)
    exact = sum(sum(s.all_exact) for s in states)
    step = max(settings.config.resolved.grad_quant_start_step, states[0].grad_step)
    sent, uncompressed = wire_bytes(model, step)
    ratio = f"{uncompressed / sent:.2f}x less" if sent else "nothing sent"
    announce(f"sdp4bit set up model chunk {chunk}: {buckets} buckets, {buckets - exact} "
             f"compressed ({exact} wholly exact); a step sends {sent:,d} B from this rank "
             f"against {uncompressed:,d} B with Megatron's own collectives ({ratio})")
    left = _left_uncompressed(model, step)
    if left and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("sdp4bit model chunk %d: exact_params=%s leaves uncompressed %s",
                       chunk, settings.config.resolved.exact_params,
                       "; ".join(f"{what}, {count:,d} B of a step's {sent:,d} B "
                                 f"({100 * count / sent:.1f}%)" for what, count in left))
