"""Compressed collectives of one flat bucket: the gradient reduce-scatter, the parameter
all-gather and the all-reduce across the groups of hybrid sharding, each started by
``start()`` (queued on the groups' background thread for CPU buckets, enqueued on the groups'
side stream of their kind for CUDA buckets) and completed by ``wait()``."""

from __future__ import annotations

import select
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _native
from .config import Config
from .errors import Sdp4bitError, translated_errors
from .groups import ProcessGroups, counted_wait


@dataclass(frozen=True)
class WireBytes:
    """Bytes one rank sends in one call, to peers on its node and on other nodes."""

    intra_node: int
    inter_node: int

    @property
    def total(self) -> int:
        return self.intra_node + self.inter_node


# The longest Handle.wait blocks on a CPU collective's completion descriptor before it checks
# completion again, milliseconds: the descriptor becomes readable only after the collective
# has completed, so the check is a safeguard, not how completion is seen.
_COMPLETION_RECHECK_MS = 1000


class Handle:
    """A collective in flight; :meth:`wait` completes it (and raises its error, if any).

    For a CUDA bucket the collective is already enqueued (its errors were raised by
    ``start``): :meth:`wait` makes the current stream wait for it and returns at once, as
    ``torch.distributed``'s async work does; :meth:`is_completed` asks whether the device has
    finished it. Its errors name `collective` (what it is: kind, bucket and step)."""

    def __init__(self, work, on_device: bool, collective: str) -> None:
        self._work = work  # None once wait() has completed a CPU collective
        self._error: Exception | None = None  # what that wait() raised, raised again by later ones
        self._on_device = on_device
        self.collective = collective

    def wait(self) -> None:
        """Completes the collective: for a CPU bucket blocks until it has run, for a CUDA
        bucket orders the current stream after it."""
        if self._on_device:
            with translated_errors(self.collective):
                self._work.wait()
            return
        self._wait_for_host()

    def _wait_for_host(self) -> None:
        """Blocks until the CPU collective completes, in Python's own ``select.poll`` on its
        completion descriptor, never in a blocking call into the extension, and releases the
        completed collective while this thread still counts as waiting (``counted_wait``):
        docs/architecture.md, "Waiting, and the GIL at shutdown", says why. ``poll`` (not
        ``select``) takes descriptors of any number. The final ``wait()`` returns at once and
        raises the collective's error, if any; the collective is released when it raises too,
        and a later call raises the same error again, as c10d's ``Work.wait`` does."""
        if self._work is None:
            if self._error is not None:
                raise self._error
            return
        try:
            with counted_wait(), translated_errors(self.collective):
                try:
                    if not self._work.is_completed():
                        completion = select.poll()
                        completion.register(self._work.completion_fd(), select.POLLIN)
                        while not self._work.is_completed():
                            completion.poll(_COMPLETION_RECHECK_MS)
                    self._work.wait()
                finally:
                    self._work = None
        except Exception as error:
            self._error = error
            raise

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def _check_tensor(what: str, tensor: torch.Tensor, dtype: torch.dtype, numel: int,
                  device: torch.device) -> None:
    """Raises TypeError / ValueError naming what is wrong with `tensor`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sdp4bit: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(
            f"sdp4bit: {what} is on {tensor.device}, the bucket was planned on {device}"
        )
    if tensor.dtype != dtype:
        raise TypeError(f"sdp4bit: {what} must be {dtype}, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"sdp4bit: {what} must be contiguous")
    if tensor.numel() != numel:
        raise ValueError(
            f"sdp4bit: {what} has {tensor.numel()} elements, the bucket was planned for {numel}"
        )


def _gradient_dtype(bucket: torch.Tensor, shard: torch.Tensor) -> torch.dtype:
    """The dtype of a gradient bucket and its shard: float32 or bfloat16, the same for both
    (a non-tensor is left to `_check_tensor` to name)."""
    if not isinstance(bucket, torch.Tensor) or not isinstance(shard, torch.Tensor):
        return torch.float32
    if bucket.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(
            f"sdp4bit: gradient bucket must be torch.float32 or torch.bfloat16, got {bucket.dtype}"
        )
    if shard.dtype != bucket.dtype:
        raise TypeError(
            f"sdp4bit: gradient shard is {shard.dtype} but the gradient bucket is "
            f"{bucket.dtype}: both must be float32 or both bfloat16"
        )
    return bucket.dtype


def _side_stream_handle(groups: ProcessGroups, device: torch.device, collective: str) -> int:
    """The cudaStream_t of the groups' side stream of `collective` on `device` (0 on the CPU),
    which the extension enqueues a CUDA bucket's work on."""
    return groups.side_stream(device, collective).cuda_stream if device.type == "cuda" else 0


def _planned_side_stream_handle(groups: ProcessGroups, device: torch.device | str,
                                collective: str) -> int:
    """The side stream handle of `collective` for a bucket planned on the device named
    `device` (a bare "cuda" is the current device, as the extension reads it), or 0 where this
    process cannot use such a device: the extension's set-up check then reports why on every
    rank, so nothing is raised here."""
    try:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return 0
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _side_stream_handle(groups, device, collective)
    except (RuntimeError, ValueError, TypeError):
        return 0


def _refuse_graph_capture(device: torch.device | str, what: str) -> None:
    """Raises :class:`Sdp4bitError` naming it when a CUDA graph is being captured on the
    current stream of `device` (that device's, not the current device's). sdp4bit's CUDA
    collectives are driven by the host (c10d calls, events, the integer-sum readback and
    agreement) and their set-up waits for the device, none of which a graph's replay repeats
    or a capture allows; so ``start()`` and set-up refuse before they enqueue anything. A
    device this process cannot use is left to the extension's set-up check."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return
    if (device.type != "cuda" or not torch.cuda.is_available()
            or (device.index or 0) >= torch.cuda.device_count()):
        return
    with torch.cuda.device(device):
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        raise Sdp4bitError(
            f"{what}: a CUDA graph is being captured on the current stream of {device}; "
            "sdp4bit's collectives are driven by the host and cannot be captured (start them "
            "outside the captured region)"
        )


class _IntegerSumAgreement:
    """Raises Global-QSGD's integer-sum overflows of a CUDA bucket on every rank at the same
    ``start()`` (docs/cuda.md, "Global-QSGD's overflows"). Each rank reads its status word
    back without waiting for the device, so each sees its own overflow at a step of its own;
    raising there would leave the peers waiting in the next collective. Instead every
    ``start()`` sends what this rank has seen (its DP rank and status word, or nothing) in a
    MIN all-reduce of one int64 on the groups' gloo group, issued asynchronously, and the next
    ``start()`` of the bucket completes it before it enqueues anything: that wait is for the
    peers' hosts to have issued theirs, never for a device. Every rank gets the same result at
    the same ``start()``, and all raise the same error there (the lowest rank's) or none."""

    #: What a rank that has seen no overflow sends: above every (rank, status) key.
    _NONE = 2**63 - 1

    def __init__(self, group: dist.ProcessGroup, rank: int) -> None:
        self._group, self._rank = group, rank
        self._seen = 0  # a status word read back here and not sent yet
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def agreed(self) -> tuple[int, int] | None:
        """Completes the agreement issued at the previous ``start()`` and returns the (DP
        rank, status word) of the lowest rank that reported an overflow in it, or None."""
        if self._pending is None:
            return None
        work, key = self._pending
        self._pending = None
        work.wait()
        value = int(key.item())
        if value == self._NONE:
            return None
        return value >> 32, value & 0xFFFF_FFFF

    def see(self, status: int) -> None:
        """Keeps this rank's status word `status` (0: nothing new) until it is sent."""
        if status and not self._seen:
            self._seen = status

    def issue(self) -> None:
        """Sends what this rank has seen; the next ``agreed()`` completes it."""
        value = (self._rank << 32) | self._seen if self._seen else self._NONE
        key = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(key, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        self._pending, self._seen = (work, key), 0


def _check_step(step: int) -> int:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"sdp4bit: step must be a non-negative int, got {step!r}")
    return step


class GradReduceScatter:
    """The gradient reduce-scatter of one bucket of `numel` elements on `device` (the CPU,
    or a CUDA device whose kernels run on the caller's current stream). A bucket and its
    shard are both float32 or both bfloat16, chosen per call: a bfloat16 bucket is read as
    float32 and its shard written rounded to nearest even, so it sends and gives what its
    float32 conversion would, rounded (docs/numerics.md §7.5).

    After ``start(bucket, shard, step).wait()`` this rank's `shard` (``numel / W`` elements,
    shard ``rank`` of the bucket; it may be a view into `bucket`) holds the sum of every
    rank's `bucket` over that range, within the codec's error. Set-up is collective: every
    rank of the DP group constructs its bucket with the same config, bucket id and size, or
    all of them raise (also when a rank cannot use its device).

    On CUDA, ``start`` enqueues every kernel and exchange on the groups' reduce-scatter side
    stream (a :class:`WeightAllGather` has a side stream of its own) after the work already
    issued on the current stream, and returns without waiting; after ``wait()``, work issued
    on the stream current at ``wait()`` sees the shard. The current stream must not touch
    `bucket` or `shard` between ``start`` and ``wait``.
    """

    def __init__(self, groups: ProcessGroups, config: Config, numel: int, bucket_id: int,
                 device: torch.device | str = "cpu"):
        _refuse_graph_capture(device, "setting up a GradReduceScatter")
        if numel <= 0:
            raise ValueError(f"sdp4bit: bucket size must be positive, got {numel}")
        self.groups, self.config, self.numel, self.bucket_id = groups, config, numel, bucket_id
        with translated_errors():
            # A device this rank cannot use is reported by every rank at once (the
            # extension's set-up check), so the name is passed on unchecked.
            self._native = _native.classes().GradReduceScatter(
                groups.native, config.spec(), groups.node_labels, numel, bucket_id, str(device),
                _planned_side_stream_handle(groups, device, "reduce_scatter"),
            )
        self.device = torch.device(self._native.device())
        self.shard_len = self._native.shard_len()
        self._side_stream = _side_stream_handle(groups, self.device, "reduce_scatter")
        self._sums = (_IntegerSumAgreement(groups.host_group(), groups.rank)
                      if self._native.reads_back_integer_sums() else None)

    def start(self, bucket: torch.Tensor, shard: torch.Tensor, step: int) -> Handle:
        """Starts reduce-scattering `bucket` into `shard` for optimizer step `step`. A
        CUDA Global-QSGD bucket raises here an overflow of its integer sum in an earlier step
        (the overflowing shard elements were NaN meanwhile), on every rank at the same call."""
        _refuse_graph_capture(self.device, "GradReduceScatter.start")
        dtype = _gradient_dtype(bucket, shard)
        _check_tensor("gradient bucket", bucket, dtype, self.numel, self.device)
        _check_tensor("gradient shard", shard, dtype, self.shard_len, self.device)
        step = _check_step(step)
        if self._sums is not None:
            agreed = self._sums.agreed()
            with translated_errors():
                self._sums.see(self._native.take_integer_sum_status())
                if agreed is not None:
                    raise Sdp4bitError(self._native.integer_sum_error(*agreed))
        collective = f"gradient reduce-scatter of bucket {self.bucket_id} at step {step}"
        with translated_errors(collective):
            work = self._native.start(bucket, shard, step, self._side_stream)
        if self._sums is not None:
            self._sums.issue()
        return Handle(work, self.device.type == "cuda", collective)

    def quantizes_at(self, step: int) -> bool:
        """Whether step `step` sends quantized gradients (false for the uncompressed codec
        and before the config's ``grad_quant_start_step``)."""
        return self._native.quantizes_at(_check_step(step))

    def wire_bytes(self, step: int) -> WireBytes:
        """Bytes this rank sends at step `step`."""
        return WireBytes(*self._native.wire_bytes(_check_step(step)))

    def baseline_wire_bytes(self) -> WireBytes:
        """Bytes the uncompressed fp32 reduce-scatter of this bucket sends."""
        return WireBytes(*self._native.baseline_wire_bytes())

    def notice(self) -> str | None:
        """Why the route is degraded (nodes of unequal size), if it is."""
        return self._native.notice() or None


class WeightAllGather:
    """The parameter all-gather of one bf16 bucket.

    `params` is the bucket as every replica holds it at set-up, on the CPU or a CUDA device
    (kernels on the groups' all-gather side stream, ordered as a :class:`GradReduceScatter` is
    on its own). Before each ``start(params, step)`` the caller writes this rank's new shard
    (shard ``rank``, ``numel / W`` elements) into `params`; after ``wait()`` every replica
    holds the same bucket, bit for bit (qWD sends 4-bit differences from the previous values,
    kept on each rank).
    """

    def __init__(self, groups: ProcessGroups, config: Config, params: torch.Tensor,
                 bucket_id: int):
        _refuse_graph_capture(getattr(params, "device", "cpu"), "setting up a WeightAllGather")
        self.groups, self.config, self.bucket_id = groups, config, bucket_id
        with translated_errors():
            # Problems with `params` are reported by every rank at once (the set-up check
            # runs even when this rank's input is bad), so they are left to the extension.
            self._native = _native.classes().WeightAllGather(
                groups.native, config.spec(), groups.node_labels, params, bucket_id,
                _side_stream_handle(groups, params.device, "all_gather")
                if isinstance(params, torch.Tensor) else 0,
            )
        self.numel = params.numel()
        self.device = params.device
        self.shard_len = self._native.shard_len()
        self._side_stream = _side_stream_handle(groups, self.device, "all_gather")

    def start(self, params: torch.Tensor, step: int) -> Handle:
        """Starts all-gathering `params` for optimizer step `step`."""
        _refuse_graph_capture(self.device, "WeightAllGather.start")
        _check_tensor("param bucket", params, torch.bfloat16, self.numel, self.device)
        step = _check_step(step)
        collective = f"parameter all-gather of bucket {self.bucket_id} at step {step}"
        with translated_errors(collective):
            work = self._native.start(params, step, self._side_stream)
        return Handle(work, self.device.type == "cuda", collective)

    def wire_bytes(self) -> WireBytes:
        """Bytes this rank sends per call."""
        return WireBytes(*self._native.wire_bytes())

    def baseline_wire_bytes(self) -> WireBytes:
        """Bytes the uncompressed bf16 all-gather of this bucket sends."""
        return WireBytes(*self._native.baseline_wire_bytes())


class CrossGroupAllReduce:
    """The Global-QSGD all-reduce of one fp32 or bf16 buffer of `numel` elements (a multiple
    of the group count) across the groups of hybrid sharding (docs/numerics.md §7.6):
    `groups` are the process groups of the ranks that hold the same shard in every group
    (Megatron's distributed-optimizer instances, FSDP2's replicate dimension), `stream_rank`
    this rank's index in the whole DP world (its random streams'). After
    ``start(data, step).wait()`` every group's `data` holds the same bits, the sum over the
    groups within `n` global scales (``cross_group_bits`` of `config`; its ``exact`` setting
    is the framework's own all-reduce, not this class). Set-up is collective over `groups`,
    with the same agreement check as the other collectives. On CUDA, ordered as
    :class:`GradReduceScatter` is, on the groups' reduce-scatter side stream."""

    def __init__(self, groups: ProcessGroups, config: Config, numel: int, bucket_id: int,
                 stream_rank: int, device: torch.device | str = "cpu"):
        _refuse_graph_capture(device, "setting up a CrossGroupAllReduce")
        if numel <= 0:
            raise ValueError(f"sdp4bit: cross-group buffer size must be positive, got {numel}")
        self.groups, self.config, self.numel = groups, config, numel
        self.bucket_id = bucket_id
        with translated_errors():
            self._native = _native.classes().CrossGroupAllReduce(
                groups.native, config.spec(), numel, bucket_id, stream_rank, str(device),
                _planned_side_stream_handle(groups, device, "reduce_scatter"),
            )
        self.device = torch.device(self._native.device())
        self._side_stream = _side_stream_handle(groups, self.device, "reduce_scatter")

    def start(self, data: torch.Tensor, step: int) -> Handle:
        """Starts all-reducing `data` in place for optimizer step `step`."""
        _refuse_graph_capture(self.device, "CrossGroupAllReduce.start")
        if not isinstance(data, torch.Tensor) or data.dtype not in (torch.float32,
                                                                     torch.bfloat16):
            raise TypeError("sdp4bit: the cross-group buffer must be a torch.float32 or "
                            f"torch.bfloat16 tensor, got {getattr(data, 'dtype', type(data))}")
        _check_tensor("cross-group buffer", data, data.dtype, self.numel, self.device)
        step = _check_step(step)
        collective = f"all-reduce across groups of bucket {self.bucket_id} at step {step}"
        with translated_errors(collective):
            work = self._native.start(data, step, self._side_stream)
        return Handle(work, self.device.type == "cuda", collective)

    def wire_bytes(self) -> int:
        """Bytes this rank sends per call."""
        return self._native.wire_bytes()

    def baseline_wire_bytes(self) -> int:
        """Bytes the framework's fp32 ring all-reduce of the buffer sends per rank."""
        return self._native.baseline_wire_bytes()
