"""What the measured GPU kernels cost a training step: each preset's codec time per step, as
measured and at issue 42's targets, and a step's compute at the measured GEMM rate, carried from
the GPU that ran them to another.

The figures are ``kernel_times.json`` beside this module: one entry per GPU run, copied from the
committed reports it names under ``sources`` (tests/python/test_kernel_times.py checks the copy
against them). A later run's entry, of the same shape, is chosen by its name or as the latest
(``python -m sdp4bit.plan --paper --kernels NAME``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).with_name("kernel_times.json")
#: The name that selects the entry of the latest date.
LATEST = "latest"
MIB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    """A GPU's datasheet figures: HBM bandwidth (GB/s) and dense bf16 tensor-core rate
    (TFLOP/s)."""

    name: str
    hbm_gbps: float
    bf16_tflops: float
    datasheet: str


#: The paper's A100s (16 nodes x 4 on Slingshot-10, docs/numerics.md §10). The paper does not
#: say which A100: taken as the 40 GB SXM4, the slower memory of the two (the 80 GB's
#: 2,039 GB/s would cut the codec time by a quarter).
A100 = Gpu("A100 SXM4 40GB", 1555.0, 312.0,
           "NVIDIA A100 Tensor Core GPU datasheet: 1,555 GB/s HBM2 (40 GB SXM4), BF16 Tensor "
           "Core 312 TFLOPS dense (624 with sparsity)")
#: The paper's H800s (16 nodes x 8 on InfiniBand), the SXM5 part.
H800 = Gpu("H800 SXM5", 3350.0, 989.0,
           "NVIDIA H800 Tensor Core GPU datasheet (SXM): 3.35 TB/s HBM3, BF16 Tensor Core "
           "1,979 TFLOPS with sparsity (989 dense)")


@dataclass(frozen=True)
class Targets:
    """Issue 42, item 6: the speed the kernels are to reach, as fractions of the
    device-to-device copy of the same run. ``copy_fraction``, by kernel (bench/gpu.rs names):
    0.75x for the kernels of the fp32 gradient path (quantizing the fp32 bucket, decoding into
    the fp32 shard), 0.5x for those of the bf16 path, qWD's encoding (bf16 input) and the
    8-to-4-bit requantization, 0.85x for weight_apply and for Global-QSGD's. ``sequence``: one
    rank's whole per-bucket sequence within this multiple of the time its bytes take at the
    copy's bandwidth."""

    copy_fraction: dict[str, float]
    sequence: float


#: Issue 42's targets (item 6), written here only.
TARGETS = Targets(
    copy_fraction={
        "grad_quantize_first": 0.75, "grad_reduce_final": 0.75,
        "grad_quantize_first_bf16": 0.5, "grad_reduce_final_bf16": 0.5, "weight_encode": 0.5,
        "grad_requantize_second": 0.5,
        "weight_apply": 0.85,
        "global_absmax": 0.85, "global_quantize_i8": 0.85, "global_dequantize_i8": 0.85,
    },
    sequence=1.5,
)


@dataclass(frozen=True)
class KernelRow:
    """One kernel row of the GPU benchmark: one rank's call for a bucket of
    ``bucket_elements`` elements."""

    row: str
    kernel: str
    label: str
    bucket_elements: int
    read_mib: float
    written_mib: float
    median_us: float

    def ns_per_element(self) -> float:
        """Measured nanoseconds per element of the bucket."""
        return self.median_us * 1e3 / self.bucket_elements

    def bytes_per_element(self) -> float:
        """Bytes read and written per element of the bucket."""
        return (self.read_mib + self.written_mib) * MIB / self.bucket_elements

    def target_ns_per_element(self, copy_gbps: float) -> float:
        """Nanoseconds per element at issue 42's target, or as measured where that is faster
        (1 GB/s is one byte per nanosecond)."""
        target = self.bytes_per_element() / (TARGETS.copy_fraction[self.kernel] * copy_gbps)
        return min(self.ns_per_element(), target)


@dataclass(frozen=True)
class KernelTimes:
    """One entry of kernel_times.json: the figures of one GPU run."""

    name: str
    date: str
    gpu: Gpu
    copy_gbps: float
    rows: dict[str, KernelRow]
    per_bucket: tuple[dict, ...]
    gemm: tuple[dict, ...]
    sources: dict

    @classmethod
    def from_entry(cls, entry: dict) -> KernelTimes:
        """The entry as the file holds it."""
        rows = {r["row"]: KernelRow(**r) for r in entry["kernels"]}
        return cls(entry["name"], entry["date"], Gpu(**entry["gpu"]), entry["copy_gbps"], rows,
                   tuple(entry["per_bucket"]), tuple(entry["gemm"]), entry["sources"])

    def source_files(self) -> list[str]:
        """The committed reports the figures were copied from."""
        medians = self.sources.get("kernel_medians")
        return ([medians["file"]] if medians else []) + [r["file"] for r in self.sources["runs"]]

    def gemm_tflops(self) -> float:
        """The bf16 GEMM rate measured on the largest GPT layer (the nearest to the paper's
        models)."""
        return max(self.gemm, key=lambda g: g["hidden"])["tflops"]

    def sequence_ns_per_element(self, preset: str, bucket_elements: float) -> float | None:
        """Nanoseconds per element of `preset`'s measured per-bucket sequence (reduce-scatter
        and all-gather kernels, fp32 gradients) at the measured bucket size nearest
        `bucket_elements`; None where the entry has none for the preset."""
        costs = [c for c in self.per_bucket if c["preset"] == preset and c["grad"] == "fp32"]
        if not costs:
            return None
        cost = min(costs, key=lambda c: abs(math.log(c["numel"] / bucket_elements)))
        return (cost["reduce_scatter_ms"] + cost["all_gather_ms"]) * 1e6 / cost["numel"]


def entries(path: Path = DATA) -> list[KernelTimes]:
    """Every entry of the file, in its order."""
    return [KernelTimes.from_entry(e) for e in json.loads(path.read_text())["entries"]]


def load(name: str = LATEST, path: Path = DATA) -> KernelTimes:
    """The entry called `name`; with ``latest``, the one of the latest date (of equal dates, the
    later in the file)."""
    found = entries(path)
    if name == LATEST:
        return max(enumerate(found), key=lambda pair: (pair[1].date, pair[0]))[1]
    for times in found:
        if times.name == name:
            return times
    raise ValueError(f"no kernel times called {name!r} in {path.name}; known: "
                     f"{', '.join([t.name for t in found] + [LATEST])}")


@dataclass(frozen=True)
class PresetKernels:
    """The kernel rows that time what a preset runs per step on one rank with the CUDA backend
    (fp32 gradients, bf16 parameters), and the kernels it runs that no row times."""

    rows: tuple[str, ...]
    missing: tuple[str, ...]


_DIRECT_WEIGHTS = "weight_encode and weight_apply of its 8-bit direct weight codec"
#: From src/collective/gradient.rs and weight.rs as the CUDA backend runs them
#: (src/backend/cuda/backend.rs) and bench/gpu.rs `kernel_rows()`, which times each row.
_PRESET_KERNELS = {
    "sdp4bit": PresetKernels(("(1)", "(2)", "(3)", "(4)", "(5)"), ()),
    "qsdp": PresetKernels(("(6a)", "(6b)"), (_DIRECT_WEIGHTS,)),
    "zeropp": PresetKernels(("(7)",), ("grad_requantize_second and grad_reduce_final of its "
                                       "4-bit codec", _DIRECT_WEIGHTS)),
    "global-qsgd": PresetKernels(("(8a)", "(8b)"), (
        "global_sum_dequantize (the CUDA backend sums the exchanged blocks; row (8c) times "
        "global_dequantize of a summed shard)",)),
    "baseline": PresetKernels((), ()),
}
#: Global-QSGD sends 8-bit integers while the ranks are at most this many, 16-bit beyond
#: (src/config.rs, `GradConfig::global_bits`).
GLOBAL_QSGD_8BIT_RANKS = 127


def preset_kernels(preset: str, ranks: int) -> PresetKernels:
    """What `preset` runs per step at `ranks` DP ranks: its timed rows and the kernels left
    out."""
    kernels = _PRESET_KERNELS[preset]
    if preset == "global-qsgd" and ranks > GLOBAL_QSGD_8BIT_RANKS:
        wide = f"global_quantize with the 16-bit integers of {ranks} ranks (row (8b) times 8-bit)"
        return PresetKernels(tuple(r for r in kernels.rows if r != "(8b)"),
                             (wide, *kernels.missing))
    return kernels


@dataclass(frozen=True)
class Codec:
    """One preset's compression kernels per step on one rank: nanoseconds per element of the
    rank's gradient bucket (and as many bf16 parameters) on the measured GPU, and the kernels
    left out because no row times them."""

    ns_per_element: float
    missing: tuple[str, ...]

    def ms(self, elements: float, times: KernelTimes, gpu: Gpu) -> float:
        """Milliseconds for `elements` on `gpu`: the measured time carried by the datasheets'
        HBM bandwidths, the kernels taken to be memory- or latency-bound."""
        return elements * self.ns_per_element * 1e-6 * times.gpu.hbm_gbps / gpu.hbm_gbps


def codec(times: KernelTimes, preset: str, ranks: int, bucket_elements: float,
          at_targets: bool = False) -> Codec:
    """`preset`'s codec time per element: its measured per-bucket sequence where the entry has
    one (sdp4bit), else the sum of its kernel rows. At the targets (issue 42, item 6) the
    sequence takes `TARGETS.sequence` times its rows' bytes at the copy's bandwidth and each
    row its fraction of the copy, either kept as measured where that is faster."""
    kernels = preset_kernels(preset, ranks)
    rows = [times.rows[r] for r in kernels.rows]
    sequence = times.sequence_ns_per_element(preset, bucket_elements)
    if sequence is not None:
        if at_targets:
            moved = sum(r.bytes_per_element() for r in rows)
            sequence = min(sequence, TARGETS.sequence * moved / times.copy_gbps)
        return Codec(sequence, kernels.missing)
    if at_targets:
        return Codec(sum(r.target_ns_per_element(times.copy_gbps) for r in rows),
                     kernels.missing)
    return Codec(sum(r.ns_per_element() for r in rows), kernels.missing)


def compute_ms(elements: float, tokens: float, times: KernelTimes, gpu: Gpu) -> float:
    """Milliseconds of a step's forward and backward GEMMs on one GPU, 6 x `elements` x
    `tokens` floating-point operations, at the measured bf16 rate carried to `gpu` by the
    datasheets' dense bf16 peaks."""
    tflops = times.gemm_tflops() * gpu.bf16_tflops / times.gpu.bf16_tflops
    return 6 * elements * tokens / (tflops * 1e12) * 1e3
