"""megatron-core integration: the distributed optimizer's gradient reduce-scatter and
parameter all-gather go through sdp4bit.

``enable(config)`` patches ``_ParamAndGradBucketGroup.start_grad_sync`` and
``start_param_sync`` (megatron-core 0.16): for every bucket group of a DDP model using the
distributed optimizer, each bucket's reduce-scatter and all-gather run as a compressed
collective on sdp4bit's thread and the group's handle is a :class:`BucketGroupHandle`, whose
``wait()`` completes them, so Megatron's ``finish_grad_sync`` / ``finish_param_sync`` and the
overlap machinery work unchanged. Megatron's contract is kept: after grad sync this rank's
shard of each bucket holds the scaled sum over the DP group; after param sync every replica
holds the same parameters, bit for bit.

What sdp4bit does not compress by design goes through Megatron's own code untouched: the
baseline codecs, gradient steps before ``grad_quant_start_step`` and forced all-reduces. What
it cannot compress is refused when the model is built, naming the setting to change: the
non-distributed optimizer, several distributed-optimizer instances, FP8 parameters, fp16
gradient buffers (and fp16 parameters where weights are compressed), Megatron-FSDP and torch
FSDP2 inside Megatron.

A bucket group's collectives are set up at its first gradient sync (after set-up or a
resume), when every replica holds the same parameters: qWD takes its first differences
against them, so set-up checks that they really are the same on every rank and raises
otherwise.

Megatron also keeps copies bit-identical outside the DP group: parameters replicated across
tensor-parallel ranks, and the word embedding tied between the first and the last pipeline
stage. The ``exact_params`` knob makes the replicated ones (by default) travel exact beside
the compressed bucket; the tied embedding's bucket is numbered alike on both stages, so that
both draw the same random numbers (docs/megatron.md, "Parameters kept exact").
:func:`check_replicated_params` compares the copies.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sdp4bit import (Config, CrossGroupAllReduce, GradReduceScatter, Handle, ProcessGroups,
                     Sdp4bitError, WeightAllGather, limits)
from sdp4bit._patching import Patches
from sdp4bit.integration import (WireCounter, cross_group_buffer, cross_group_len, local_shard,
                                 log_route_notice, require_bf16, ring_all_reduce_bytes)
from sdp4bit.replicas import check_replicas_identical, checksums_across
from sdp4bit.telemetry import ErrorStats, Telemetry, announce, logger

_PATCHES = Patches()
# The bucket group's methods whose names the DDP class's patches also use (finish_grad_sync).
_GROUP_PATCHES = Patches()
# The data-parallel wrappers sdp4bit refuses, by class name (each __init__ in a set of its own:
# a set names each attribute once).
_WRAPPER_PATCHES: dict[str, Patches] = {}


@dataclass
class _Settings:
    config: Config
    local_world_size: int | None
    groups: dict[str, ProcessGroups] = field(default_factory=dict)
    next_bucket_id: int = 0
    # Gradient steps to resume bucket groups at, by their first bucket's id (load_state_dict).
    resume_steps: dict[int, int] = field(default_factory=dict)
    # The training loop's iteration, where it keeps one (Megatron-LM's args.iteration): a
    # bucket group set up after a resume starts counting there.
    iteration: object = None
    telemetry: Telemetry = field(default_factory=lambda: Telemetry(0))
    bucket_groups: list = field(default_factory=list)  # those set up, in set-up order
    models: list = field(default_factory=list)  # DDP models built since enable, in order
    replica_check_interval: int = 0  # check_replicated_params every N gradient syncs (0: never)
    replica_checks: int = 0  # gradient syncs of the first model so far


_SETTINGS: _Settings | None = None


def _bucket_group_class():
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    return _ParamAndGradBucketGroup


def _other_wrapper_classes() -> list:
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


def _ddp_class():
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel


def _ddp_init(self, *args, **kwargs):
    """DistributedDataParallel.__init__, then numbers its buckets: in buffer order, counting
    on from earlier models (model chunks), so the numbering (which seeds each bucket's random
    streams) does not depend on how buckets are grouped or when they first communicate. The
    bucket of the word embedding tied across pipeline stages (megatron-core gives it a bucket
    of its own, laid out alike on the first and the last stage) takes the largest id on both
    stages, so that their all-gathers give the same bits. Each bucket also records where its
    exact parameters (the ``exact_params`` knob) lie."""
    original = _PATCHES.original("__init__")
    settings = _SETTINGS
    if settings is None:
        return original(self, *args, **kwargs)
    arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
    _refuse_ddp_config(arguments["ddp_config"], arguments["module"])
    original(self, *args, **kwargs)
    _refuse_buffer_dtypes(self, settings.config)
    tied_id = limits().max_bucket_id
    exact = _exact_params(self, settings.config.resolved.exact_params)
    for buffer in self.buffers + self.expert_parallel_buffers:
        for bucket in buffer.buckets:
            if any(getattr(p, "shared_embedding", False) for p in bucket.params_list):
                bucket_id = tied_id
            else:
                bucket_id = settings.next_bucket_id
                settings.next_bucket_id += 1
                if bucket_id == tied_id:
                    raise Sdp4bitError(
                        f"more than {tied_id} DDP buckets: sdp4bit's random streams number "
                        f"buckets up to {tied_id - 1} (and {tied_id}, the tied word "
                        "embedding's); make the buckets larger (bucket_size)")
            bucket.sdp4bit_bucket_id = bucket_id
            starts = {p: buffer.param_index_map[p][0] - bucket.offset for p in bucket.params_list}
            bucket.sdp4bit_exact_params = [p for p in bucket.params_list if p in exact]
            if (bucket.sdp4bit_exact_params and len(bucket.sdp4bit_exact_params)
                    < len(bucket.params_list)
                    and self.ddp_config.num_distributed_optimizer_instances > 1):
                raise Sdp4bitError(
                    f"exact_params={settings.config.resolved.exact_params} keeps some "
                    "parameters of a bucket exact, which sdp4bit does not do yet with "
                    f"{self.ddp_config.num_distributed_optimizer_instances} distributed-"
                    "optimizer instances; set exact_params=none (or "
                    "--num-distributed-optimizer-instances 1)")
            bucket.sdp4bit_exact = sorted((starts[p], starts[p] + p.numel())
                                          for p in bucket.sdp4bit_exact_params)
    settings.models.append(self)


def _exact_params(ddp, mode: str) -> set:
    """The parameters of the DDP model `ddp` that the ``exact_params`` knob's `mode` keeps
    exact: none; those Megatron replicates across tensor-parallel ranks (no
    ``tensor_model_parallel`` attribute, when TP > 1); or those plus every 1-D parameter (norm
    weights and biases, every bias) and the embedding tables (the word embedding, tied or not,
    and learned position embeddings)."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    if mode == "none":
        return set()
    params = list(ddp.module.parameters())
    exact = set()
    if _tensor_parallel_group(ddp).size() > 1:
        exact.update(p for p in params if not getattr(p, "tensor_model_parallel", False))
    if mode == "norms-biases-embeddings":
        exact.update(p for p in params if p.dim() == 1 or getattr(p, "shared_embedding", False))
        exact.update(m.weight for m in ddp.module.modules()
                     if isinstance(m, (torch.nn.Embedding, VocabParallelEmbedding)))
    return exact


def _tensor_parallel_group(ddp):
    """The tensor-parallel group of a DDP model (its own where megatron-core keeps one)."""
    group = getattr(ddp, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _ddp_finish_grad_sync(self, *args, **kwargs):
    """DistributedDataParallel.finish_grad_sync, after :func:`check_replicated_params` on every
    `replica_check_interval`-th call for the first model: finalize_model_grads calls it on every
    rank after the pipeline schedule, when each stage's forward has gathered every parameter
    and no rank waits for another's activations."""
    settings = _SETTINGS
    if (settings is not None and settings.replica_check_interval and settings.models
            and self is settings.models[0]):
        if settings.replica_checks % settings.replica_check_interval == 0:
            check_replicated_params(settings.models)
        settings.replica_checks += 1
    return _PATCHES.original("finish_grad_sync")(self, *args, **kwargs)


def enable(config: Config, local_world_size: int | None = None,
           iteration=None, telemetry_interval: int = 0, tensorboard_writer=None,
           wandb_writer=None, replica_check_interval: int = 0) -> None:
    """Routes the distributed optimizer's collectives through sdp4bit with `config`.

    Call it on every rank before the DDP model is built. `local_world_size` (ranks per node;
    default ``LOCAL_WORLD_SIZE``) defines the intra- and inter-node levels. `iteration`, if
    given, is a function returning the training loop's current iteration (one gradient sync
    per iteration): a bucket group set up after a resume then numbers its random streams from
    there, so no sdp4bit state needs checkpointing; without it, save :func:`state_dict` and
    restore it with :func:`load_state_dict`. Every `telemetry_interval` steps (0: never) each
    bucket group reports bytes sent and the quantization error of its gradients and
    parameters against Megatron's exact collectives (:mod:`sdp4bit.telemetry`) to rank 0's
    output (:func:`sdp4bit.telemetry.announce`), `tensorboard_writer` and `wandb_writer`
    (each a writer, or a function returning one, as Megatron-LM's getters). Every
    `replica_check_interval` gradient syncs (0: never; the first one included) of the first DDP
    model built, :func:`check_replicated_params` runs on all of them before the sync.
    """
    global _SETTINGS
    description = config.describe()  # raises Sdp4bitError for a bad preset or knob
    if not isinstance(replica_check_interval, int) or replica_check_interval < 0:
        raise ValueError(f"sdp4bit: replica_check_interval must be a non-negative int, got "
                         f"{replica_check_interval!r}")
    cls = _bucket_group_class()
    _PATCHES.install(cls, "start_grad_sync", _start_grad_sync)
    _PATCHES.install(cls, "start_param_sync", _start_param_sync)
    _GROUP_PATCHES.install(cls, "finish_grad_sync", _finish_grad_sync)
    _PATCHES.install(_ddp_class(), "__init__", _ddp_init)
    _PATCHES.install(_ddp_class(), "finish_grad_sync", _ddp_finish_grad_sync)
    for wrapper in _other_wrapper_classes():
        _WRAPPER_PATCHES.setdefault(wrapper.__name__, Patches()).install(
            wrapper, "__init__", _refuse_other_wrapper)
    _SETTINGS = _Settings(
        config,
        local_world_size,
        iteration=iteration,
        telemetry=Telemetry(telemetry_interval, tensorboard_writer, wandb_writer),
        replica_check_interval=replica_check_interval,
    )
    announce(f"sdp4bit enabled for megatron-core's distributed optimizer: {description}")


def disable() -> None:
    """Restores Megatron's own collectives: completes sdp4bit's collectives in flight,
    forgets every bucket group's state and closes the process groups sdp4bit built. Call it
    on every rank before ``torch.distributed.destroy_process_group()``."""
    global _SETTINGS
    if _SETTINGS is not None:
        for bucket_group in _SETTINGS.bucket_groups:
            if bucket_group._sdp4bit.across is not None:
                bucket_group._sdp4bit.across.close()
            del bucket_group._sdp4bit
        for groups in _SETTINGS.groups.values():
            groups.close()
    _PATCHES.restore()
    _GROUP_PATCHES.restore()
    for patches in _WRAPPER_PATCHES.values():
        patches.restore()
    _SETTINGS = None


def is_enabled() -> bool:
    return _SETTINGS is not None


class BucketGroupHandle:
    """The compressed collectives of one bucket group; ``wait()`` completes all of them and
    then runs the group's finishing step (copying back bf16 gradients, averaging)."""

    def __init__(self, handles: list[Handle], finish=None) -> None:
        self._handles = handles
        self._finish = finish

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class _ExactElements:
    """The elements of one bucket that travel exact beside its compressed collectives
    (docs/megatron.md, "Parameters kept exact"): their indices in the bucket, the same on every
    DP rank, and which of them lie in this rank's shard. Each path is one asynchronous
    all-reduce over the DP group of the elements, issued before the compressed collective
    starts and completed after it, from the training thread in program order."""

    def __init__(self, ranges: list[tuple[int, int]], device: torch.device, rank: int,
                 shard_len: int) -> None:
        index = torch.cat([torch.arange(start, end) for start, end in ranges])
        first = rank * shard_len
        low, high = torch.searchsorted(index, torch.tensor([first, first + shard_len])).tolist()
        self.mine = slice(low, high)  # this rank's elements, in `index`
        self.index = index.to(device)
        self.own_index = self.index[self.mine]
        self.in_shard = self.own_index - first
        self.set_up_values: torch.Tensor | None = None  # this rank's, as the bucket was set up

    def start_grads(self, grads: torch.Tensor, group):
        """Issues the fp32 sum over `group` of every rank's exact elements of `grads`."""
        values = grads.index_select(0, self.index).float()
        return dist.all_reduce(values, group=group, async_op=True), values

    def finish_grads(self, pending, shard: torch.Tensor) -> None:
        """Completes :meth:`start_grads` and writes the sums of this rank's elements into
        `shard`, over what the compressed reduce-scatter gave them."""
        work, values = pending
        work.wait()
        shard.index_copy_(0, self.in_shard, values[self.mine].to(shard.dtype))

    def keep_set_up_values(self, params: torch.Tensor) -> None:
        """Keeps this rank's exact elements of `params` as the bucket's all-gather is set up
        (qWD's first reference)."""
        self.set_up_values = params.index_select(0, self.own_index)

    def start_params(self, params: torch.Tensor, group):
        """Takes this rank's new exact values out of `params`, putting back the values kept at
        set-up, and issues their all-gather over `group`. The compressed all-gather then
        carries the set-up values, which qWD encodes exactly: its reference for them never
        changes, since they always go this way, so their difference is 0 and so is its code,
        and every replica's apply leaves them as they were. The exact values go as a byte-wise
        SUM all-reduce of every rank's exact elements, each byte non-zero on its owner only,
        which adds nothing to it."""
        values = torch.zeros(len(self.index), dtype=params.dtype, device=params.device)
        values[self.mine] = params.index_select(0, self.own_index)
        params.index_copy_(0, self.own_index, self.set_up_values)
        return dist.all_reduce(values.view(torch.uint8), group=group, async_op=True), values

    def finish_params(self, pending, params: torch.Tensor) -> None:
        """Completes :meth:`start_params` and writes every owner's exact values into
        `params`."""
        work, values = pending
        work.wait()
        params.index_copy_(0, self.index, values)

    def wire_bytes(self, world: int, element_bytes: int) -> int:
        """Bytes one rank sends in one all-reduce of the elements, `element_bytes` each, over
        `world` ranks, as a ring sends them (a reduce-scatter, then an all-gather)."""
        return ring_all_reduce_bytes(len(self.index), world, element_bytes)


class _AcrossInstances:
    """The all-reduce of each bucket's shard across the distributed-optimizer instances
    (``num_distributed_optimizer_instances > 1``; docs/megatron.md, "Hybrid sharding"): with
    ``cross_group_bits`` 8 or 16, Global-QSGD integers summed by the instances' group
    (:class:`sdp4bit.CrossGroupAllReduce`, numerics §7.6), a bucket kept exact whole and
    ``cross_group_bits=exact`` through Megatron's own fp32 all-reduce. Run from the training
    thread after the reduce-scatter inside the instance, as megatron-core runs it."""

    def __init__(self, settings: _Settings, group: dist.ProcessGroup, shard_lens: list[int],
                 bucket_ids: list[int], exact: list[bool], device: torch.device) -> None:
        self.group = group
        self.size = group.size()
        self.shard_lens = shard_lens
        config = settings.config
        self.groups = None
        self.reduces: list[CrossGroupAllReduce | None] = [None] * len(shard_lens)
        if dict(config.resolved.values)["cross_group_bits"] != "exact" and not all(exact):
            self.groups = ProcessGroups.create(group, node_labels=list(range(self.size)))
            rank = dist.get_rank()
            self.reduces = [
                None if whole else CrossGroupAllReduce(
                    self.groups, config, cross_group_len(n, self.size), bucket_id,
                    stream_rank=rank, device=device)
                for n, bucket_id, whole in zip(shard_lens, bucket_ids, exact)]

    def run(self, shards: list[torch.Tensor], step: int) -> None:
        """All-reduces every bucket's shard in place across the instances."""
        handles, buffers = [], []
        for shard, reduce in zip(shards, self.reduces):
            if reduce is None:
                handles.append(dist.all_reduce(shard, group=self.group, async_op=True))
                buffers.append(shard)
                continue
            buffers.append(cross_group_buffer(shard, self.size))
            handles.append(reduce.start(buffers[-1], step))
        for shard, handle, data in zip(shards, handles, buffers):
            handle.wait()
            if data is not shard:
                shard.copy_(data[:shard.numel()])

    def compresses(self) -> bool:
        """Whether any bucket's all-reduce is Global-QSGD's."""
        return any(reduce is not None for reduce in self.reduces)

    def count(self, wire: WireCounter) -> None:
        """Adds one call's bytes, and Megatron's fp32 ring all-reduce's, to `wire`."""
        for reduce, n in zip(self.reduces, self.shard_lens):
            ring = ring_all_reduce_bytes(n, self.size)
            if reduce is None:
                wire.add(ring, ring)
            else:
                wire.add(reduce.wire_bytes(), ring)

    def close(self) -> None:
        if self.groups is not None:
            self.groups.close()


@dataclass
class _BucketGroupState:
    """sdp4bit's per-bucket-group state, kept on the bucket group."""

    groups: ProcessGroups
    grad: list[GradReduceScatter]
    weight: list[WeightAllGather]
    # Per bucket: the exact elements of a bucket that mixes them with compressed ones, or None.
    exact: list[_ExactElements | None]
    # Per bucket: whether all of it is exact, its collectives then the uncompressed codecs'.
    all_exact: list[bool]
    # With several distributed-optimizer instances: the all-reduce of each bucket's shard
    # across them, else None.
    across: _AcrossInstances | None = None
    grad_step: int = 0  # gradient syncs so far: the optimizer step being computed
    # No gradient sync since set-up (or resume): the replicas hold identical parameters.
    fresh: bool = True

    def compresses_grads_at(self, step: int) -> bool:
        """Whether the gradient sync at `step` compresses anything: a bucket's reduce-scatter
        (none does inside an instance of one rank) or the all-reduce across instances (from
        ``grad_quant_start_step`` on, as the reduce-scatters)."""
        if any(rs.quantizes_at(step) for rs in self.grad):
            return True
        return (self.across is not None and self.across.compresses()
                and step >= _SETTINGS.config.resolved.grad_quant_start_step)

    def count_grads(self, wire: WireCounter, step: int) -> None:
        """Adds the bytes of this group's gradient sync at `step` to `wire`, the exact
        parameters' among them (fp32 sums), and those of the all-reduce across instances."""
        for rs, exact, all_exact in zip(self.grad, self.exact, self.all_exact):
            wire.add_grad(rs, step, exact=all_exact)
            if exact is not None and rs.quantizes_at(step):
                wire.add_exact(exact.wire_bytes(self.groups.size, 4))
        if self.across is not None:
            self.across.count(wire)

    def count_weights(self, wire: WireCounter) -> None:
        """Adds the bytes of this group's parameter sync to `wire`, the exact parameters'
        among them (bf16 values)."""
        for ag, exact, all_exact in zip(self.weight, self.exact, self.all_exact):
            wire.add_weight(ag, exact=all_exact)
            if exact is not None:
                wire.add_exact(exact.wire_bytes(self.groups.size, 2))

    def wire_bytes(self, step: int) -> WireCounter:
        """Bytes of this group's gradient and parameter sync at `step`, and uncompressed."""
        wire = WireCounter()
        self.count_grads(wire, step)
        self.count_weights(wire)
        return wire


def _groups_for(settings: _Settings, group: dist.ProcessGroup) -> ProcessGroups:
    key = group.group_name
    if key not in settings.groups:
        settings.groups[key] = ProcessGroups.create(group, settings.local_world_size)
    return settings.groups[key]


def _quantized_params(params) -> list:
    """The FP8 (or, in 0.19, any quantized-storage) parameters among `params`."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.fp8_utils import is_float8tensor

    quantized = getattr(param_and_grad_buffer, "_param_uses_quantized_storage", is_float8tensor)
    return [p for p in params if quantized(p)]


def _refuse_ddp_config(cfg, module) -> None:
    """Raises, naming the setting and what to change, where a DDP model of `module` with the
    DistributedDataParallelConfig `cfg` would run a collective sdp4bit cannot compress:
    never a silent fallback to Megatron's own traffic."""
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


def _refuse_buffer_dtypes(ddp, config: Config) -> None:
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


def _refuse_other_wrapper(self, *args, **kwargs):
    """The __init__ of the wrappers of :func:`_other_wrapper_classes` while sdp4bit is enabled:
    their collectives are not the ones sdp4bit replaces."""
    name = type(self).__name__
    flag = "--use-torch-fsdp2" if name == "TorchFullyShardedDataParallel" else "--use-megatron-fsdp"
    raise Sdp4bitError(
        f"{name} ({flag}) runs collectives sdp4bit does not compress; with sdp4bit drop {flag} "
        "and use Megatron's DistributedDataParallel with --use-distributed-optimizer (or "
        "PyTorch FSDP2 through sdp4bit.fsdp, outside Megatron)")


def _state(bucket_group) -> _BucketGroupState | None:
    """The group's sdp4bit state, set up at its first call, or None while sdp4bit is not
    enabled (what it cannot compress was refused when the model was built)."""
    settings = _SETTINGS
    if settings is None:
        return None
    state = getattr(bucket_group, "_sdp4bit", None)
    if state is not None:
        return state
    groups = _groups_for(settings, bucket_group.intra_distributed_optimizer_instance_group)
    grads, exact, all_exact = [], [], []
    for bucket in bucket_group.buckets:
        bucket_id = getattr(bucket, "sdp4bit_bucket_id", None)
        if bucket_id is None:
            raise Sdp4bitError(
                "this DDP model was built before megatron_patch.megatron_core.enable(); "
                "enable sdp4bit first, then build the model"
            )
        ranges = bucket.sdp4bit_exact
        exact_numel = sum(end - start for start, end in ranges)
        all_exact.append(exact_numel == sum(p.numel() for p in bucket.params_list))
        exact.append(_ExactElements(ranges, bucket.grad_data.device, groups.rank,
                                    bucket.grad_data.numel() // groups.size)
                     if ranges and not all_exact[-1] else None)
        config = Config("baseline") if all_exact[-1] else settings.config
        grads.append(GradReduceScatter(groups, config, bucket.grad_data.numel(), bucket_id,
                                       device=bucket.grad_data.device))
    log_route_notice(f"bucket group of buckets {[rs.bucket_id for rs in grads]}", grads)
    weights = []
    if settings.config.compresses_weights:
        check_replicas_identical([b.param_data for b in bucket_group.buckets],
                                 _dp_group(groups))
        weights = [
            WeightAllGather(groups, rs.config, bucket.param_data, rs.bucket_id)
            for bucket, rs in zip(bucket_group.buckets, grads)
        ]
        for bucket, elements in zip(bucket_group.buckets, exact):
            if elements is not None:
                elements.keep_set_up_values(bucket.param_data)
    across = None
    if bucket_group.ddp_config.num_distributed_optimizer_instances > 1:
        across = _AcrossInstances(
            settings, bucket_group.inter_distributed_optimizer_instance_group,
            [b.grad_data.numel() // groups.size for b in bucket_group.buckets],
            [rs.bucket_id for rs in grads], all_exact, bucket_group.buckets[0].grad_data.device)
    state = _BucketGroupState(groups, grads, weights, exact, all_exact, across)
    first = settings.iteration() if settings.iteration is not None else 0
    state.grad_step = settings.resume_steps.pop(grads[0].bucket_id, first)
    bucket_group._sdp4bit = state
    settings.bucket_groups.append(bucket_group)
    _announce_when_set_up(settings, bucket_group)
    return state


def _announce_when_set_up(settings: _Settings, bucket_group) -> None:
    """Once every bucket group of the DDP model `bucket_group` belongs to is set up, rank 0
    shows one line for it: its buckets, those compressed, and the bytes one step sends once
    gradients are quantized, against Megatron's own collectives."""
    chunk, model = next(((i, m) for i, m in enumerate(settings.models)
                         if any(g is bucket_group for g in _bucket_groups(m))), (None, None))
    if model is None or any(getattr(g, "_sdp4bit", None) is None for g in _bucket_groups(model)):
        return
    states = [g._sdp4bit for g in _bucket_groups(model)]
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


def _left_uncompressed(ddp_model, step: int) -> list[tuple[str, int]]:
    """What the ``exact_params`` knob keeps out of the codecs in `ddp_model`: per bucket whose
    parameters are all exact, or that carries exact elements beside compressed ones, a
    description naming its parameters and the bytes one step sends for them at `step`."""
    names = {p: name for name, p in ddp_model.module.named_parameters()}
    left = []
    for bucket_group in _bucket_groups(ddp_model):
        state = bucket_group._sdp4bit
        world = state.groups.size
        for k, bucket in enumerate(bucket_group.buckets):
            exact = state.exact[k]
            if state.all_exact[k]:
                params, what = bucket.params_list, "bucket"
                count = (state.grad[k].wire_bytes(step).total
                         + state.weight[k].wire_bytes().total)
            elif exact is not None:
                params, what = bucket.sdp4bit_exact_params, "the exact elements of bucket"
                count = exact.wire_bytes(world, 2) + (
                    exact.wire_bytes(world, 4) if state.grad[k].quantizes_at(step) else 0)
            else:
                continue
            shown = sorted(names.get(p, "?") for p in params)
            more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
            left.append((f"{what} {bucket.sdp4bit_bucket_id} ({', '.join(shown[:3])}{more})",
                         count))
    return left


def _dp_group(groups: ProcessGroups):
    return groups.dp_group if groups.dp_group is not None else dist.group.WORLD


def _exact_reduce_scatter(data: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """Megatron's uncompressed reduce-scatter of `data` (for telemetry), into a new tensor."""
    out = torch.empty(data.numel() // groups.size, dtype=data.dtype, device=data.device)
    dist.reduce_scatter_tensor(out, data, group=_dp_group(groups))
    return out


def _exact_all_gather(params: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """Every owner's current shard of `params`, all-gathered uncompressed (for telemetry)."""
    out = torch.empty_like(params)
    mine = local_shard(params, groups.rank, groups.size).clone()
    dist.all_gather_into_tensor(out, mine, group=_dp_group(groups))
    return out


def _prepare_grads(self, force_all_reduce) -> None:
    """What megatron-core's start_grad_sync does before its reduction, for the versions this
    supports (0.16 to 0.19; the later steps are feature-detected): drain the predecessor
    bucket group (0.19), wait for CUDA-graph gradient events (0.19), copy extra main grads
    into the buffer (0.19), check the grads, scale them."""
    previous = getattr(self, "previous_grad_reduce_bucket_group", None)
    if previous is not None and previous.grad_reduce_handle is not None:
        previous.finish_grad_sync(force_all_reduce=force_all_reduce)
    assert self.grad_reduce_handle is None, (
        "Should not have multiple communication calls outstanding at once")
    events = {}
    for bucket in self.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None:
                events[id(event)] = event
    if events:
        stream = torch.cuda.current_stream()
        for event in events.values():
            stream.wait_event(event)
    for bucket in self.buckets:
        for param in getattr(bucket, "params_with_extra_main_grads", ()):
            copy_in = getattr(param, "main_grad_copy_in_grad_buffer", None)
            if copy_in is not None:
                copy_in.copy_(param.main_grad)
    cfg = self.ddp_config
    if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
        self.check_grads(
            check_for_nan_or_inf=cfg.check_for_nan_in_grad,
            check_for_large=cfg.check_for_large_grads,
        )
    with torch.no_grad():
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor


def _start_grad_sync(self, force_all_reduce: bool | None = False):
    if self.is_first_batch and self.grad_reduce_handle is not None:
        return  # already dispatched in the first batch (Megatron's own rule), nothing to count
    state = None if force_all_reduce else _state(self)
    if state is not None:
        state.fresh = False
    if state is None or not state.compresses_grads_at(state.grad_step):
        if state is not None:
            state.grad_step += 1
        return _PATCHES.original("start_grad_sync")(self, force_all_reduce)
    _prepare_grads(self, force_all_reduce)
    cfg = self.ddp_config
    rank, size = state.groups.rank, state.groups.size
    dp_group = _dp_group(state.groups)
    step = state.grad_step
    telemetry = _SETTINGS.telemetry
    set_up = len(_SETTINGS.bucket_groups)  # bucket groups reporting each step
    reference = [] if telemetry.due(step) else None
    handles, pending = [], []
    for bucket, rs, exact in zip(self.buckets, state.grad, state.exact):
        # fp32 and bf16 buckets alike go straight in: a bf16 bucket is read as fp32 and its
        # shard rounded back to bf16 by the collective (docs/numerics.md §7.5).
        data = bucket.grad_data
        if reference is not None:
            # The reference sums the fp32 values, as the collective does.
            reference.append(_exact_reduce_scatter(data.float(), state.groups))
            if state.across is not None:
                dist.all_reduce(reference[-1], group=state.across.group)
        # Read before the collective overwrites this rank's shard of the bucket.
        pending.append(exact.start_grads(data, dp_group) if exact is not None else None)
        handles.append(rs.start(data, local_shard(data, rank, size), step))
    state.grad_step += 1

    def finish():
        for bucket, exact, started in zip(self.buckets, state.exact, pending):
            if exact is not None:
                exact.finish_grads(started, local_shard(bucket.grad_data, rank, size))
        if state.across is not None:
            state.across.run([local_shard(b.grad_data, rank, size) for b in self.buckets], step)
        if reference is not None:
            got = [local_shard(b.grad_data, rank, size) for b in self.buckets]
            wire = WireCounter()
            state.count_grads(wire, step)
            telemetry.report("grad", step, set_up, wire.sent, wire.uncompressed,
                             ErrorStats.of(got, reference), exact=wire.exact)
        if cfg.average_in_collective:
            instances = state.across.size if state.across is not None else 1
            for bucket in self.buckets:
                local_shard(bucket.grad_data, rank, size).div_(size * instances)

    handle = BucketGroupHandle(handles, finish)
    if cfg.overlap_grad_reduce:
        self.grad_reduce_handle = handle
    else:
        handle.wait()
        self.grad_reduce_handle = None


def _finish_grad_sync(self, force_all_reduce: bool | None = False):
    """megatron-core's finish_grad_sync, which with several distributed-optimizer instances
    joins its communication stream instead of waiting for the handle; then sdp4bit's handle,
    if one is pending, is waited for (every reduction, across the instances included, has
    then completed)."""
    result = _GROUP_PATCHES.original("finish_grad_sync")(self, force_all_reduce)
    if isinstance(self.grad_reduce_handle, BucketGroupHandle):
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None
    return result


def _start_param_sync(self, force_sync: bool = False):
    state = _state(self)
    if state is None or not _SETTINGS.config.compresses_weights:
        return _PATCHES.original("start_param_sync")(self, force_sync)
    if force_sync:
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            _post_param_sync(self)
            return
    else:
        assert self.param_gather_handle is None
    if state.fresh:
        # No optimizer step since set-up or resume: every replica holds the same parameters
        # (checked at set-up), so there is nothing to gather.
        self.param_gather_handle = None
        self.param_gather_dispatched = True
        return
    # Numbered by the gradient step whose update it carries, so that the random streams do
    # not depend on how often Megatron syncs (e.g. the forward hooks of overlapped gathers).
    step = state.grad_step - 1
    telemetry = _SETTINGS.telemetry
    set_up = len(_SETTINGS.bucket_groups)  # bucket groups reporting each step
    reference = None
    if telemetry.due(step):
        reference = [_exact_all_gather(b.param_data, state.groups) for b in self.buckets]
    dp_group = _dp_group(state.groups)
    # The exact elements leave the buckets before the compressed all-gather reads them.
    pending = [exact.start_params(bucket.param_data, dp_group) if exact is not None else None
               for bucket, exact in zip(self.buckets, state.exact)]
    handles = [ag.start(bucket.param_data, step) for bucket, ag in zip(self.buckets, state.weight)]

    def finish():
        for bucket, exact, started in zip(self.buckets, state.exact, pending):
            if exact is not None:
                exact.finish_params(started, bucket.param_data)
        if reference is not None:
            wire = WireCounter()
            state.count_weights(wire)
            got = [bucket.param_data for bucket in self.buckets]
            telemetry.report("param", step, set_up, wire.sent, wire.uncompressed,
                             ErrorStats.of(got, reference), exact=wire.exact)

    handle = BucketGroupHandle(handles, finish)
    if self.ddp_config.overlap_param_gather and not force_sync:
        self.param_gather_handle = handle
    else:
        handle.wait()
        self.param_gather_handle = None
    if force_sync and self.ddp_config.overlap_param_gather:
        _post_param_sync(self)
    self.param_gather_dispatched = True


def _post_param_sync(bucket_group) -> None:
    """megatron-core 0.19's processing after a completed param gather, where it has one (a
    no-op for the buckets sdp4bit gathers: they hold no quantized parameters)."""
    post = getattr(bucket_group, "_post_param_sync", None)
    if post is not None:
        post()


def _bucket_groups(ddp_model):
    return ddp_model.bucket_groups + ddp_model.expert_parallel_bucket_groups


def state_dict(ddp_model) -> dict:
    """What a checkpoint must hold for a resumed run to continue bit for bit: each bucket
    group's step counter (it numbers the random streams). Save it with the model and optimizer
    (it is the same on every rank)."""
    steps = {}
    for bucket_group in _bucket_groups(ddp_model):
        state = getattr(bucket_group, "_sdp4bit", None)
        if state is not None:
            steps[state.grad[0].bucket_id] = state.grad_step
    return {"version": 1, "grad_steps": steps}


def load_state_dict(saved: dict) -> None:
    """Resumes the step counters of :func:`state_dict` (call after :func:`enable`, before the
    first gradient sync). The qWD references are the loaded parameters themselves."""
    if _SETTINGS is None:
        raise Sdp4bitError("load_state_dict needs sdp4bit enabled first")
    if saved.get("version") != 1:
        raise Sdp4bitError(f"unknown sdp4bit state version {saved.get('version')!r}")
    _SETTINGS.resume_steps = {int(k): int(v) for k, v in saved["grad_steps"].items()}


def _wire(ddp_model, step: int) -> WireCounter:
    wire = WireCounter()
    for bucket_group in _bucket_groups(ddp_model):
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


def check_replicated_params(models) -> None:
    """Raises :class:`Sdp4bitError`, naming the first parameter that differs and the ranks
    that hold other bits, unless the copies Megatron keeps identical outside the DP group are
    bit-identical: across the tensor-parallel group every parameter without
    ``tensor_model_parallel``, across the embedding group the word embedding tied between the
    first and the last pipeline stage. `models` is a DDP model or a list of model chunks.
    Collective over both groups: call it on every rank at the same point, with the parameters
    gathered (``enable(replica_check_interval=N)`` calls it as the gradient sync starts).
    Compares checksums of the bits (:func:`sdp4bit.replicas.checksums_across`)."""
    from megatron.core import parallel_state

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    named = [(name, p) for model in models for name, p in model.module.named_parameters()]
    tp_group = _tensor_parallel_group(models[0])
    if tp_group.size() > 1:
        _check_copies([(n, p) for n, p in named if not getattr(p, "tensor_model_parallel", False)],
                      tp_group, "tensor-parallel")
    tied = [(n, p) for n, p in named if getattr(p, "shared_embedding", False)]
    embedding_group = parallel_state.get_embedding_group(check_initialized=False)
    if (tied and embedding_group is not None
            and dist.get_rank() in dist.get_process_group_ranks(embedding_group)):
        _check_copies(tied, embedding_group, "embedding")


def _check_copies(named: list, group, what: str) -> None:
    """Raises :class:`Sdp4bitError` naming the first of `named` (name, tensor) whose bits
    differ across `group` (the `what` group)."""
    sums = checksums_across([p.detach() for _, p in named], group)
    differs = (sums != sums[0]).any(dim=0).nonzero()
    if len(differs):
        index = int(differs[0])
        ranks = dist.get_process_group_ranks(group)
        others = [ranks[r] for r in range(len(ranks)) if sums[r, index] != sums[0, index]]
        raise Sdp4bitError(
            f"parameter {named[index][0]} differs across the {what} group {ranks}: ranks "
            f"{others} hold other bits than rank {ranks[0]} ({int(differs.numel())} of "
            f"{len(named)} tensors that Megatron keeps identical there differ)")
