"""A training script shaped like torchtitan's (``torchtitan/train.py`` with
``parallelize_llama``): a world mesh from ``init_device_mesh`` (dp x tp), tensor parallelism
on every block, ``fully_shard`` per block and on the root, sdp4bit's codecs as every unit's
all-gather and reduce-scatter, DCP checkpoints with sdp4bit's ``Stateful``, and a metrics line
per step. A tiny Llama-style model on synthetic tokens, on CPU (gloo) or CUDA (NCCL).

    torchrun --standalone --nproc-per-node 4 examples/torchtitan/train.py --tp 2 \\
        --steps 4 --checkpoint-folder ckpt --checkpoint-interval 2

and, to resume from the latest checkpoint in that folder, the same command again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import sdp4bit.fsdp

VOCAB = 64


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        # Under TP each rank holds heads / tp of the heads: the local width says how many.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, heads) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model: nn.Module, world_mesh, preset: str) -> nn.Module:
    """torchtitan's ``parallelize_llama``, cut down to TP and FSDP, plus sdp4bit's line."""
    if world_mesh["tp"].size() > 1:
        for block in model.layers.values():
            parallelize_module(block, world_mesh["tp"], {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=world_mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=world_mesh["dp"], mp_policy=mp)
    if preset != "fsdp":
        sdp4bit.fsdp.enable(model, preset)  # after fully_shard, on every rank
    return model


class ModelAndOptimizer(Stateful):
    """torchtitan's ``ModelWrapper`` and ``OptimizersContainer`` in one."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizer"])


class TrainState(Stateful):
    """The step, as torchtitan's ``TrainState`` keeps it."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])


def batch(step: int, dp_rank: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic tokens, the same on the TP ranks of a dp rank: counting sequences from a
    random start, so the next token is learnable."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step * 101 + dp_rank)
    start = torch.randint(0, VOCAB, (args.batch, 1), generator=g)
    tokens = (start + torch.arange(args.seq_len + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def latest_checkpoint(folder: Path) -> Path | None:
    steps = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")) if folder.is_dir() else []
    return folder / f"step-{steps[-1]}" if steps else None


def parameter_digest(model: nn.Module) -> str:
    """A hash of every full parameter's bytes, the same on every rank."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.full_tensor().detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="sdp4bit", help="a preset, or fsdp: FSDP's own")
    parser.add_argument("--checkpoint-folder", type=Path)
    parser.add_argument("--checkpoint-interval", type=int, default=0)
    parser.add_argument("--json-out", type=Path, help="rank 0 writes losses and the digest")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    world = dist.get_world_size()
    world_mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = parallelize(Transformer(args.dim, args.heads, args.layers), world_mesh,
                            args.preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_state = TrainState()
    states = {"train_state": train_state, "model": ModelAndOptimizer(model, optimizer)}
    if args.preset != "fsdp":
        states["sdp4bit"] = sdp4bit.fsdp.stateful(model)  # sdp4bit's state in the checkpoint
    resume = latest_checkpoint(args.checkpoint_folder) if args.checkpoint_folder else None
    if resume is not None:
        dcp.load(states, checkpoint_id=str(resume))
    dp_rank, losses = world_mesh.get_local_rank("dp"), []
    while train_state.step < args.steps:
        started = time.perf_counter()
        inputs, labels = (t.to(device) for t in batch(train_state.step, dp_rank, args))
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train_state.step += 1
        sent, uncompressed = sdp4bit.fsdp.wire_bytes(model)
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step: {train_state.step:2d}  loss: {loss.item():7.4f}  "
                  f"wire: {sent / 2**20:.2f} MiB of {uncompressed / 2**20:.2f} MiB  "
                  f"time: {time.perf_counter() - started:.3f}s", flush=True)
        interval = args.checkpoint_interval
        if args.checkpoint_folder and interval and train_state.step % interval == 0:
            dcp.save(states, checkpoint_id=str(args.checkpoint_folder /
                                                f"step-{train_state.step}"))
    digest = parameter_digest(model)
    if dist.get_rank() == 0 and args.json_out:
        args.json_out.write_text(json.dumps({"losses": losses, "digest": digest,
                                             "resumed_from": resume and resume.name}))
    sdp4bit.fsdp.disable(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
