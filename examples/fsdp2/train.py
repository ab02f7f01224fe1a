"""A small byte-level GPT trained with PyTorch FSDP2 (fully_shard per block, bf16 parameters,
fp32 gradient reduction) on CPU by W gloo ranks, with sdp4bit's codecs as the units'
all-gather and reduce-scatter, in a torchtitan-style loop (gradient-norm clipping; a step
whose norm is not finite is skipped on every rank).

    torchrun --standalone --nproc-per-node 4 examples/fsdp2/train.py --ranks-per-node 2

Writes, with --json-out, the loss curve, the validation loss on the held-out end of the
corpus, the bytes sent against FSDP's own collectives and the telemetry's quantization errors,
as the bench/convergence.py study reads them (its FSDP2 rows run this script). The data (the
standard library's sources, held-out split, validation windows) and the learning-rate schedule
are those of examples/gpt_cpu/train.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import sdp4bit.fsdp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt_cpu"))

from data import (batch, batch_generator, split, stdlib_corpus,  # noqa: E402  (gpt_cpu's)
                  validation_windows)
from study_args import study_parser  # noqa: E402  (gpt_cpu's)

OWN = "fsdp"  # --preset value for FSDP's own collectives


def parse_args() -> argparse.Namespace:
    p = study_parser(__doc__.splitlines()[0], own=OWN,
                     preset_help="sdp4bit preset as FSDP reads it (sdp4bit: qsdp weights, "
                                 f"TLq-HS gradients), or '{OWN}' for FSDP's own collectives",
                     telemetry_help="every N steps, measure the quantization error against "
                                    "FSDP's exact collectives (0 = off)")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    return p.parse_args()


class ByteGPT(nn.Module):
    """Token and position embeddings, pre-norm causal transformer blocks, a tied output head."""

    def __init__(self, context: int, width: int, layers: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(seq, device=tokens.device))
        mask = torch.triu(torch.full((seq, seq), float("-inf"), dtype=x.dtype), diagonal=1)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.tokens.weight.t()


def token_losses(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Per-token next-byte cross entropy ([batch, context], fp32) on `windows` ([batch,
    context + 1] byte ids)."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = model(inputs).float()
    return nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1),
                                       reduction="none").reshape(targets.shape)


def learning_rate(step: int, lr: float, min_lr: float, warmup: int, steps: int,
                  decay: str) -> float:
    """The learning rate of optimizer step `step` (0-based) as megatron-core's
    OptimizerParamScheduler gives it to examples/gpt_cpu/train.py (initial 0): linear warm-up
    over `warmup` steps, then `decay` ("constant", or "cosine" to `min_lr` at `steps`)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if decay == "constant":
        return lr
    if step > steps:
        return min_lr
    ratio = (step - warmup) / (steps - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def validation_loss(model: nn.Module, windows: torch.Tensor, rank: int, world: int,
                    batch_size: int = 64) -> float:
    """Mean next-byte cross entropy over every token of `windows`, which the ranks share out
    (each evaluates every world-th window) and sum up. Every rank runs the same number of
    forward passes, as FSDP's all-gathers need; a rank out of windows runs its first one and
    counts nothing."""
    totals = torch.zeros(2, dtype=torch.float64)  # loss sum, tokens
    mine = windows[rank::world]
    passes = math.ceil(math.ceil(len(windows) / world) / batch_size)
    with torch.no_grad():
        for start in range(0, passes * batch_size, batch_size):
            chunk = mine[start:start + batch_size]
            losses = token_losses(model, chunk if len(chunk) else windows[:1])
            if len(chunk):
                totals += torch.tensor([losses.double().sum().item(), losses.numel()])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


class TelemetryRecord:
    """Keeps the telemetry's scalars (a tensorboard writer's add_scalar)."""

    def __init__(self):
        self.by_step: dict[tuple[str, int], dict[str, float]] = {}

    def add_scalar(self, name: str, value: float, step: int) -> None:
        _, kind, field = name.split("/")
        self.by_step.setdefault((kind, step), {"step": step})[field] = value

    def as_dict(self) -> dict[str, list[dict]]:
        return {kind: [v for (k, _), v in sorted(self.by_step.items()) if k == kind]
                for kind in ("grad", "param")}


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = ByteGPT(args.context, args.width, args.layers, args.heads)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # one FSDP unit per block, as torchtitan wraps
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # the root unit: embeddings and the final norm
    return model


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="      %(message)s")
    model = build(args)
    record = TelemetryRecord()
    config = None
    if args.preset != OWN:
        knobs = {"seed": str(args.seed), **dict(k.split("=", 1) for k in args.knob)}
        config = sdp4bit.fsdp.preset_config(args.preset, knobs)
        sdp4bit.fsdp.enable(model, config, local_world_size=args.ranks_per_node,
                            telemetry_interval=args.telemetry_interval,
                            tensorboard_writer=record)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_text, val_text = split(stdlib_corpus(args.corpus_bytes), args.val_tokens + 1)
    generator = batch_generator(args.seed, rank, args.data_seeding)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"byte-level GPT, {params / 1e6:.2f} M params, FSDP2 over {world} ranks "
              f"({world // args.ranks_per_node} nodes x {args.ranks_per_node})")
        print("collectives:", config.describe() if config else "FSDP's own (uncompressed)")
        print(f"{'step':>5} {'loss':>8} {'grad norm':>10} {'sent':>12} {'uncompressed':>13} "
              f"{'step time':>10}")
    curve, step_ms, skipped, last = [], [], [], (0, 0)
    steps_run = min(args.steps, args.stop_after or args.steps)
    for step in range(steps_run):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.lr, args.min_lr, args.warmup_steps,
                                        args.steps, args.lr_decay)
        loss = token_losses(model, batch(train_text, args.batch, args.context, generator)).mean()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_norm).full_tensor()
        if torch.isfinite(grad_norm):
            optimizer.step()
        else:  # the same norm on every rank: every rank skips
            skipped.append(step)
        optimizer.zero_grad()
        step_ms.append((time.perf_counter() - start) * 1e3)
        curve.append(mean_over_ranks(loss.item()))
        if rank == 0 and (step % args.log_every == 0 or step == steps_run - 1):
            sent, uncompressed = sdp4bit.fsdp.wire_bytes(model)
            print(f"{step:5d} {curve[-1]:8.4f} {grad_norm.item():10.4f} "
                  f"{sent - last[0]:12,d} {uncompressed - last[1]:13,d} "
                  f"{step_ms[-1]:8.1f}ms", flush=True)
            last = (sent, uncompressed)
    eval_start = time.perf_counter()
    held_out = validation_windows(val_text, args.context)
    val_loss = validation_loss(model, held_out, rank, world)
    eval_seconds = time.perf_counter() - eval_start
    sent, uncompressed = sdp4bit.fsdp.wire_bytes(model)
    if rank == 0:
        print(f"validation loss {val_loss:.4f} ({held_out.shape[0] * args.context:,d} held-out "
              f"tokens); skipped steps: {skipped}")
        if sent:
            print(f"bytes sent by rank 0: {sent:,d} vs {uncompressed:,d} with FSDP's own "
                  f"collectives ({uncompressed / sent:.2f}x less)")
        if args.json_out:
            telemetry = record.as_dict()
            with open(args.json_out, "w") as f:
                json.dump({"preset": args.preset, "knobs": args.knob, "seed": args.seed,
                           "codecs": list(config.codecs()) if config else None,
                           "world": world, "ranks_per_node": args.ranks_per_node,
                           "train_loss": curve, "step_ms": step_ms, "val_loss": val_loss,
                           "val_tokens": held_out.shape[0] * args.context,
                           "eval_seconds": eval_seconds, "skipped_steps": skipped,
                           "sent": sent, "uncompressed": uncompressed,
                           "grad_rel_l2": [e["rel_l2_error"] for e in telemetry["grad"]],
                           "param_rel_l2": [e["rel_l2_error"] for e in telemetry["param"]],
                           "telemetry": telemetry}, f)
    sdp4bit.fsdp.disable(model)  # sdp4bit's groups and thread go before the process groups
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
