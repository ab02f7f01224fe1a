"""DeepSpeed ZeRO integration: a top-level ``"sdp4bit"`` section of the DeepSpeed config
compresses ZeRO's gradient reduction and its parameter all-gather after the step.

    from megatron_patch import deepspeed_zero
    engine, optimizer, _, _ = deepspeed_zero.initialize(model=model, config=ds_config, ...)

with, in the config (a dict or a JSON file, as for ``deepspeed.initialize``)::

    "sdp4bit": {"preset": "sdp4bit", "ranks_per_node": 8, "grad_inter_bits": 4, ...}

The section takes the presets and knobs of the Megatron flags (``preset``, ``weight_codec``,
``grad_codec``, ``weight_bits``, ... ``seed``, ``grad_quant_start_step``) plus
``ranks_per_node`` (default: ``LOCAL_WORLD_SIZE``) and ``enabled``.

ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``): each parameter group's gradients are
accumulated, over the micro-steps of a step, in an fp32 buffer laid out like the group's flat
bf16 parameter buffer, and reduce-scattered with the gradient codec at the
gradient-accumulation boundary, so each rank receives exactly its ZeRO partition (which the
optimizer step then reads as DeepSpeed's own flat gradient partition). After the step the flat
parameter buffer is all-gathered with the weight codec (qWD included: every replica keeps the
previous weights in that buffer). All-gathers outside the step (checkpoint loading) stay exact
and restart the weight codec's state.

ZeRO stage 3 gathers parameters on demand and frees them, so no replica keeps a previous copy:
qWD is refused there; the direct weight codecs (qw, qsdp, zeropp) compress the coordinator's
parameter gathers and the gradient codecs its bucketed reduce-scatters. Features this
integration does not handle (offload, MoE, ZeRO++'s own quantization, hierarchical
partitioning) are refused with an error: nothing falls back to uncompressed traffic silently.
"""

from __future__ import annotations

import contextvars
import json
import os
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .collectives import GradReduceScatter, WeightAllGather
from .config import PRESETS, Sdp4bitConfig
from .errors import Sdp4bitError
from .groups import Sdp4bitGroups
from .megatron_core import local_shard
from .replicas import check_replicas_identical

#: The config section's name (top level: DeepSpeed rejects unknown keys in zero_optimization).
SECTION = "sdp4bit"

#: Knobs the section accepts besides ``preset``: the Rust core's names, as the Megatron flags.
KNOBS = (
    "weight_codec", "grad_codec", "weight_bits", "weight_group_size", "weight_rounding",
    "grad_intra_bits", "grad_inter_bits", "grad_group_size", "hadamard_block", "grad_rounding",
    "global_qsgd_bits", "pipeline_chunks", "grad_quant_start_step", "seed",
)
_SETTINGS = ("enabled", "preset", "ranks_per_node")

_ORIGINAL: dict[str, object] = {}
# The ZeRO optimizer whose step() is running (its all-gather of updated weights is compressed).
_STEPPING: contextvars.ContextVar = contextvars.ContextVar("sdp4bit_stepping", default=None)
_ATTACHED: weakref.WeakSet = weakref.WeakSet()


@dataclass
class DeepSpeedSettings:
    """The parsed ``"sdp4bit"`` section."""

    config: Sdp4bitConfig
    ranks_per_node: int | None = None
    weights: bool = False  # whether the config compresses weights
    grads: bool = False  # whether it compresses gradients
    weight_codec: str = "none"


def settings_from_config(ds_config: dict) -> DeepSpeedSettings | None:
    """The ``"sdp4bit"`` section of a DeepSpeed config dict, validated, or None when the
    section is absent or ``"enabled": false``. Raises :class:`Sdp4bitError` naming the
    problem."""
    section = ds_config.get(SECTION)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise Sdp4bitError(f'the "{SECTION}" config section must be an object, got {section!r}')
    unknown = sorted(set(section) - set(KNOBS) - set(_SETTINGS))
    if unknown:
        raise Sdp4bitError(f'unknown key(s) {unknown} in the "{SECTION}" config section; known: '
                           f"{sorted(_SETTINGS + KNOBS)}")
    enabled = section.get("enabled", True)
    if not isinstance(enabled, bool):
        raise Sdp4bitError(f'"{SECTION}.enabled" must be true or false, got {enabled!r}')
    if not enabled:
        return None
    preset = section.get("preset", "sdp4bit")
    if preset not in PRESETS:
        raise Sdp4bitError(f'"{SECTION}.preset" {preset!r} is not one of {list(PRESETS)}')
    ranks_per_node = section.get("ranks_per_node")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int)
                                       or isinstance(ranks_per_node, bool) or ranks_per_node < 1):
        raise Sdp4bitError(f'"{SECTION}.ranks_per_node" must be a positive integer, got '
                           f"{ranks_per_node!r}")
    knobs = {k: section[k] for k in KNOBS if k in section}
    config = Sdp4bitConfig(preset, knobs)
    weight, grad = config.codecs()  # raises Sdp4bitError naming a bad knob
    return DeepSpeedSettings(config, ranks_per_node, weights=weight != "none",
                             grads=grad != "none", weight_codec=weight)


def load_config(config) -> dict:
    """A DeepSpeed config given as a dict or a JSON file path, as a dict."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    raise Sdp4bitError(f"a DeepSpeed config must be a dict or a JSON file path, got "
                       f"{type(config).__name__}")


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the config's ``"sdp4bit"`` section applied to the ZeRO
    optimizer it builds; same arguments and return value. Every rank must call it."""
    import deepspeed

    config = kwargs.get("config", kwargs.get("config_params"))
    if config is None and kwargs.get("args") is not None:
        config = getattr(kwargs["args"], "deepspeed_config", None)
    settings = settings_from_config(load_config(config)) if config is not None else None
    if settings is not None:
        _check_stage(settings, load_config(config))
    result = deepspeed.initialize(*args, **kwargs)
    if settings is not None:
        attach(result[0].optimizer, settings)
    return result


def _check_stage(settings: DeepSpeedSettings, ds_config: dict) -> None:
    """Refuses what stage 3 cannot do, before DeepSpeed builds anything."""
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if stage == 3 and settings.weight_codec == "qwd":
        raise Sdp4bitError(
            "qWD (the weight codec of the sdp4bit preset) needs every replica to keep the "
            "previous weights, but ZeRO stage 3 frees gathered parameters; use a direct weight "
            'codec ("weight_codec": "qw", "qsdp" or "zeropp") or ZeRO stage 1/2')
    if stage not in (1, 2, 3) and (settings.weights or settings.grads):
        raise Sdp4bitError(f"sdp4bit compresses ZeRO's collectives; this config has ZeRO stage "
                           f"{stage} (use stage 1 or 2)")


@dataclass
class _GroupState:
    """One parameter group's buffers and compressed collectives."""

    grads: torch.Tensor | None  # fp32, the layout of the group's flat bf16 buffer
    offsets: dict[int, int]  # id(param) -> element offset in the flat buffer
    reduce_scatter: GradReduceScatter | None
    all_gather: WeightAllGather | None = None  # with a weight codec, after set-up


@dataclass
class _OptimizerState:
    settings: DeepSpeedSettings
    groups: Sdp4bitGroups
    per_group: list[_GroupState]
    grad_step: int = 0  # gradient reductions so far
    weight_step: int = 0  # compressed all-gathers since the weight codec set up
    pending: bool = False  # gradients accumulated since the last reduction
    sent: list[int] = field(default_factory=lambda: [0, 0])  # (sent, uncompressed) bytes


def attach(optimizer, settings: DeepSpeedSettings) -> None:
    """Routes `optimizer`'s gradient reduction and parameter all-gathers through sdp4bit: a
    ZeRO stage 1/2 ``DeepSpeedZeroOptimizer`` or a stage 3 ``DeepSpeedZeroOptimizer_Stage3``.
    Collective: every DP rank calls it."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not (settings.weights or settings.grads):
        return  # the baseline preset: DeepSpeed's own collectives, untouched
    if type(optimizer) is DeepSpeedZeroOptimizer_Stage3:
        return _attach_stage3(optimizer, settings)
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        raise Sdp4bitError(f"sdp4bit compresses ZeRO stages 1-3 (DeepSpeedZeroOptimizer, "
                           f"DeepSpeedZeroOptimizer_Stage3); this engine's optimizer is "
                           f"{type(optimizer).__name__}")
    problems = [name for name, present in (
        ("CPU offload", optimizer.cpu_offload),
        ("MoE layers", optimizer.has_moe_layers),
        ("ZenFlow", getattr(optimizer, "zenflow", False)),
        ("hierarchical partitioning (a DP group per parameter group differing from the DP "
         "group)", any(g is not optimizer.dp_process_group
                       for g in optimizer.real_dp_process_group)),
    ) if present]
    if problems:
        raise Sdp4bitError(f"sdp4bit does not handle {', '.join(problems)} in ZeRO stage 1/2; "
                           "turn it off or use the baseline preset")
    flats = optimizer.bit16_groups_flat
    if settings.weights and any(flat.dtype != torch.bfloat16 for flat in flats):
        raise Sdp4bitError("the weight codecs all-gather bf16 parameters; enable "
                           '"bf16" in the DeepSpeed config or set "weight_codec": "none"')
    _install()
    local = settings.ranks_per_node
    groups = Sdp4bitGroups.create(optimizer.dp_process_group, local)
    per_group = []
    for i, flat in enumerate(flats):
        offsets = {id(p): (p.data_ptr() - flat.data_ptr()) // flat.element_size()
                   for p in optimizer.bit16_groups[i]}
        grads = rs = None
        if settings.grads:
            grads = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            rs = GradReduceScatter(groups, settings.config, flat.numel(), bucket_id=i,
                                   device=flat.device)
        per_group.append(_GroupState(grads, offsets, rs))
    optimizer._sdp4bit = _OptimizerState(settings, groups, per_group)
    if settings.weights:
        _set_up_weights(optimizer)
    _ATTACHED.add(optimizer)


def _set_up_weights(optimizer) -> None:
    """(Re)builds the weight all-gathers from the flat buffers as every replica holds them."""
    state = optimizer._sdp4bit
    check_replicas_identical(list(optimizer.bit16_groups_flat), optimizer.dp_process_group)
    for i, (flat, group_state) in enumerate(zip(optimizer.bit16_groups_flat, state.per_group)):
        group_state.all_gather = WeightAllGather(state.groups, state.settings.config, flat,
                                                 bucket_id=i)
    state.weight_step = 0


def detach(optimizer) -> None:
    """Gives `optimizer` back to DeepSpeed's own collectives and closes sdp4bit's groups. Call
    it on every rank before ``torch.distributed.destroy_process_group()``."""
    state = getattr(optimizer, "_sdp4bit", None)
    if state is not None:
        del optimizer._sdp4bit
        _ATTACHED.discard(optimizer)
        _STAGE3.pop(_group_key(optimizer.dp_process_group), None)
        state.groups.close()


def wire_bytes(optimizer) -> tuple[int, int]:
    """(bytes sent, bytes the uncompressed collectives would have sent) by this rank through
    sdp4bit's collectives since attach()."""
    state = getattr(optimizer, "_sdp4bit", None)
    return (state.sent[0], state.sent[1]) if state is not None else (0, 0)


def _install() -> None:
    if "accumulate" in _ORIGINAL:
        return
    from deepspeed.runtime.zero import stage_1_and_2

    cls = stage_1_and_2.DeepSpeedZeroOptimizer
    _ORIGINAL["accumulate"] = cls.reduce_independent_p_g_buckets_and_remove_grads
    _ORIGINAL["epilogue"] = cls.independent_gradient_partition_epilogue
    _ORIGINAL["step"] = cls.step
    _ORIGINAL["all_gather"] = stage_1_and_2.all_gather_dp_groups
    cls.reduce_independent_p_g_buckets_and_remove_grads = _accumulate
    cls.independent_gradient_partition_epilogue = _epilogue
    cls.step = _step
    stage_1_and_2.all_gather_dp_groups = _all_gather_dp_groups


def _grads_state(optimizer) -> _OptimizerState | None:
    state = getattr(optimizer, "_sdp4bit", None)
    return state if state is not None and state.settings.grads else None


def _accumulate(self, param, i):
    """Instead of bucketing `param`'s gradient for DeepSpeed's reduction: adds it into the
    group's fp32 buffer at the parameter's place and frees it."""
    state = _grads_state(self)
    if state is None:
        return _ORIGINAL["accumulate"](self, param, i)
    if param.numel() == 0 or not getattr(param, "ds_grad_is_ready", True):
        return None
    grad = self.get_gradient_for_reduction(param)
    if grad is None:
        return None
    group_state = state.per_group[i]
    start = group_state.offsets[id(param)]
    with torch.no_grad():
        group_state.grads[start:start + param.numel()].add_(grad.detach().reshape(-1))
    self.clear_grad_attribute(param)
    param.grad = None
    state.pending = True
    return None


def _epilogue(self):
    """At the gradient-accumulation boundary: reduce-scatters every group's accumulated
    gradients with the gradient codec and hands this rank's partition to the step as
    DeepSpeed's flat gradient partition."""
    state = _grads_state(self)
    if state is None:
        return _ORIGINAL["epilogue"](self)
    from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

    if self.is_gradient_accumulation_boundary() and state.pending:
        rank, size = state.groups.rank, state.groups.size
        divisor = size / float(self.sequence_parallel_size) if self.gradient_average else 1.0
        handles = []
        for group_state in state.per_group:
            if divisor != 1.0:
                group_state.grads.div_(divisor)
            shard = local_shard(group_state.grads, rank, size)
            handles.append(group_state.reduce_scatter.start(group_state.grads, shard,
                                                            state.grad_step))
        for i, (group_state, handle) in enumerate(zip(state.per_group, handles)):
            handle.wait()
            rs = group_state.reduce_scatter
            state.sent[0] += rs.wire_bytes(state.grad_step).total
            state.sent[1] += rs.baseline_wire_bytes().total
            partition = local_shard(group_state.grads, rank, size).clone()
            group_state.grads.zero_()
            self.averaged_gradients[i] = GradPartitionBufferGroup(
                _partition_views(partition, self.params_in_partition[i], self.first_offset[i]),
                partition)
        state.grad_step += 1
        state.pending = False
    for i in range(len(self.params_already_reduced)):
        self.params_already_reduced[i] = False
    self._clear_param_grad_only()
    self._epilogue_ran_this_backward = True


def _partition_views(partition: torch.Tensor, params, first_offset: int) -> list[torch.Tensor]:
    """Views of `partition` (a flat ZeRO gradient partition) per parameter in it, the first
    starting `first_offset` elements into its parameter, then the padding (marked as such),
    the layout DeepSpeed's norm and overflow checks read."""
    views, current = [], 0
    for k, param in enumerate(params):
        start = first_offset if k == 0 else 0
        count = min(param.numel() - start, partition.numel() - current)
        view = partition.narrow(0, current, count)
        if start == 0 and count == param.numel():
            view = view.view(param.shape)
        views.append(view)
        current += count
    if current < partition.numel():
        pad = partition.narrow(0, current, partition.numel() - current)
        pad._zero_padding = True
        views.append(pad)
    return views


def _step(self, closure=None):
    token = _STEPPING.set(self)
    try:
        return _ORIGINAL["step"](self, closure)
    finally:
        _STEPPING.reset(token)


def _all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group,
                          start_alignment_factor, allgather_bucket_size):
    """The all-gather of updated weights: compressed inside an attached optimizer's step;
    elsewhere (checkpoint loading) DeepSpeed's exact one, after which the weight codec sets up
    again from the gathered values (collective, like the all-gather itself)."""
    stepping = _STEPPING.get()
    state = getattr(stepping, "_sdp4bit", None)
    if state is not None and state.settings.weights and groups_flat is stepping.bit16_groups_flat:
        handles = [g.all_gather.start(flat, state.weight_step)
                   for g, flat in zip(state.per_group, groups_flat)]
        for g, handle in zip(state.per_group, handles):
            handle.wait()
            state.sent[0] += g.all_gather.wire_bytes().total
            state.sent[1] += g.all_gather.baseline_wire_bytes().total
        state.weight_step += 1
        return None
    result = _ORIGINAL["all_gather"](groups_flat, partitioned_param_groups, dp_process_group,
                                     start_alignment_factor, allgather_bucket_size)
    for optimizer in list(_ATTACHED):
        if optimizer.bit16_groups_flat is groups_flat and optimizer._sdp4bit.settings.weights:
            _set_up_weights(optimizer)  # qWD restarts from these exact values
    return result


# ---------------------------------------------------------------------------------------------
# ZeRO stage 3: parameters are gathered on demand (module by module, prefetched) and freed, and
# gradients are reduce-scattered bucket by bucket during the backward pass; both go through
# DeepSpeed's equal-split flat buffers, so each distinct bucket shape gets its own compressed
# collective (set up, collectively, the first time it is seen; every rank sees the buckets in
# the same order).

_STAGE3: dict[tuple, "_Stage3State"] = {}  # by the DP group's global ranks
_FETCHING: contextvars.ContextVar = contextvars.ContextVar("sdp4bit_fetching", default=False)
_FIRST_WEIGHT_BUCKET = 2048  # bucket ids: gradients from 0, weights from here (core: <= 4095)


@dataclass
class _Stage3State(_OptimizerState):
    grad_buckets: dict = field(default_factory=dict)  # numels -> [GradReduceScatter, calls]
    weight_buckets: dict = field(default_factory=dict)  # numel -> [WeightAllGather, calls]


def _attach_stage3(optimizer, settings: DeepSpeedSettings) -> None:
    problems = [name for name, present in (
        ("parameter or optimizer offload", optimizer.offload_param or optimizer.offload_optimizer),
        ("ZeRO++ quantized weights (zero_quantized_weights)",
         optimizer.parameter_offload.zero_quantized_weights),
        ("ZeRO++ quantized gradients (zero_quantized_gradients)",
         optimizer.all2all_process_group is not None),
        ("hierarchical partitioning (zero_hpz_partition_size > 1)",
         optimizer.zero_hpz_partition_size > 1),
        ("MoE layers", getattr(optimizer, "has_moe_layers", False)),
    ) if present]
    if problems:
        raise Sdp4bitError(f"sdp4bit does not handle {', '.join(problems)} in ZeRO stage 3; "
                           "turn it off or use the baseline preset")
    if settings.weights:
        dtypes = {p.ds_tensor.dtype for group in optimizer.fp16_groups for p in group}
        if dtypes != {torch.bfloat16}:
            raise Sdp4bitError(f"the weight codecs all-gather bf16 parameters; this model's "
                               f"partitions are {sorted(map(str, dtypes))} (enable \"bf16\" or "
                               'set "weight_codec": "none")')
    _install_stage3()
    groups = Sdp4bitGroups.create(optimizer.dp_process_group, settings.ranks_per_node)
    optimizer._sdp4bit = _Stage3State(settings, groups, per_group=[])
    _STAGE3[_group_key(optimizer.dp_process_group)] = optimizer._sdp4bit
    _ATTACHED.add(optimizer)


def _install_stage3() -> None:
    if "stage3_reduce_scatter" in _ORIGINAL:
        return
    from deepspeed.runtime.zero import partition_parameters, partitioned_param_coordinator, stage3

    coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
    fetch = "_PartitionedParameterCoordinator__all_gather_params_"
    _ORIGINAL["stage3_reduce_scatter"] = stage3.reduce_scatter_coalesced
    _ORIGINAL["stage3_all_gather"] = partition_parameters._dist_allgather_fn
    _ORIGINAL["stage3_fetch"] = getattr(coordinator, fetch)
    stage3.reduce_scatter_coalesced = _reduce_scatter_coalesced
    partition_parameters._dist_allgather_fn = _dist_allgather_fn
    setattr(coordinator, fetch, _fetch_params)


def _group_key(group) -> tuple:
    """A process group's global ranks (DeepSpeed hands the same group around under different
    wrappers)."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _stage3_state(group) -> "_Stage3State | None":
    """The attached stage 3 state of DP group `group`; raises if stage 3 optimizers are
    attached but `group` is none of theirs (it would otherwise go uncompressed)."""
    if not _STAGE3:
        return None
    state = _STAGE3.get(_group_key(group))
    if state is None:
        raise Sdp4bitError("a ZeRO stage 3 collective ran over a process group that is not the "
                           "DP group sdp4bit was attached to (sub-group partitioning is not "
                           "supported)")
    return state


def _reduce_scatter_coalesced(tensors, group=None):
    """Stage 3's gradient reduce-scatter of a bucket of parameters' gradients: DeepSpeed's
    interleaved layout (rank r's chunk of every tensor, padded to equal size, then rank r+1's),
    pre-divided by the DP size, reduced with the gradient codec."""
    state = _stage3_state(group)
    if state is None or not state.settings.grads:
        return _ORIGINAL["stage3_reduce_scatter"](tensors, group)
    rank, size = state.groups.rank, state.groups.size
    chunks = [-(-t.numel() // size) for t in tensors]
    flat = torch.zeros(size * sum(chunks), dtype=torch.float32, device=tensors[0].device)
    offset = 0
    for r in range(size):
        for t, chunk in zip(tensors, chunks):
            piece = t.reshape(-1)[r * chunk:(r + 1) * chunk]
            flat[offset:offset + piece.numel()].copy_(piece)
            offset += chunk
    flat.div_(size)
    key = tuple(t.numel() for t in tensors)
    entry = state.grad_buckets.get(key)
    if entry is None:
        bucket_id = len(state.grad_buckets)
        if bucket_id >= _FIRST_WEIGHT_BUCKET:
            raise Sdp4bitError(f"more than {_FIRST_WEIGHT_BUCKET} distinct ZeRO stage 3 gradient "
                               "buckets; raise reduce_bucket_size")
        entry = state.grad_buckets[key] = [GradReduceScatter(state.groups, state.settings.config,
                                                             flat.numel(), bucket_id,
                                                             device=flat.device), 0]
    rs, calls = entry
    shard = local_shard(flat, rank, size)
    rs.start(flat, shard, calls).wait()
    entry[1] += 1
    state.sent[0] += rs.wire_bytes(calls).total
    state.sent[1] += rs.baseline_wire_bytes().total
    outputs, offset = [], 0
    for t, chunk in zip(tensors, chunks):
        mine = min(chunk, max(t.numel() - rank * chunk, 0))
        outputs.append(shard[offset:offset + mine].to(t.dtype))
        offset += chunk
    return outputs


def _fetch_params(self, params, forward, quantize=False):
    """The coordinator's on-demand parameter gather: its all-gathers are the ones sdp4bit
    compresses (other gathers, e.g. GatheredParameters for checkpoints, stay exact)."""
    token = _FETCHING.set(True)
    try:
        return _ORIGINAL["stage3_fetch"](self, params, forward, quantize)
    finally:
        _FETCHING.reset(token)


def _dist_allgather_fn(input_tensor, output_tensor, group=None):
    """Stage 3's all-gather of a flat, equal-split parameter buffer: with a direct weight codec
    when the coordinator fetches parameters for compute."""
    state = _stage3_state(group) if _FETCHING.get() else None
    if state is None or not state.settings.weights:
        return _ORIGINAL["stage3_all_gather"](input_tensor, output_tensor, group)
    rank, size = state.groups.rank, state.groups.size
    mine = local_shard(output_tensor, rank, size)
    if mine.data_ptr() != input_tensor.data_ptr():
        mine.copy_(input_tensor)
    entry = state.weight_buckets.get(output_tensor.numel())
    if entry is None:
        bucket_id = _FIRST_WEIGHT_BUCKET + len(state.weight_buckets)
        if bucket_id > 4095:
            raise Sdp4bitError(f"more than {4096 - _FIRST_WEIGHT_BUCKET} distinct ZeRO stage 3 "
                               "parameter bucket sizes")
        entry = state.weight_buckets[output_tensor.numel()] = [
            WeightAllGather(state.groups, state.settings.config, output_tensor, bucket_id), 0]
    ag, calls = entry
    entry[1] += 1
    state.sent[0] += ag.wire_bytes().total
    state.sent[1] += ag.baseline_wire_bytes().total
    return ag.start(output_tensor, calls)
