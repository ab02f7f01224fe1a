"""What every framework integration (megatron-core, DeepSpeed, FSDP2) shares: the shard of a
bucket a DP rank owns, the bf16 requirement of the weight codecs, the count of bytes sent
against the uncompressed collectives, the buffer the all-reduce across groups takes, the log
line when a topology forces the slower one-level route, and the refusal of the exact
parameters only megatron_patch implements."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .collectives import GradReduceScatter
from .config import Config
from .errors import Sdp4bitError
from .telemetry import announce

logger = logging.getLogger("sdp4bit")


def local_shard(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """DP rank `rank`'s shard of a flat buffer split into `size` equal parts (the layout of
    Megatron's buckets and DeepSpeed's flat partitions)."""
    shard = tensor.numel() // size
    return tensor[rank * shard:(rank + 1) * shard]


def ring_all_reduce_bytes(numel: int, world: int, element_bytes: int = 4) -> int:
    """Bytes one rank sends in a ring all-reduce of `numel` elements of `element_bytes` each
    over `world` ranks (a reduce-scatter, then an all-gather), as the frameworks' own
    all-reduces send them."""
    return 2 * (world - 1) * numel * element_bytes // world


def cross_group_len(numel: int, groups: int) -> int:
    """The length :class:`~sdp4bit.CrossGroupAllReduce` takes for `numel` elements over
    `groups` groups: the next multiple of `groups`."""
    return -(-numel // groups) * groups


def cross_group_buffer(data: torch.Tensor, groups: int) -> torch.Tensor:
    """What the all-reduce across `groups` groups reads and writes for the flat gradient shard
    `data`: `data` itself when it is fp32 or bf16 of a length :func:`cross_group_len` keeps,
    else a zero-padded fp32 copy, whose result the caller copies back (rounded as the
    collective rounds a bf16 buffer)."""
    numel = data.numel()
    if numel == cross_group_len(numel, groups) and data.dtype in (torch.float32,
                                                                  torch.bfloat16):
        return data
    staged = torch.zeros(cross_group_len(numel, groups), dtype=torch.float32,
                         device=data.device)
    staged[:numel].copy_(data.reshape(-1))
    return staged


def require_bf16(dtypes: Iterable[torch.dtype], what: str, remedy: str) -> None:
    """Raises :class:`Sdp4bitError` unless every dtype is bf16: the weight codecs all-gather bf16
    parameters. `what` names the buffers, `remedy` says how to fix it in the framework."""
    found = sorted({str(d) for d in dtypes})
    if found != [str(torch.bfloat16)]:
        raise Sdp4bitError(f"the weight codecs all-gather bf16 parameters; {what} {found} "
                           f"({remedy}, or set weight_codec=none)")


@dataclass
class WireCounter:
    """Bytes this rank sent through sdp4bit's collectives, and what the uncompressed
    collectives would have sent for the same calls; `exact` of the bytes sent carried
    parameters kept exact (megatron_patch's ``exact_params``)."""

    sent: int = 0
    uncompressed: int = 0
    exact: int = 0

    def add(self, sent: int, uncompressed: int) -> None:
        """One call that sent `sent` bytes where the framework's own collective would have
        sent `uncompressed` (e.g. in a 16-bit dtype the core's fp32 baseline does not know)."""
        self.sent += sent
        self.uncompressed += uncompressed

    def add_grad(self, rs: GradReduceScatter, step: int, exact: bool = False) -> None:
        """One reduce-scatter of `rs` at `step`; `exact`: of a bucket kept exact whole."""
        sent = rs.wire_bytes(step).total
        self.sent += sent
        self.exact += sent if exact else 0
        self.uncompressed += rs.baseline_wire_bytes().total

    def add_weight(self, ag, exact: bool = False) -> None:
        """One all-gather of `ag` (a :class:`~sdp4bit.WeightAllGather`); `exact`: of a bucket
        kept exact whole."""
        sent = ag.wire_bytes().total
        self.sent += sent
        self.exact += sent if exact else 0
        self.uncompressed += ag.baseline_wire_bytes().total

    def add_exact(self, sent: int) -> None:
        """Bytes sent beside the compressed collectives by the exact path of some elements
        (counted in nothing uncompressed: the collectives' own counts hold those elements)."""
        self.sent += sent
        self.exact += sent

    def pair(self) -> tuple[int, int]:
        """(sent, uncompressed)."""
        return self.sent, self.uncompressed


def log_route_notice(where: str, reduce_scatters: Iterable[GradReduceScatter]) -> None:
    """Logs, once for a set of buckets set up together (`where` names them), why the topology
    degraded the gradient route, if it did (nodes of unequal size run one level at the
    inter-node bits)."""
    notices = {rs.notice() for rs in reduce_scatters} - {None}
    for notice in sorted(notices):
        logger.warning("sdp4bit %s: %s", where, notice)


def refuse_exact_embeddings(config, framework: str) -> None:
    """Raises :class:`Sdp4bitError` when `config` asks for ``exact_params`` that only the
    megatron-core integration implements (``norms-biases-embeddings``): `framework` (named in
    the message) compresses every parameter. Its other values hold there as they are (FSDP2
    keeps the elements of tensor-parallel copies exact under ``replicated``; DeepSpeed refuses
    tensor parallelism, so none are replicated)."""
    if config.resolved.exact_params == "norms-biases-embeddings":
        raise Sdp4bitError(f"exact_params=norms-biases-embeddings is implemented for "
                           f"megatron-core (megatron_patch) only; {framework} compresses every "
                           "parameter (exact_params=replicated or none)")


def freed_weights_config(preset: str, overrides: dict, framework: str) -> Config:
    """`preset` and `overrides` (knobs, as :meth:`Config.from_knobs` takes them) as an
    integration that frees gathered weights after use (`framework`: ZeRO stage 3, FSDP2) runs
    them, by one rule (docs/configuration.md): a preset whose weight codec is qWD, which needs
    every rank to keep the previous weights, runs with QSDP's direct weights (qsdp) instead and
    keeps its gradient codec, and rank 0 logs one line saying so; a weight codec named in
    `overrides` is kept as named (qwd is then refused by the integration). Validated."""
    config = Config.from_knobs(preset, overrides)
    if "weight_codec" not in overrides and config.resolved.keeps_reference:
        config = config.replace(weight_codec="qsdp")
        announce(f"sdp4bit: the {preset} preset's qWD weights need every rank to keep the "
                 f"previous weights, which {framework} frees after each gather: its weights "
                 "run with qsdp (8-bit) instead; set weight_codec (qsdp, qw, zeropp or none) to "
                 "choose")
    return config.validate()
