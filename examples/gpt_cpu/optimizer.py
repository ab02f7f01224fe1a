"""AdamW over this rank's shard of megatron-core DDP buckets: what the distributed optimizer
does, on CPU (megatron-core's DistributedOptimizer needs CUDA)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdp4bit.integration import local_shard


class ShardedAdamW:
    """fp32 main parameters and moments for this rank's shard of every bucket; after each
    step the bf16 parameters are written back into the param buffer and all-gathered (at once,
    or by the next forward's hooks when `overlap_param_gather` is on)."""

    def __init__(self, ddp, lr: float, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01):
        self.ddp, self.lr, self.betas, self.eps, self.wd = ddp, lr, betas, eps, weight_decay
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.buckets = [b for g in ddp.bucket_groups for b in g.buckets]
        self.main = [local_shard(b.param_data, self.rank, self.size).float() for b in self.buckets]
        self.m = [torch.zeros_like(p) for p in self.main]
        self.v = [torch.zeros_like(p) for p in self.main]
        self.steps = 0

    def step(self) -> bool:
        """One update; False (and no update) when a gradient anywhere is NaN or Inf."""
        grads = [local_shard(b.grad_data, self.rank, self.size) for b in self.buckets]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        found_inf = torch.tensor([0.0 if finite else 1.0])
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        if found_inf.item() == 0.0:
            self.steps += 1
            b1, b2 = self.betas
            c1, c2 = 1 - b1**self.steps, 1 - b2**self.steps
            for p, g, m, v, bucket in zip(self.main, grads, self.m, self.v, self.buckets):
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - self.lr * self.wd)
                p.addcdiv_(m / c1, (v / c2).sqrt_().add_(self.eps), value=-self.lr)
                local_shard(bucket.param_data, self.rank, self.size).copy_(p.bfloat16())
        if not self.ddp.ddp_config.overlap_param_gather:
            self.ddp.start_param_sync()
        return found_inf.item() == 0.0
