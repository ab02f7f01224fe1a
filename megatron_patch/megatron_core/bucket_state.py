"""sdp4bit's state of one megatron-core bucket group (``bucket_group._sdp4bit``): each
bucket's compressed collectives, its exact elements, the all-reduce across instances and
the step counter; set up at the group's first gradient sync, when every replica holds the
same parameters, and its weight references re-established after weights were loaded."""

from __future__ import annotations

from dataclasses import dataclass

from sdp4bit import Config, GradReduceScatter, ProcessGroups, Sdp4bitError, WeightAllGather
from sdp4bit.integration import WireCounter, log_route_notice
from sdp4bit.replicas import check_replicas_identical

from . import groups as sdp4bit_groups
from .accounting import announce_when_set_up
from .exact import ExactElements
from .hybrid import AcrossInstances
from .parallel import dp_group
from .settings import Settings, current


@dataclass
class BucketGroupState:
    """sdp4bit's per-bucket-group state, kept on the bucket group."""

    config: Config
    groups: ProcessGroups
    grad: list[GradReduceScatter]
    weight: list[WeightAllGather]
    # Per bucket: the exact elements of a bucket that mixes them with compressed ones, or None.
    exact: list[ExactElements | None]
    # Per bucket: whether all of it is exact, its collectives then the uncompressed codecs'.
    all_exact: list[bool]
    # With several distributed-optimizer instances: the all-reduce of each bucket's shard
    # across them, else None.
    across: AcrossInstances | None = None
    grad_step: int = 0  # gradient syncs so far: the optimizer step being computed
    # No gradient sync since set-up (or resume): the replicas hold identical parameters.
    fresh: bool = True
    # The parameters were written outside the optimizer step (a load_state_dict): the weight
    # references are re-established before the next collective (checkpoint.py).
    stale: bool = False

    def compresses_grads_at(self, step: int) -> bool:
        """Whether the gradient sync at `step` compresses anything: a bucket's reduce-scatter
        (none does inside an instance of one rank) or the all-reduce across instances (from
        ``grad_quant_start_step`` on, as the reduce-scatters)."""
        if any(rs.quantizes_at(step) for rs in self.grad):
            return True
        return (self.across is not None and self.across.compresses()
                and step >= self.config.resolved.grad_quant_start_step)

    def exact_grad_bytes(self, k: int, step: int) -> int:
        """Bytes the exact elements of bucket `k` send in the gradient sync at `step`: fp32
        sums inside the instance and, with several instances, across them (none before the
        gradients are compressed: the whole bucket then goes Megatron's way)."""
        exact = self.exact[k]
        if exact is None or not self.compresses_grads_at(step):
            return 0
        across = exact.wire_bytes(self.across.size, 4) if self.across is not None else 0
        return exact.wire_bytes(self.groups.size, 4) + across

    def exact_weight_bytes(self, k: int) -> int:
        """Bytes the exact elements of bucket `k` send in a parameter sync (bf16 values)."""
        exact = self.exact[k]
        return exact.wire_bytes(self.groups.size, 2) if exact is not None and self.weight else 0

    def count_grads(self, wire: WireCounter, step: int) -> None:
        """Adds the bytes of this group's gradient sync at `step` to `wire`, the exact
        parameters' among them, and those of the all-reduce across instances."""
        for k, (rs, all_exact) in enumerate(zip(self.grad, self.all_exact)):
            wire.add_grad(rs, step, exact=all_exact)
            wire.add_exact(self.exact_grad_bytes(k, step))
        if self.across is not None:
            self.across.count(wire)

    def count_weights(self, wire: WireCounter) -> None:
        """Adds the bytes of this group's parameter sync to `wire`, the exact parameters'
        among them."""
        for k, (ag, all_exact) in enumerate(zip(self.weight, self.all_exact)):
            wire.add_weight(ag, exact=all_exact)
            wire.add_exact(self.exact_weight_bytes(k))


def state(bucket_group) -> BucketGroupState | None:
    """The group's sdp4bit state, set up at its first call (its weight references
    re-established where weights were loaded since), or None while sdp4bit is not enabled
    (what it cannot compress was refused when the model was built)."""
    settings = current()
    if settings is None:
        return None
    found = getattr(bucket_group, "_sdp4bit", None)
    if found is None:
        return _set_up(settings, bucket_group)
    if found.stale:
        _set_up_weights(found, bucket_group, "after its parameters were loaded outside the "
                        "optimizer step (load_state_dict)")
        found.stale, found.fresh = False, True
    return found


def _set_up(settings: Settings, bucket_group) -> BucketGroupState:
    groups = sdp4bit_groups.inside_instance(settings, bucket_group)
    grads, exact, all_exact = [], [], []
    for bucket in bucket_group.buckets:
        bucket_id = getattr(bucket, "sdp4bit_bucket_id", None)
        if bucket_id is None:
            raise Sdp4bitError(
                "this DDP model was built before megatron_patch.megatron_core.enable(); "
                "enable sdp4bit first, then build the model")
        ranges = bucket.sdp4bit_exact
        exact_numel = sum(end - start for start, end in ranges)
        all_exact.append(exact_numel == sum(p.numel() for p in bucket.params_list))
        exact.append(ExactElements(ranges, groups.rank, bucket.grad_data.numel() // groups.size)
                     if ranges and not all_exact[-1] else None)
        config = Config("baseline") if all_exact[-1] else settings.config
        grads.append(GradReduceScatter(groups, config, bucket.grad_data.numel(), bucket_id,
                                       device=bucket.grad_data.device))
    log_route_notice(f"bucket group of buckets {[rs.bucket_id for rs in grads]}", grads)
    across = None
    if bucket_group.ddp_config.num_distributed_optimizer_instances > 1:
        across = AcrossInstances(
            settings.config, bucket_group.inter_distributed_optimizer_instance_group,
            sdp4bit_groups.across_instances(settings, bucket_group)
            if sdp4bit_groups.compresses_across(settings) else None,
            [b.grad_data.numel() // groups.size for b in bucket_group.buckets],
            [rs.bucket_id for rs in grads], all_exact, bucket_group.buckets[0].grad_data.device)
    found = BucketGroupState(settings.config, groups, grads, [], exact, all_exact, across)
    _set_up_weights(found, bucket_group, "when sdp4bit sets up")
    first = settings.iteration() if settings.iteration is not None else 0
    found.grad_step = settings.resume_steps.pop(grads[0].bucket_id, first)
    bucket_group._sdp4bit = found
    settings.bucket_groups.append(bucket_group)
    announce_when_set_up(settings, bucket_group)
    return found


def _set_up_weights(found: BucketGroupState, bucket_group, when: str) -> None:
    """(Re)builds the compressed all-gathers of `bucket_group` from the parameters every
    replica holds now (qWD's references), after checking that they are the same on every
    rank (`when` says at which point, for the error); this rank's exact elements go in as 0
    (:class:`ExactElements`)."""
    if not found.config.compresses_weights:
        return
    buckets = bucket_group.buckets
    check_replicas_identical([b.param_data for b in buckets], dp_group(found.groups), when)
    weights = []
    for bucket, rs, elements in zip(buckets, found.grad, found.exact):
        if elements is None:
            weights.append(WeightAllGather(found.groups, rs.config, bucket.param_data,
                                           rs.bucket_id))
            continue
        own = elements.take_own(bucket.param_data)
        weights.append(WeightAllGather(found.groups, rs.config, bucket.param_data, rs.bucket_id))
        elements.put_own(bucket.param_data, own)
    found.weight = weights
