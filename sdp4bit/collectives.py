"""Compressed collectives of one flat bucket: the gradient reduce-scatter and the parameter
all-gather, each started by ``start()`` (queued on the groups' background thread for CPU
buckets, enqueued on the groups' side stream for CUDA buckets) and completed by ``wait()``."""

from __future__ import annotations

import select
from dataclasses import dataclass

import torch

from . import _native
from .config import Config
from .errors import translated_errors
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
    finished it."""

    def __init__(self, work, on_device: bool) -> None:
        self._work = work  # None once wait() has completed a CPU collective
        self._error: Exception | None = None  # what that wait() raised, raised again by later ones
        self._on_device = on_device

    def wait(self) -> None:
        """Completes the collective: for a CPU bucket blocks until it has run, for a CUDA
        bucket orders the current stream after it."""
        if self._on_device:
            with translated_errors():
                self._work.wait()
            return
        self._wait_for_host()

    def _wait_for_host(self) -> None:
        """Blocks until the CPU collective completes. The blocking is done in Python's own
        ``select.poll`` on the collective's completion descriptor (an eventfd the extension's
        background thread makes readable once the collective has run), never inside a
        blocking call into the extension: torch gives up the GIL around every call into a
        TorchScript class and takes it back after it, and a thread taking it back after the
        interpreter began shutting down is ended by an unwinding that aborts the process
        ("terminate called without an active exception"). A thread blocked in ``poll`` is
        ended cleanly instead, as a sleeping one is. ``poll`` (not ``select``) takes
        descriptors of any number. The final ``wait()`` returns at once and raises the
        collective's error, if any.

        The completed collective is released here, while this thread still counts as waiting
        (``counted_wait``, which the exit hook waits for): releasing it frees the tensors it
        kept alive, and torch may give up the GIL while it frees a tensor, so a thread that
        freed it later, during interpreter shutdown, would abort the process as above. It is
        released when ``wait()`` raises too, and a later call raises the same error again, as
        c10d's ``Work.wait`` does."""
        if self._work is None:
            if self._error is not None:
                raise self._error
            return
        try:
            with counted_wait(), translated_errors():
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


def _side_stream_handle(groups: ProcessGroups, device: torch.device) -> int:
    """The cudaStream_t of the groups' side stream on `device` (0 on the CPU), which the
    extension enqueues a CUDA bucket's work on."""
    return groups.side_stream(device).cuda_stream if device.type == "cuda" else 0


def _planned_side_stream_handle(groups: ProcessGroups, device: torch.device | str) -> int:
    """The side stream handle for a bucket planned on the device named `device` (a bare
    "cuda" is the current device, as the extension reads it), or 0 where this process cannot
    use such a device: the extension's set-up check then reports why on every rank, so nothing
    is raised here."""
    try:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return 0
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _side_stream_handle(groups, device)
    except (RuntimeError, ValueError, TypeError):
        return 0


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

    On CUDA, ``start`` enqueues every kernel and exchange on the groups' side stream after
    the work already issued on the current stream, and returns without waiting; after
    ``wait()``, work issued on the stream current at ``wait()`` sees the shard. The current
    stream must not touch `bucket` or `shard` between ``start`` and ``wait``.
    """

    def __init__(self, groups: ProcessGroups, config: Config, numel: int, bucket_id: int,
                 device: torch.device | str = "cpu"):
        if numel <= 0:
            raise ValueError(f"sdp4bit: bucket size must be positive, got {numel}")
        self.groups, self.config, self.numel, self.bucket_id = groups, config, numel, bucket_id
        with translated_errors():
            # A device this rank cannot use is reported by every rank at once (the
            # extension's set-up check), so the name is passed on unchecked.
            self._native = _native.classes().GradReduceScatter(
                groups.native, config.spec(), groups.node_labels, numel, bucket_id, str(device),
                _planned_side_stream_handle(groups, device),
            )
        self.device = torch.device(self._native.device())
        self.shard_len = self._native.shard_len()
        self._side_stream = _side_stream_handle(groups, self.device)

    def start(self, bucket: torch.Tensor, shard: torch.Tensor, step: int) -> Handle:
        """Starts reduce-scattering `bucket` into `shard` for optimizer step `step`."""
        dtype = _gradient_dtype(bucket, shard)
        _check_tensor("gradient bucket", bucket, dtype, self.numel, self.device)
        _check_tensor("gradient shard", shard, dtype, self.shard_len, self.device)
        with translated_errors():
            work = self._native.start(bucket, shard, _check_step(step), self._side_stream)
        return Handle(work, self.device.type == "cuda")

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
    (kernels on the groups' side stream, as for :class:`GradReduceScatter`). Before each
    ``start(params, step)`` the caller writes this rank's new shard (shard ``rank``,
    ``numel / W`` elements) into `params`; after ``wait()`` every replica holds the same bucket,
    bit for bit (qWD sends 4-bit differences from the previous values, kept on each rank).
    """

    def __init__(self, groups: ProcessGroups, config: Config, params: torch.Tensor,
                 bucket_id: int):
        self.groups, self.config, self.bucket_id = groups, config, bucket_id
        with translated_errors():
            # Problems with `params` are reported by every rank at once (the set-up check
            # runs even when this rank's input is bad), so they are left to the extension.
            self._native = _native.classes().WeightAllGather(
                groups.native, config.spec(), groups.node_labels, params, bucket_id,
                _side_stream_handle(groups, params.device)
                if isinstance(params, torch.Tensor) else 0,
            )
        self.numel = params.numel()
        self.device = params.device
        self.shard_len = self._native.shard_len()
        self._side_stream = _side_stream_handle(groups, self.device)

    def start(self, params: torch.Tensor, step: int) -> Handle:
        """Starts all-gathering `params` for optimizer step `step`."""
        _check_tensor("param bucket", params, torch.bfloat16, self.numel, self.device)
        with translated_errors():
            work = self._native.start(params, _check_step(step), self._side_stream)
        return Handle(work, self.device.type == "cuda")

    def wire_bytes(self) -> WireBytes:
        """Bytes this rank sends per call."""
        return WireBytes(*self._native.wire_bytes())

    def baseline_wire_bytes(self) -> WireBytes:
        """Bytes the uncompressed bf16 all-gather of this bucket sends."""
        return WireBytes(*self._native.baseline_wire_bytes())
