"""The main job: a small byte-level GPT trained on CPU by W gloo ranks (launched by torchrun)
with megatron-core's DDP and the sdp4bit integration, printing the loss and the bytes the
compressed collectives save.

    torchrun --standalone --nproc-per-node 4 examples/gpt_cpu/train.py --ranks-per-node 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist

import megatron_patch.megatron_core as sdp4bit_megatron
from sdp4bit import Config, presets

from data import batch, split, stdlib_corpus
from model import ByteGPT
from optimizer import ShardedAdamW


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="sdp4bit", choices=[*presets(), "megatron"],
                   help="sdp4bit preset, or 'megatron' for Megatron's own collectives")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="override one config knob (repeatable), e.g. --knob grad_codec=tlq")
    p.add_argument("--ranks-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                   help="ranks per emulated node (intra- vs inter-node levels)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--telemetry-interval", type=int, default=20,
                   help="every N steps, log sdp4bit's quantization error against an exact "
                        "collective (0 = off)")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="Megatron's overlap_param_gather (see the note where the DDP is built)")
    p.add_argument("--bucket-size", type=int, default=40_000,
                   help="elements per DDP bucket (megatron-core's bucket_size)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--json-out", help="write the loss curve and byte counts here (rank 0)")
    return p.parse_args()


def build_ddp(args: argparse.Namespace):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = ByteGPT(args.context, args.width, args.layers, args.heads).bfloat16()
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.width,
                               num_attention_heads=args.heads, bf16=True,
                               params_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True,
        # Megatron's own asynchronous coalesced all-gather over gloo (the path of uncompressed
        # rows) crashes on CPU after some hundreds of steps, without sdp4bit too
        # (bench/results/gloo_coalesced_allgather_crash.md), so by default parameters are
        # gathered synchronously here; gradients overlap with backward.
        overlap_grad_reduce=True, overlap_param_gather=args.overlap_param_gather,
        bucket_size=args.bucket_size,
    )
    with sdp4bit_megatron.megatron_on_cpu():
        return DistributedDataParallel(config, ddp_config, model)


def loss_of(ddp, inputs, targets) -> torch.Tensor:
    logits = ddp(inputs).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="      %(message)s")
    config = None
    if args.preset != "megatron":
        knobs = dict(k.split("=", 1) for k in args.knob)
        config = Config.from_knobs(args.preset, knobs)
        sdp4bit_megatron.enable(config, local_world_size=args.ranks_per_node,
                                telemetry_interval=args.telemetry_interval)
    train_text, val_text = split(stdlib_corpus(args.corpus_bytes), held_out=0.1)
    ddp = build_ddp(args)
    optimizer = ShardedAdamW(ddp, lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed + 1000 + rank)
    if rank == 0:
        params = sum(p.numel() for p in ddp.module.parameters())
        print(f"byte-level GPT, {params / 1e6:.2f} M params, {world} ranks "
              f"({world // args.ranks_per_node} nodes x {args.ranks_per_node}), "
              f"{len(train_text) / 1e6:.1f} MB of stdlib sources")
        print("collectives:", config.describe() if config else "Megatron's own (uncompressed)")
        print(f"{'step':>5} {'loss':>8} {'sent/step':>12} {'uncompressed':>13} {'ratio':>6} "
              f"{'step time':>10}")
    curve, step_ms, sent_total, baseline_total = [], [], 0, 0
    for step in range(args.steps):
        start = time.perf_counter()
        inputs, targets = batch(train_text, args.batch, args.context, generator)
        ddp.zero_grad_buffer()
        loss = loss_of(ddp, inputs, targets)
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        elapsed = time.perf_counter() - start
        sent, baseline = sdp4bit_megatron.wire_bytes(ddp, step)
        sent_total, baseline_total = sent_total + sent, baseline_total + baseline
        train_loss = mean_over_ranks(loss.item())
        curve.append(train_loss)
        step_ms.append(elapsed * 1e3)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            ratio = f"{baseline / sent:5.2f}x" if sent else "     -"
            print(f"{step:5d} {train_loss:8.4f} {sent:12,d} {baseline:13,d} {ratio} "
                  f"{elapsed * 1e3:8.1f}ms", flush=True)
    if ddp.ddp_config.overlap_param_gather:  # the last step's gather
        for bucket_group in ddp.bucket_groups:
            bucket_group.finish_param_sync(skip_next_bucket_dispatch=True)
    with torch.no_grad():
        eval_gen = torch.Generator().manual_seed(args.seed + 7)  # the same batches on every rank
        val = [loss_of(ddp, *batch(val_text, args.batch, args.context, eval_gen)).item()
               for _ in range(args.eval_batches)]
    val_loss = sum(val) / len(val)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    bits = params.view(torch.int16).to(torch.int32)
    every = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(every, bits)
    identical = all(torch.equal(b, every[0]) for b in every)
    if rank == 0:
        print(f"validation loss {val_loss:.4f} (held-out 10%); replicas bit-identical: {identical}")
        if sent_total:
            print(f"bytes sent by rank 0: {sent_total:,d} vs {baseline_total:,d} uncompressed "
                  f"({baseline_total / sent_total:.2f}x less, "
                  f"{(baseline_total - sent_total) / 2**20:.1f} MiB saved)")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"preset": args.preset, "knobs": args.knob, "train_loss": curve,
                           "step_ms": step_ms,
                           "val_loss": val_loss, "sent": sent_total,
                           "uncompressed": baseline_total}, f)
    sdp4bit_megatron.disable()  # sdp4bit's groups and thread go before the process groups
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("replicas differ")


if __name__ == "__main__":
    main()
