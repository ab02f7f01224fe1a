"""The main job: megatron-core's GPTModel trained on CPU by W gloo ranks (launched by torchrun)
with megatron-core's DDP and real DistributedOptimizer (gradient reduce-scatter overlapped
with backward) and the sdp4bit integration, printing the loss and the bytes the compressed
collectives save. Byte-level language modelling on the standard library's sources.

    torchrun --standalone --nproc-per-node 4 examples/gpt_cpu/train.py --ranks-per-node 2

megatron-core runs on CPU through the shims of megatron_on_cpu/ (docs/megatron.md, "Running on
CPU"), which this script puts on its path; the bench/convergence.py study runs it once per
row and seed.

``--tp N`` adds tensor parallelism (megatron-core's parallel_state): DP groups of W / N ranks,
one per TP rank, each TP group N consecutive ranks as Megatron orders them, so with
``--ranks-per-node 2 --tp 2`` each node is a TP pair and each DP group has one rank per node
(sdp4bit's gradient reduce-scatter then has one level, between nodes). The data, the loss and
the validation are shared out and reduced over the DP group (a TP group sees the same
sequences), bytes are one rank's in its DP group, the replica check compares DP replicas, and
the parameters Megatron replicates across the TP group are checked bit for bit at the end
(``check_replicated_params``).

``--device cuda`` trains on GPUs instead, as a Megatron user runs megatron-core: no shims,
the model initialized on the GPU and moved there, data and the script's own collectives on
the device, the sdp4bit buckets on the device (the CUDA backend). Rank r uses GPU
``LOCAL_RANK % torch.cuda.device_count()``. The process groups (``--backend auto``): NCCL
when each rank of the host has a GPU of its own; gloo when ranks share a GPU (NCCL refuses
two ranks on one device), as in a W = 2 run on a one-GPU host. megatron-core 0.16.1 on gloo
with CUDA tensors: its all-reduces (gradient norm, found-inf check, the cross entropy's
tensor-parallel reductions) and the script's all-reduces and all-gathers are gloo's CUDA
collectives (host copies); the DP reduce-scatter and all-gather are sdp4bit's. Megatron's own
parameter all-gather (``all_gather_into_tensor`` under ``_coalescing_manager``) reaches gloo's
``allgather_into_tensor_coalesced``, which has no CUDA path in torch 2.11 (it segfaulted on
CUDA tensors), so presets that leave weights uncompressed (``--preset megatron``,
``baseline``, ``global-qsgd``) are refused on gloo with CUDA.

Run once on one H100 (torch 2.11.0+cu130, Python 3.12, megatron-core 0.16.1), sdp4bit
preset: W = 2 and W = 4 on gloo sharing the GPU, 20 steps each, and W = 1 on NCCL, 10 steps;
the loss fell and the replicas were bit-identical. Not run: NCCL with W > 1 (one GPU per
rank), ``--overlap-param-gather`` and other presets on CUDA. tests/python/test_main_job.py
checks the argument handling and the backend choice on CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron_on_cpu"))

import megatron_gpt as gpt  # noqa: E402  (megatron_on_cpu, put on the path above)
import megatron_patch.megatron_core as sdp4bit_megatron  # noqa: E402
from sdp4bit import Config, Sdp4bitError  # noqa: E402

from data import (batch, batch_generator, split, stdlib_corpus,  # noqa: E402
                  validation_windows)
from study_args import study_parser  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = study_parser(__doc__.splitlines()[0], own="megatron",
                     preset_help="sdp4bit preset, or 'megatron' for Megatron's own collectives",
                     telemetry_help="every N steps, log sdp4bit's quantization error against "
                                    "an exact collective (0 = off)")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="Megatron's overlap_param_gather (see the note where the DDP is built)")
    p.add_argument("--bucket-size", type=int, default=40_000,
                   help="elements per DDP bucket (megatron-core's bucket_size)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: megatron-core through megatron_on_cpu's shims; cuda: natively, "
                        "rank r on GPU LOCAL_RANK %% device_count")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="torch.distributed backend; auto: gloo on the CPU and where ranks "
                        "share a GPU, else NCCL")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size N: TP groups of N consecutive ranks, DP groups "
                        "of W / N ranks")
    p.add_argument("--instances", type=int, default=1,
                   help="distributed-optimizer instances N (hybrid sharding: each of N groups "
                        "of DP ranks shards the model, gradients all-reduced across them)")
    p.add_argument("--dump-grads", metavar="DIR",
                   help="at the steps of --dump-steps, save each rank's gradients before any "
                        "reduction, bucket by bucket (bench/hadamard_real.py reads them)")
    p.add_argument("--dump-steps", default="0", help="comma-separated steps for --dump-grads")
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error(f"--tp must be at least 1, got {args.tp}")
    if args.instances < 1:
        p.error(f"--instances must be at least 1, got {args.instances}")
    return args


def data_parallel_size(world: int, tp: int) -> int:
    """The DP size of `world` ranks at TP = `tp`; raises ValueError unless `tp` divides it."""
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the {world} ranks")
    return world // tp


def choose_backend(device: str, requested: str, local_ranks: int, gpus: int,
                   compresses_weights: bool) -> tuple[str, str]:
    """(backend, why) for `device` with `local_ranks` ranks and `gpus` GPUs on this host:
    gloo on the CPU; on CUDA, NCCL when every rank has a GPU of its own, else gloo (NCCL
    refuses two ranks on one GPU). `requested` ('auto', 'gloo' or 'nccl') picks where it can
    work. Raises ValueError for a combination that cannot run, saying why."""
    if device == "cpu":
        if requested == "nccl":
            raise ValueError("--backend nccl needs --device cuda: NCCL exchanges CUDA tensors")
        return "gloo", "CPU tensors"
    if gpus < 1:
        raise ValueError("--device cuda: torch sees no CUDA device on this host")
    shared = local_ranks > gpus
    if requested == "nccl" and shared:
        raise ValueError(f"--backend nccl: {local_ranks} ranks on {gpus} GPU(s) put two ranks "
                         "on one GPU, which NCCL refuses; use gloo")
    if requested == "nccl" or (requested == "auto" and not shared):
        return "nccl", "one GPU per rank"
    if not compresses_weights:
        raise ValueError("gloo with CUDA tensors: Megatron's own parameter all-gather "
                         "(allgather_into_tensor_coalesced) has no CUDA path in gloo; use a "
                         "preset that compresses weights, or one GPU per rank (NCCL)")
    why = (f"{local_ranks} ranks share {gpus} GPU(s), which NCCL refuses" if shared
           else "--backend gloo")
    return "gloo", why + "; CUDA tensors through host copies"


class TelemetryRecorder:
    """A tensorboard writer for sdp4bit's telemetry that keeps the relative errors."""

    def __init__(self) -> None:
        self.rel_l2 = {"grad": [], "param": []}

    def add_scalar(self, name: str, value: float, step: int) -> None:
        _, what, quantity = name.split("/")
        if quantity == "rel_l2_error":
            self.rel_l2[what].append(float(value))


def backward_dumping_grads(ddp, loss: torch.Tensor, path: Path) -> None:
    """`loss.backward()`, but with DDP's reduction held back until this rank's gradients, as
    its buckets hold them before any reduction, are saved to `path` (one fp32 tensor per
    bucket, in the buffers' order); then every bucket's reduction starts, as the hooks would
    have started it. Each bucket's collective computes the same bytes whenever it starts, so
    the run trains exactly as without the dump."""
    with ddp.no_sync():
        loss.backward()
    torch.save([bucket.grad_data.detach().float().cpu().clone()
                for buffer in ddp.buffers for bucket in buffer.buckets], path)
    ddp.start_grad_sync()


def mean_over(value: float, group, device: torch.device) -> float:
    """The mean of `value` over the ranks of `group`."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def validation_loss(ddp, windows: torch.Tensor, group, device: torch.device,
                    batch_size: int = 64) -> float:
    """Mean next-byte cross entropy over every token of `windows`, which the ranks of the DP
    `group` share out (each evaluates every |group|-th window on `device`) and sum up."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
    mine = windows[dist.get_rank(group)::dist.get_world_size(group)].to(device)
    with torch.no_grad():
        for start in range(0, len(mine), batch_size):
            losses = gpt.token_losses(ddp, mine[start:start + batch_size])
            totals += torch.tensor([losses.double().sum().item(), losses.numel()],
                                   device=device)
    dist.all_reduce(totals, group=group)
    return (totals[0] / totals[1]).item()


def replicas_identical(ddp, group) -> bool:
    """Whether every rank of the DP `group` holds the same parameters, bit for bit."""
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    bits = params.view(torch.int16).to(torch.int32)
    every = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, bits, group=group)
    return all(torch.equal(b, every[0]) for b in every)


def tp_copies_identical(ddp, device: torch.device) -> tuple[bool, str | None]:
    """(whether the parameters Megatron replicates across TP ranks hold the same bits on every
    rank of every TP group, check_replicated_params's message naming the first that differs in
    this rank's TP group or None)."""
    try:
        sdp4bit_megatron.check_replicated_params(ddp)
        message = None
    except Sdp4bitError as e:
        message = str(e)
    differ = torch.tensor([message is not None], dtype=torch.int32, device=device)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    return not differ.item(), message


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    config = None
    if args.preset != "megatron":
        knobs = {"seed": str(args.seed), **dict(k.split("=", 1) for k in args.knob)}
        config = Config.from_knobs(args.preset, knobs)
    device = torch.device("cpu")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    try:
        backend, why = choose_backend(args.device, args.backend,
                                      int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gpus,
                                      config is not None and config.compresses_weights)
    except ValueError as e:
        raise SystemExit(f"train.py: {e}") from None
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % gpus)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        dp = data_parallel_size(world, args.tp)
    except ValueError as e:
        raise SystemExit(f"train.py: {e}") from None
    if dp % args.instances:
        raise SystemExit(f"train.py: --instances {args.instances} does not divide the DP size "
                         f"{dp}")
    if rank == 0:  # sdp4bit's notices and telemetry; megatron-core's warnings only
        logging.basicConfig(level=logging.WARNING, format="      %(message)s")
        logging.getLogger("sdp4bit").setLevel(logging.INFO)
    gpt.initialize(args.seed, tp=args.tp, device=device, instances=args.instances)
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    dp_rank = dist.get_rank(dp_group)
    recorder = TelemetryRecorder()
    if config is not None:
        sdp4bit_megatron.enable(config, local_world_size=args.ranks_per_node,
                                telemetry_interval=args.telemetry_interval,
                                tensorboard_writer=recorder)
    train_text, val_text = split(stdlib_corpus(args.corpus_bytes), args.val_tokens + 1)
    shape = gpt.Shape(args.context, args.width, args.layers, args.heads)
    # Megatron's own asynchronous coalesced all-gather over gloo (the path of uncompressed
    # rows) crashes on CPU after some hundreds of steps, without sdp4bit too
    # (docs/evidence/gloo_coalesced_allgather_crash.md), so by default parameters are gathered
    # synchronously in the optimizer's step; gradients overlap with backward.
    ddp = gpt.build_model(shape, args.seed, overlap_grad_reduce=True,
                          overlap_param_gather=args.overlap_param_gather,
                          bucket_size=args.bucket_size,
                          num_distributed_optimizer_instances=args.instances)
    optimizer = gpt.build_optimizer([ddp], lr=args.lr, min_lr=args.min_lr)
    scheduler = gpt.lr_schedule(optimizer, args.lr, args.min_lr, args.warmup_steps, args.steps,
                                args.lr_decay)
    # By DP rank: the ranks of a TP group train on the same sequences.
    generator = batch_generator(args.seed, dp_rank, args.data_seeding)
    if rank == 0:
        params = sum(p.numel() * (args.tp if getattr(p, "tensor_model_parallel", False) else 1)
                     for p in ddp.module.parameters())  # the whole model's, not one TP rank's
        layout = (f" as TP = {args.tp} x DP = {dp} (DP group of rank 0: ranks "
                  f"{dist.get_process_group_ranks(dp_group)})" if args.tp > 1 else "")
        if args.instances > 1:
            layout += (f", {args.instances} distributed-optimizer instances of "
                       f"{dp // args.instances} ranks")
        print(f"megatron-core GPTModel (byte-level), {params / 1e6:.2f} M params, "
              f"DistributedOptimizer, {world} ranks ({world // args.ranks_per_node} nodes x "
              f"{args.ranks_per_node}){layout}, {len(train_text) / 1e6:.1f} MB of stdlib "
              "sources")
        where = (f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
                 else "cpu")
        print(f"device: {where}; process groups: {backend} ({why})")
        print("collectives:", config.describe() if config else "Megatron's own (uncompressed)")
        print(f"{'step':>5} {'loss':>8} {'sent/step':>12} {'uncompressed':>13} {'ratio':>6} "
              f"{'step time':>10}")
    curve, step_ms, sent_total, baseline_total, exact_total, skipped = [], [], 0, 0, 0, 0
    steps_run = min(args.steps, args.stop_after or args.steps)
    dump_steps = {int(s) for s in args.dump_steps.split(",")}
    for step in range(steps_run):
        start = time.perf_counter()
        windows = batch(train_text, args.batch, args.context, generator).to(device)
        gpt.zero_grads([ddp], optimizer)
        loss = gpt.token_losses(ddp, windows).mean()
        if args.dump_grads and step in dump_steps:
            backward_dumping_grads(ddp, loss, Path(args.dump_grads) / f"step{step}-rank{rank}.pt")
        else:
            loss.backward()
        gpt.finish_grad_sync([ddp])
        stepped, _ = gpt.optimizer_step(optimizer)
        scheduler.step(1)
        skipped += not stepped
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        sent, baseline = sdp4bit_megatron.wire_bytes(ddp, step)
        sent_total, baseline_total = sent_total + sent, baseline_total + baseline
        exact_total += sdp4bit_megatron.exact_wire_bytes(ddp, step)
        train_loss = mean_over(loss.item(), dp_group, device)
        curve.append(train_loss)
        step_ms.append(elapsed * 1e3)
        if rank == 0 and (step % args.log_every == 0 or step == steps_run - 1):
            ratio = f"{baseline / sent:5.2f}x" if sent else "     -"
            print(f"{step:5d} {train_loss:8.4f} {sent:12,d} {baseline:13,d} {ratio} "
                  f"{elapsed * 1e3:8.1f}ms", flush=True)
    gpt.flush_param_sync([ddp])  # the last step's gather, under overlap_param_gather
    eval_start = time.perf_counter()
    held_out = validation_windows(val_text, args.context)
    val_loss = validation_loss(ddp, held_out, dp_group, device)
    eval_seconds = time.perf_counter() - eval_start
    identical = replicas_identical(ddp, dp_group)
    tp_identical, tp_difference = (tp_copies_identical(ddp, device) if args.tp > 1
                                   else (True, None))
    if rank == 0:
        print(f"validation loss {val_loss:.4f} ({held_out.shape[0] * args.context:,d} held-out "
              f"tokens); skipped steps {skipped}; replicas bit-identical: {identical}")
        if args.tp > 1:
            print(f"TP-replicated parameters bit-identical across each TP group: "
                  f"{tp_identical}" + (f" ({tp_difference})" if tp_difference else ""))
        if sent_total:
            exact = f", {exact_total:,d} of them exact (exact_params)" if exact_total else ""
            in_dp_group = f" in its DP group of {dp}" if args.tp > 1 else ""
            print(f"bytes sent by rank 0{in_dp_group}: {sent_total:,d} vs {baseline_total:,d} "
                  f"uncompressed{exact} ({baseline_total / sent_total:.2f}x less, "
                  f"{(baseline_total - sent_total) / 2**20:.1f} MiB saved)")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"preset": args.preset, "knobs": args.knob, "seed": args.seed,
                           "train_loss": curve, "step_ms": step_ms, "val_loss": val_loss,
                           "val_tokens": held_out.shape[0] * args.context,
                           "eval_seconds": eval_seconds, "skipped_steps": skipped,
                           "sent": sent_total, "uncompressed": baseline_total,
                           "grad_rel_l2": recorder.rel_l2["grad"],
                           "param_rel_l2": recorder.rel_l2["param"]}, f)
    sdp4bit_megatron.disable()  # sdp4bit's groups and thread go before the process groups
    gpt.shutdown()
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("replicas differ")
    if not tp_identical:
        raise SystemExit("TP-replicated parameters differ")


if __name__ == "__main__":
    main()
