"""A cost model of sdp4bit's communication: per training step, the bytes each DP rank sends
inside and between nodes for each preset (the Rust core's own byte accounting, planned without
communicating), the time that takes on a cluster's links, and the speedup over the
uncompressed collectives.

    python -m sdp4bit.plan --params 6.7e9 --nodes 16 --gpus-per-node 8 --tp 4 \\
        --intra-gbps 1600 --inter-gbps 400 --inter-latency-us 5 [--codec-gbps 300] \\
        [--compute-ms 900]
    python -m sdp4bit.plan --paper [--kernels latest] [--tokens-per-gpu 2048]
                                        # the paper's clusters beside its speedups
    python -m sdp4bit.plan --params 18e9 --nodes 16 --gpus-per-node 8 --instances 4 \\
        --inter-gbps 400                # hybrid sharding: 4 sharded groups of 4 nodes

Model, per DP rank and step (one gradient reduce-scatter and one parameter all-gather of the
rank's params / (TP x PP); docs/performance.md "The cost model"): the link time is the bytes the
core plans for the rank inside nodes at ``--intra-gbps`` (per rank) plus the inter-node bytes of
all the node's DP ranks sharing ``--inter-gbps`` (per node), at the fraction of the link the
transport achieves (``--link-fraction`` compressed, ``--uncompressed-link-fraction``
uncompressed). The CPU time is each rank's codec work (``--codec-gbps``: bytes of fp32 gradient
/ bf16 parameter input per second per rank; 0: not modelled), stretched where ranks outnumber
cores (``--ranks-per-core`` above 1) by the other ranks' work they queue behind at the fraction
``--core-share`` of the cores' time the ranks get, plus the transport's CPU per ms of link time
(``--wire-cpu``; 0 where a NIC or NCCL moves the bytes). Pipelined chunks overlap CPU and link: a
collective takes the longer of the two plus the fraction ``--unhidden-codec`` of the shorter
(``--uncompressed-unhidden`` for the uncompressed collectives), and every message adds a
latency (an all-to-all among k peers sends k - 1 per bucket). The fractions default to the
constants bench/calibrate_plan.py fits on the emulated cluster. With ``--compute-ms`` the step
is compute plus communication, none of it overlapped: the time compression saves is then an
upper bound (overlap would hide part of every preset's communication behind compute). With
``--instances N`` (hybrid sharding) each group of nodes/N nodes shards the model and the
gradient shards are all-reduced across the groups, its time and bytes shown apart: Global-QSGD's
integers for a compressing preset (a prediction: sdp4bit does not run that all-reduce yet), fp32
for the baseline.

``--paper`` prints the paper's clusters' communication alone, then predicts its 6.7B and 18B
steps end to end: the codec time of the GPU kernels as measured (``--kernels``, an entry of
sdp4bit/kernel_times.json) and at issue 42's targets, carried to the paper's GPUs by memory
bandwidth, and the compute of ``--tokens-per-gpu`` tokens per step at the measured GEMM rate,
carried by bf16 peak (sdp4bit.kernel_times).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from . import _native, kernel_times
from .config import Config, presets as preset_names

_SAMPLE_SHARD = 1 << 16  # elements per rank of the bucket planned to count bytes


@dataclass(frozen=True)
class Transport:
    """How the collectives use links and cores; the defaults are bench/calibrate_plan.py's fit
    on the emulated cluster (bench/results/plan_calibration.json)."""

    link_fraction: float = 0.89  # eta: of a link's rate the compressed presets' exchanges get
    uncompressed_link_fraction: float = 0.91  # eta_gloo: the same for the uncompressed ones
    unhidden_codec: float = 0.3  # beta: of the shorter of CPU and link time not overlapped
    uncompressed_unhidden: float = 0.06  # beta_gloo: the same for the uncompressed collectives
    core_share: float = 0.94  # kappa: of shared cores' time the ranks' work gets
    # gamma: CPU ms a rank's host transport spends per ms of link time (TCP wake-ups while a
    # slow link drains); 0 where a NIC or NCCL moves the bytes
    wire_cpu: float = 0.018

    def __post_init__(self):
        for name in ("link_fraction", "uncompressed_link_fraction", "core_share"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.wire_cpu >= 0:
            raise ValueError(f"wire_cpu must be non-negative, got {self.wire_cpu}")
        for name in ("unhidden_codec", "uncompressed_unhidden"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def cpu_ms(work_ms: float, ranks_per_core: float, core_share: float) -> float:
    """The wall time of one rank's `work_ms` of CPU work when `ranks_per_core` ranks (each with
    the same work) share every core: its own work plus, where ranks outnumber cores, the others'
    work it queues behind, `(ranks_per_core - 1) x work_ms`, of which the ranks get the fraction
    `core_share` of the cores' time. At one rank per core or fewer the sharing term is 0."""
    return work_ms * (1.0 + max(0.0, ranks_per_core - 1.0) / core_share)


def overlapped_ms(cpu: float, link: float, unhidden: float) -> float:
    """Time of CPU work and link transfer that overlap except for the fraction `unhidden` of
    the shorter of the two (0: perfectly overlapped, 1: one after the other)."""
    return max(cpu, link) + unhidden * min(cpu, link)


def collective_ms(work_ms: float, link_ms: float, compressed: bool, transport: Transport,
                  ranks_per_core: float = 1.0) -> float:
    """The model of a reduce-scatter plus all-gather: `work_ms` of CPU per rank (codec passes,
    copies, the transport's fixed CPU) plus the transport's CPU that grows with the time on the
    wire (`wire_cpu` x `link_ms`), and `link_ms`, the bytes over the busiest link at the
    link's full rate, which the transport runs at its fraction of the rate."""
    cpu = cpu_ms(work_ms + transport.wire_cpu * link_ms, ranks_per_core, transport.core_share)
    if compressed:
        return overlapped_ms(cpu, link_ms / transport.link_fraction, transport.unhidden_codec)
    return overlapped_ms(cpu, link_ms / transport.uncompressed_link_fraction,
                         transport.uncompressed_unhidden)


@dataclass(frozen=True)
class Cluster:
    """A cluster's shape and links."""

    nodes: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    intra_gbps: float = 1600.0  # per rank (NVLink-class)
    inter_gbps: float = 100.0  # per node
    intra_latency_us: float = 2.0
    inter_latency_us: float = 5.0
    ranks_per_core: float = 1.0  # above 1 only where ranks share cores (the emulated cluster)
    # Groups of whole nodes, each holding a sharded replica of the model: Megatron's
    # distributed-optimizer instances, FSDP2's HSDP replicate groups (1: one sharded group).
    instances: int = 1

    def __post_init__(self):
        if not self.ranks_per_core > 0:
            raise ValueError(f"ranks_per_core must be positive, got {self.ranks_per_core}")
        if self.instances < 1:
            raise ValueError(f"instances must be at least 1, got {self.instances}")

    def dp_layout(self) -> tuple[int, int]:
        """(DP ranks, DP ranks per node): TP inside a node, PP across nodes."""
        gpus = self.nodes * self.gpus_per_node
        if gpus % (self.tp * self.pp) or self.gpus_per_node % self.tp:
            raise ValueError(f"{self.nodes} x {self.gpus_per_node} GPUs do not split into "
                             f"TP={self.tp} inside nodes and PP={self.pp}")
        dp = gpus // (self.tp * self.pp)
        per_node = min(dp, max(1, self.gpus_per_node // self.tp))
        return dp, per_node

    def group_layout(self) -> tuple[int, int]:
        """(DP ranks of one sharded group, of them per node): the DP ranks split into
        `instances` groups of whole nodes."""
        dp, per_node = self.dp_layout()
        if dp % self.instances or (dp // self.instances) % per_node:
            raise ValueError(f"{dp} DP ranks ({per_node} per node) do not split into "
                             f"{self.instances} groups of whole nodes")
        return dp // self.instances, per_node


@dataclass(frozen=True)
class Bytes:
    """Bytes one DP rank sends per step: (intra, inter) for gradients and for weights."""

    grad: tuple[float, float]
    weight: tuple[float, float]


def step_bytes(preset: str, elements: float, dp: int, per_node: int) -> tuple[Bytes, Bytes]:
    """(this preset, uncompressed) bytes per step for `elements` elements per DP group, from
    the core's plan of a sample bucket scaled to `elements`."""
    labels = [z // per_node for z in range(dp)]
    sample = dp * _SAMPLE_SHARD
    counts = _native.ops().plan_wire_bytes(Config(preset).spec(), labels, sample, 1 << 20)
    scale = elements / sample
    c = [x * scale for x in counts]
    return Bytes((c[0], c[1]), (c[2], c[3])), Bytes((c[4], c[5]), (c[6], c[7]))


def cross_group_bytes(shard: float, instances: int) -> tuple[float, float]:
    """(Global-QSGD, uncompressed) bytes one rank sends per step in the all-reduce of its
    gradient shard of `shard` elements across `instances` groups, its peers one per group and
    each on another node. Uncompressed: a ring all-reduce of fp32, a reduce-scatter and an
    all-gather. Global-QSGD: the integers' reduce-scatter as the core plans it for
    `instances` ranks on as many nodes, then an all-gather of the summed integers, as many
    bytes again (its widths cannot overflow for the group, docs/numerics.md §7.6)."""
    if instances == 1:
        return 0.0, 0.0
    sample = instances * _SAMPLE_SHARD
    counts = _native.ops().plan_wire_bytes(Config("global-qsgd").spec(), list(range(instances)),
                                           sample, 1 << 20)
    scale = shard / sample  # the reduce-scatter's input is the rank's whole shard
    return 2 * counts[1] * scale, 2 * counts[5] * scale


def node_link_bytes(b: Bytes, per_node: int, compressed: bool) -> float:
    """Bytes the busiest link between nodes carries per direction for `b`, the bytes one of a
    node's `per_node` DP ranks sends. An all-to-all (the compressed presets' reduce-scatters)
    sends each rank's inter-node bytes straight to their destination, so the node's ranks add
    up on its link. A ring (the all-gathers, gloo's and NCCL's; NCCL's uncompressed
    reduce-scatter) orders the ranks node by node and crosses each node boundary once per
    direction, carrying every shard but one: W - 1 shards, what one rank sends in all (intra +
    inter). Nothing crosses when every peer is inside the node."""
    def ring(sent: tuple[float, float]) -> float:
        return sum(sent) if sent[1] > 0 else 0.0

    grad = per_node * b.grad[1] if compressed else ring(b.grad)
    return grad + ring(b.weight)


def bucket_link_ms(preset: str, elements: float, nodes: int, per_node: int,
                   rate_mbit: float) -> float:
    """Milliseconds the busiest node link needs at `rate_mbit` per direction for one bucket of
    `elements`' reduce-scatter and all-gather (`node_link_bytes`; the baseline as NCCL runs it,
    rings, the least an uncompressed collective sends between nodes)."""
    b, _ = step_bytes(preset, elements, nodes * per_node, per_node)
    compressed = Config(preset).compresses_grads
    return node_link_bytes(b, per_node, compressed) * 8 / (rate_mbit * 1e6) * 1e3


def comm_ms(b: Bytes, cluster: Cluster, buckets: int, codec_ms: float, compressed: bool,
            transport: Transport = Transport()) -> float:
    """Milliseconds of one step's gradient reduce-scatter and parameter all-gather: the codec
    passes' `codec_ms` overlapped with the link time at the achieved fraction of the links
    (`collective_ms`), plus the latency of every message."""
    dp, per_node = cluster.group_layout()
    nodes = dp // per_node
    intra = (b.grad[0] + b.weight[0]) / (cluster.intra_gbps * 1e9 / 8)
    inter = node_link_bytes(b, per_node, compressed) / (cluster.inter_gbps * 1e9 / 8)
    messages = 2 * buckets  # one reduce-scatter and one all-gather per bucket
    latency = messages * ((per_node - 1) * cluster.intra_latency_us
                          + (nodes - 1) * cluster.inter_latency_us) * 1e-6
    busy = collective_ms(codec_ms * 1e-3, intra + inter, compressed, transport,
                         cluster.ranks_per_core)
    return (busy + latency) * 1e3


def cross_group_ms(sent: float, cluster: Cluster, buckets: int, compressed: bool,
                   transport: Transport) -> float:
    """Milliseconds of one step's all-reduce across groups, `sent` bytes per rank: every rank
    of a node sends its own across the node's link at once, each bucket a reduce-scatter and
    an all-gather of `instances - 1` messages; no codec CPU modelled."""
    if cluster.instances == 1:
        return 0.0
    _, per_node = cluster.group_layout()
    link = per_node * sent / (cluster.inter_gbps * 1e9 / 8)
    fraction = transport.link_fraction if compressed else transport.uncompressed_link_fraction
    latency = 2 * buckets * (cluster.instances - 1) * cluster.inter_latency_us * 1e-6
    return (link / fraction + latency) * 1e3


def codec_ms_per_step(preset: str, elements: float, codec_gbps: float,
                      codec_ms: dict[str, float] | None) -> float:
    """One rank's codec time per step: `codec_ms[preset]` where given (the GPU kernels'),
    else `elements` of fp32 gradient and bf16 parameter input at `codec_gbps` GB/s (0: not
    modelled); 0 for a preset that compresses nothing."""
    if not Config(preset).compresses_grads:
        return 0.0
    if codec_ms is not None and preset in codec_ms:
        return codec_ms[preset]
    return elements * (4 + 2) / (codec_gbps * 1e6) if codec_gbps > 0 else 0.0


def predict(params: float, cluster: Cluster, presets=None, bucket_elements: float = 40e6,
            codec_gbps: float = 0.0, compute_ms: float | None = None,
            transport: Transport = Transport(),
            codec_ms: dict[str, float] | None = None) -> list[dict]:
    """One row per preset (default: every preset): bytes per step, codec and communication
    time, speedups over uncompressed; with `compute_ms`, the step (compute plus communication,
    not overlapped) and its speedup. `codec_ms` gives presets' codec time per step on one rank
    (the GPU kernels', `sdp4bit.kernel_times`) instead of `codec_gbps`. With
    `cluster.instances` above 1 (hybrid sharding) the model is sharded inside each group and
    its gradient shards all-reduced across the groups: `cross_bytes` / `cross_ms` are that
    all-reduce's, with Global-QSGD for a compressing preset and fp32 for the uncompressed
    baseline (included in `bytes` and `comm_ms`)."""
    presets = preset_names() if presets is None else presets
    dp, per_node = cluster.group_layout()
    elements = params / (cluster.tp * cluster.pp)
    buckets = max(1, round(elements / bucket_elements))
    cross, cross_base = cross_group_bytes(elements / dp, cluster.instances)
    t_cross_base = cross_group_ms(cross_base, cluster, buckets, False, transport)
    rows = []
    for preset in presets:
        mine, base = step_bytes(preset, elements, dp, per_node)
        compressed = Config(preset).compresses_grads
        sent = cross if compressed else cross_base
        t_cross = cross_group_ms(sent, cluster, buckets, compressed, transport)
        codec = codec_ms_per_step(preset, elements, codec_gbps, codec_ms)
        t = comm_ms(mine, cluster, buckets, codec, compressed, transport) + t_cross
        t_base = comm_ms(base, cluster, buckets, 0.0, False, transport) + t_cross_base
        row = {"preset": preset, "bytes": sum(mine.grad) + sum(mine.weight) + sent,
               "baseline_bytes": sum(base.grad) + sum(base.weight) + cross_base,
               "codec_ms": codec, "comm_ms": t, "baseline_comm_ms": t_base,
               "comm_speedup": t_base / t, "cross_bytes": sent, "cross_ms": t_cross}
        if compute_ms is not None:
            row.update(compute_ms=compute_ms, step_ms=compute_ms + t,
                       step_speedup=(compute_ms + t_base) / (compute_ms + t))
        rows.append(row)
    return rows


#: Hybrid sharding at the paper's larger scale: its H800 cluster as 4 groups of 4 nodes.
PAPER_HYBRID = ("16 nodes x 8 H800 as 4 sharded groups of 4 nodes (hybrid sharding; the "
                "all-reduce across groups is not implemented yet, issue 34)",
                Cluster(16, 8, tp=1, intra_gbps=3200, inter_gbps=400, instances=4))

#: The paper's clusters (docs/numerics.md §10) with the link speeds assumed for them here, the
#: end-to-end speedups the paper measured on them and their GPUs.
PAPER = (
    ("16 nodes x 4 A100, Slingshot-10", Cluster(16, 4, tp=1, intra_gbps=2400, inter_gbps=100),
     "2.39x-3.44x", kernel_times.A100),
    ("16 nodes x 8 H800, InfiniBand", Cluster(16, 8, tp=1, intra_gbps=3200, inter_gbps=400),
     "1.53x-4.08x", kernel_times.H800),
)

#: The paper's models whose end-to-end speedup `--paper` predicts.
PAPER_MODELS = (6.7e9, 18e9)

#: Tokens each GPU computes per step in `--paper`'s prediction unless `--tokens-per-gpu` says
#: otherwise: one sequence of 2048 (micro-batch 1, no gradient accumulation). An assumption:
#: the paper's batch sizes are not in the text of it this project has (docs/numerics.md §10).
PAPER_TOKENS_PER_GPU = 2048

#: The paper's clusters' transport: NCCL-class collectives, every preset at the same fraction
#: of the link (the rate itself); the overlap as calibrated. The emulated cluster's fractions
#: (the defaults) are TCP's through a shaped queue and gloo's.
PAPER_TRANSPORT = Transport(link_fraction=1.0, uncompressed_link_fraction=1.0, core_share=1.0,
                            wire_cpu=0.0)


def end_to_end(params: float, cluster: Cluster, gpu: kernel_times.Gpu,
               times: kernel_times.KernelTimes, presets, bucket_elements: float,
               tokens_per_gpu: float, at_targets: bool) -> list[dict]:
    """`predict`'s rows on the paper's transport with each preset's codec time from the
    measured kernels (or at issue 42's targets) carried to `gpu`, and the compute of
    `tokens_per_gpu` tokens per step at the measured GEMM rate; each row also names the kernels
    its codec time leaves out (`codec_missing`)."""
    elements = params / (cluster.tp * cluster.pp)
    dp, _ = cluster.group_layout()
    codecs = {p: kernel_times.codec(times, p, dp, bucket_elements, at_targets) for p in presets}
    rows = predict(params, cluster, presets, bucket_elements,
                   compute_ms=kernel_times.compute_ms(elements, tokens_per_gpu, times, gpu),
                   transport=PAPER_TRANSPORT,
                   codec_ms={p: c.ms(elements, times, gpu) for p, c in codecs.items()})
    for row in rows:
        row["codec_missing"] = codecs[row["preset"]].missing
    return rows


def dominant_term(compute: float, comm: float, codec: float) -> str:
    """The largest of a step's terms: compute, communication or codec."""
    terms = {"compute": compute, "communication": comm, "codec": codec}
    return max(terms, key=terms.get)


def _print(rows: list[dict]) -> None:
    step = "step_speedup" in rows[0]
    cross = any(r["cross_bytes"] for r in rows)
    print(f"{'preset':<12} {'GB/step/rank':>12} {'comm ms':>9} {'uncompressed ms':>16} "
          f"{'comm speedup':>12}" + (f" {'step speedup':>12}" if step else "")
          + (f" {'across groups: GB':>17} {'ms':>7}" if cross else ""))
    for r in rows:
        print(f"{r['preset']:<12} {r['bytes'] / 1e9:12.3f} {r['comm_ms']:9.1f} "
              f"{r['baseline_comm_ms']:16.1f} {r['comm_speedup']:11.2f}x"
              + (f" {r['step_speedup']:11.2f}x" if step else "")
              + (f" {r['cross_bytes'] / 1e9:17.3f} {r['cross_ms']:7.1f}" if cross else ""))


def _target_fractions() -> str:
    """Issue 42's per-kernel targets, grouped by fraction of the copy."""
    by_fraction: dict[float, list[str]] = {}
    for kernel, fraction in kernel_times.TARGETS.copy_fraction.items():
        by_fraction.setdefault(fraction, []).append(kernel)
    return "; ".join(f"{f:g}x {', '.join(k)}" for f, k in sorted(by_fraction.items()))


def _print_end_to_end_assumptions(times: kernel_times.KernelTimes, tokens_per_gpu: float) -> None:
    """What the end-to-end prediction assumes, and where its figures come from."""
    print("== End to end on the paper's clusters: a PREDICTION from parts measured apart, not a "
          "measurement")
    print(f"   kernels (--kernels): {times.name}, {times.gpu.name}, {times.date}: device copy "
          f"{times.copy_gbps:g} GB/s, bf16 GEMM {times.gemm_tflops():g} TFLOP/s "
          f"(sdp4bit/kernel_times.json, from {', '.join(times.source_files())})")
    print("   codec ms: one rank's compression kernels per step on its gradient and parameter "
          "elements (sdp4bit: its per-bucket sequence at the measured bucket size nearest "
          "--bucket-elements; the others: their kernel rows), timed at W = 4 (2 x 2), carried "
          "to each GPU by datasheet HBM bandwidth: the kernels are assumed memory- or "
          "latency-bound")
    print(f"   at issue 42's targets (item 6): each kernel at its fraction of the copy "
          f"({_target_fractions()}); sdp4bit's sequence at {kernel_times.TARGETS.sequence:g}x "
          f"its bytes' time at copy speed; none slower than measured")
    print(f"   compute ms: 6 x params x {tokens_per_gpu:g} tokens per GPU per step "
          f"(--tokens-per-gpu; assumed, default one {PAPER_TOKENS_PER_GPU}-token sequence: the "
          f"paper's batch is not known here) at the GEMM rate carried to each GPU by dense bf16 "
          f"peak; attention's products and the step's other work are not counted")
    print(f"   step ms: compute + communication, the codec overlapping the link as the model says "
          f"(the longer + {PAPER_TRANSPORT.unhidden_codec:g} x the shorter, plus latency), "
          f"nothing overlapping compute: the time compression saves is an upper bound")


def _print_sdp4bit_summary(alone: dict, now: dict, goal: dict, measured: str) -> None:
    """sdp4bit's predicted speedups beside the paper's, and which term dominates its step:
    `alone` its communication-only row, `now` and `goal` its end-to-end rows today and at the
    targets."""
    dominant = [dominant_term(r["compute_ms"], alone["comm_ms"], r["codec_ms"])
                for r in (now, goal)]
    at_targets = ("and at the targets" if dominant[1] == dominant[0]
                  else f", {dominant[1]} at the targets")
    compute = now["compute_ms"]
    codec_free = (compute + alone["baseline_comm_ms"]) / (compute + alone["comm_ms"])
    print(f"   sdp4bit: {now['step_speedup']:.2f}x today, {goal['step_speedup']:.2f}x at the "
          f"targets ({codec_free:.2f}x without codec time), beside the paper's {measured}; "
          f"{dominant[0]} dominates its step today (communication {alone['comm_ms']:.0f} ms, "
          f"compute {compute:.0f} ms, codec {now['codec_ms']:.0f} ms) {at_targets} (codec "
          f"{goal['codec_ms']:.0f} ms)")


def _print_end_to_end(params: float, cluster: Cluster, gpu: kernel_times.Gpu, measured: str,
                      times: kernel_times.KernelTimes, presets, bucket_elements: float,
                      tokens_per_gpu: float) -> None:
    """One model's predicted step per preset, with today's kernels and at the targets, then
    sdp4bit's summary."""
    alone = {r["preset"]: r for r in predict(params, cluster, presets, bucket_elements,
                                             transport=PAPER_TRANSPORT)}
    today, targets = (end_to_end(params, cluster, gpu, times, presets, bucket_elements,
                                 tokens_per_gpu, at_targets) for at_targets in (False, True))
    print(f"{f'   prediction, {params / 1e9:g}B parameters':<35}|"
          f"{f' today ({times.name})':<30}|{' at issue 42 targets':<30}|")
    print(f"{'preset':<12} {'comm ms':>9} {'compute ms':>11} |"
          + f" {'codec ms':>9} {'step ms':>9} {'speedup':>8} |" * 2)
    for now, goal in zip(today, targets):
        print(f"{now['preset']:<12} {alone[now['preset']]['comm_ms']:9.1f} "
              f"{now['compute_ms']:11.1f} |"
              + "".join(f" {r['codec_ms']:9.1f}{'*' if r['codec_missing'] else ' '}"
                        f"{r['step_ms']:9.1f} {r['step_speedup']:7.2f}x |" for r in (now, goal)))
    if "sdp4bit" in alone:
        now, goal = (next(r for r in rows if r["preset"] == "sdp4bit")
                     for rows in (today, targets))
        _print_sdp4bit_summary(alone["sdp4bit"], now, goal, measured)


def _print_paper_end_to_end(times: kernel_times.KernelTimes, presets, bucket_elements: float,
                            tokens_per_gpu: float) -> None:
    """The paper's 6.7B and 18B models on its clusters, end to end, beside its speedups."""
    _print_end_to_end_assumptions(times, tokens_per_gpu)
    for name, cluster, measured, gpu in PAPER:
        print(f"-- {name}; the paper measured {measured} end to end")
        print(f"   GPU {gpu.name}: {gpu.datasheet}")
        dp, _ = cluster.group_layout()
        missing = {p: kernel_times.preset_kernels(p, dp).missing for p in presets}
        if any(missing.values()):
            print("   * not measured, left out of codec ms:")
        for preset, kernels in missing.items():
            if kernels:
                print(f"     {preset}: {'; '.join(kernels)}")
        for params in PAPER_MODELS:
            _print_end_to_end(params, cluster, gpu, measured, times, presets, bucket_elements,
                              tokens_per_gpu)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m sdp4bit.plan",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, help="model parameters, e.g. 6.7e9")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--instances", type=int, default=1,
                   help="hybrid sharding: DP ranks split into this many groups of whole nodes, "
                        "sharded inside a group, gradients all-reduced across groups")
    p.add_argument("--intra-gbps", type=float, default=1600.0, help="per rank, Gbit/s")
    p.add_argument("--inter-gbps", type=float, default=100.0, help="per node, Gbit/s")
    p.add_argument("--intra-latency-us", type=float, default=2.0)
    p.add_argument("--inter-latency-us", type=float, default=5.0)
    p.add_argument("--ranks-per-core", type=float, default=1.0,
                   help="ranks sharing each core that runs the codec (above 1: CPU sharing)")
    p.add_argument("--bucket-elements", type=float, default=40e6)
    p.add_argument("--codec-gbps", type=float, default=0.0,
                   help="measured codec throughput, GB/s of input per rank (0: not modelled)")
    p.add_argument("--compute-ms", type=float, help="compute time of one step, ms")
    default = Transport()
    p.add_argument("--link-fraction", type=float, default=default.link_fraction,
                   help="fraction of the link rate the compressed exchanges achieve")
    p.add_argument("--uncompressed-link-fraction", type=float,
                   default=default.uncompressed_link_fraction,
                   help="fraction of the link rate the uncompressed collectives achieve")
    p.add_argument("--unhidden-codec", type=float, default=default.unhidden_codec,
                   help="fraction of the shorter of codec and link time not overlapped")
    p.add_argument("--uncompressed-unhidden", type=float, default=default.uncompressed_unhidden,
                   help="the same for the uncompressed collectives")
    p.add_argument("--core-share", type=float, default=default.core_share,
                   help="fraction of shared cores' time the ranks' work gets")
    p.add_argument("--wire-cpu", type=float, default=default.wire_cpu,
                   help="CPU ms a rank's transport spends per ms of link time (0: NIC/NCCL)")
    p.add_argument("--presets", default=",".join(preset_names()))
    p.add_argument("--paper", action="store_true",
                   help="predict the paper's clusters (1.3B-18B) beside its measured speedups, "
                   "with every preset at the link's rate (PAPER_TRANSPORT), then its 6.7B and "
                   "18B steps end to end with the measured GPU kernels and GEMM rate")
    p.add_argument("--kernels", help="with --paper: the measured kernel times, an entry of "
                   f"sdp4bit/kernel_times.json by name or {kernel_times.LATEST!r} (the default)")
    p.add_argument("--tokens-per-gpu", type=float,
                   help="with --paper: tokens each GPU computes per step (default "
                   f"{PAPER_TOKENS_PER_GPU}, an assumption)")
    args = p.parse_args(argv)
    presets = args.presets.split(",")
    try:
        transport = Transport(args.link_fraction, args.uncompressed_link_fraction,
                              args.unhidden_codec, args.uncompressed_unhidden, args.core_share,
                              args.wire_cpu)
    except ValueError as error:
        p.error(str(error))
    if not args.paper and (args.kernels or args.tokens_per_gpu):
        p.error("--kernels and --tokens-per-gpu apply to --paper")
    if args.paper:
        try:
            times = kernel_times.load(args.kernels or kernel_times.LATEST)
        except ValueError as error:
            p.error(str(error))
        for name, cluster, measured, _ in PAPER:
            print(f"== {name} (assumed {cluster.inter_gbps:g} Gbit/s per node between nodes, "
                  f"{cluster.intra_gbps:g} inside); the paper measured {measured} end to end")
            for params in (1.3e9, 6.7e9, 18e9):
                print(f"-- {params / 1e9:g}B parameters, communication only")
                _print(predict(params, cluster, presets, args.bucket_elements, args.codec_gbps,
                               transport=PAPER_TRANSPORT))
        name, cluster = PAPER_HYBRID
        print(f"== {name}; nothing measured")
        for params in (6.7e9, 18e9):
            print(f"-- {params / 1e9:g}B parameters, communication only")
            _print(predict(params, cluster, presets, args.bucket_elements, args.codec_gbps,
                           transport=PAPER_TRANSPORT))
        _print_paper_end_to_end(times, presets, args.bucket_elements,
                                args.tokens_per_gpu or PAPER_TOKENS_PER_GPU)
        return
    missing = [f"--{n.replace('_', '-')}" for n in ("params", "nodes", "gpus_per_node")
               if getattr(args, n) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (or --paper)")
    try:
        cluster = Cluster(args.nodes, args.gpus_per_node, args.tp, args.pp, args.intra_gbps,
                          args.inter_gbps, args.intra_latency_us, args.inter_latency_us,
                          args.ranks_per_core, args.instances)
        cluster.group_layout()
    except ValueError as error:
        p.error(str(error))
    _print(predict(args.params, cluster, presets, args.bucket_elements, args.codec_gbps,
                   args.compute_ms, transport))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
