"""A small byte-level GPT trained with PyTorch FSDP2 (fully_shard per block, bf16 parameters,
fp32 gradient reduction) on CPU by W gloo ranks, with sdp4bit's codecs as the units'
all-gather and reduce-scatter, in a torchtitan-style loop (gradient-norm clipping; a step
whose norm is not finite is skipped on every rank).

    torchrun --standalone --nproc-per-node 4 examples/fsdp2/train.py --ranks-per-node 2

Writes, with --json-out, the loss curve, the validation loss on held-out data, the bytes sent
against FSDP's own collectives and the telemetry's quantization errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import sdp4bit.fsdp
from sdp4bit import presets

OWN = "fsdp"  # --preset value for FSDP's own collectives


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="sdp4bit", choices=[*presets(), OWN],
                   help="sdp4bit preset as FSDP reads it (sdp4bit: qsdp weights, TLq-HS "
                        f"gradients), or '{OWN}' for FSDP's own collectives")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="override one config knob (repeatable), e.g. --knob grad_inter_bits=8")
    p.add_argument("--ranks-per-node", type=int,
                   default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                   help="ranks per emulated node (intra- vs inter-node levels)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--seed", type=int, default=1234, help="initial weights and data order")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--telemetry-interval", type=int, default=20,
                   help="every N steps, measure the quantization error against FSDP's exact "
                        "collectives (0 = off)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--json-out", help="write the results here (rank 0)")
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


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The first `max_bytes` bytes of the standard library's .py files, in sorted order."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch(text: torch.Tensor, size: int, context: int, generator: torch.Generator):
    """`size` random windows of `context` + 1 bytes: (inputs, next-byte targets)."""
    starts = torch.randint(0, len(text) - context - 1, (size,), generator=generator).tolist()
    windows = torch.stack([text[s:s + context + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs).float()
    return nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


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
        config = sdp4bit.fsdp.preset_config(args.preset, dict(k.split("=", 1) for k in args.knob))
        sdp4bit.fsdp.enable(model, config, local_world_size=args.ranks_per_node,
                            telemetry_interval=args.telemetry_interval,
                            tensorboard_writer=record)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    corpus = stdlib_corpus(args.corpus_bytes)
    cut = int(len(corpus) * 0.9)
    train_text, val_text = corpus[:cut], corpus[cut:]  # the last 10% is held out
    generator = torch.Generator().manual_seed(args.seed + 1000 + rank)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"byte-level GPT, {params / 1e6:.2f} M params, FSDP2 over {world} ranks "
              f"({world // args.ranks_per_node} nodes x {args.ranks_per_node})")
        print("collectives:", config.describe() if config else "FSDP's own (uncompressed)")
        print(f"{'step':>5} {'loss':>8} {'grad norm':>10} {'sent':>12} {'uncompressed':>13} "
              f"{'step time':>10}")
    curve, step_ms, skipped, last = [], [], [], (0, 0)
    for step in range(args.steps):
        start = time.perf_counter()
        inputs, targets = batch(train_text, args.batch, args.context, generator)
        loss = loss_of(model, inputs, targets)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_norm).full_tensor()
        if torch.isfinite(grad_norm):
            optimizer.step()
        else:  # the same norm on every rank: every rank skips
            skipped.append(step)
        optimizer.zero_grad()
        step_ms.append((time.perf_counter() - start) * 1e3)
        curve.append(mean_over_ranks(loss.item()))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            sent, uncompressed = sdp4bit.fsdp.wire_bytes(model)
            print(f"{step:5d} {curve[-1]:8.4f} {grad_norm.item():10.4f} "
                  f"{sent - last[0]:12,d} {uncompressed - last[1]:13,d} "
                  f"{step_ms[-1]:8.1f}ms", flush=True)
            last = (sent, uncompressed)
    with torch.no_grad():
        eval_generator = torch.Generator().manual_seed(args.seed + 7)  # the same on every rank
        val = [loss_of(model, *batch(val_text, args.batch, args.context, eval_generator)).item()
               for _ in range(args.eval_batches)]
    val_loss = sum(val) / len(val)
    sent, uncompressed = sdp4bit.fsdp.wire_bytes(model)
    if rank == 0:
        print(f"validation loss {val_loss:.4f} (held-out 10%); skipped steps: {skipped}")
        if sent:
            print(f"bytes sent by rank 0: {sent:,d} vs {uncompressed:,d} with FSDP's own "
                  f"collectives ({uncompressed / sent:.2f}x less)")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"preset": args.preset, "knobs": args.knob, "seed": args.seed,
                           "codecs": list(config.codecs()) if config else None,
                           "world": world, "ranks_per_node": args.ranks_per_node,
                           "train_loss": curve, "step_ms": step_ms, "val_loss": val_loss,
                           "skipped_steps": skipped, "sent": sent, "uncompressed": uncompressed,
                           "telemetry": record.as_dict()}, f)
    sdp4bit.fsdp.disable(model)  # sdp4bit's groups and thread go before the process groups
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
