"""sdp4bit in a minute: one bucket's compressed gradient reduce-scatter and weight all-gather on
4 CPU processes (gloo), as 2 nodes x 2 ranks. Run it with

    torchrun --standalone --nproc-per-node 4 examples/quickstart.py
"""

import torch
import torch.distributed as dist

import sdp4bit

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
groups = sdp4bit.ProcessGroups.create(local_world_size=2)  # 2 ranks per node
config = sdp4bit.Config("sdp4bit")  # qWD weights, TLq-HS gradients
numel = world * 65536

# Gradients: each rank's fp32 bucket in, this rank's shard of the sum out.
grads = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
shard = torch.empty(numel // world)
reduce_scatter = sdp4bit.GradReduceScatter(groups, config, numel, bucket_id=0)
reduce_scatter.start(grads, shard, step=0).wait()
exact = torch.empty_like(shard)
dist.reduce_scatter_tensor(exact, grads)
error = (shard - exact).norm() / exact.norm()

# Weights: every replica starts from the same bf16 bucket; each rank updates its own shard,
# and the all-gather leaves every replica with the same bits.
params = torch.randn(numel, generator=torch.Generator().manual_seed(0)).bfloat16()
all_gather = sdp4bit.WeightAllGather(groups, config, params, bucket_id=1)
mine = params[rank * numel // world:(rank + 1) * numel // world]
mine -= 1e-3 * torch.randn(mine.numel()).bfloat16()  # this rank's optimizer step
all_gather.start(params, step=0).wait()
replicas = [torch.empty_like(params) for _ in range(world)]
dist.all_gather(replicas, params)

if rank == 0:
    sent = reduce_scatter.wire_bytes(0).total + all_gather.wire_bytes().total
    uncompressed = (reduce_scatter.baseline_wire_bytes().total
                    + all_gather.baseline_wire_bytes().total)
    print(f"gradient shard relative error {error:.3f}; replicas identical: "
          f"{all(torch.equal(r, params) for r in replicas)}")
    print(f"bytes sent by rank 0: {sent:,} instead of {uncompressed:,} "
          f"({uncompressed / sent:.1f}x less)")
groups.close()
dist.destroy_process_group()
