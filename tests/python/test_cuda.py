"""The collectives on CUDA tensors (the Rust core's CUDA backend: kernels on torch's current
stream, exchanges over NCCL or gloo) against the in-process CPU collective, byte for byte.
Needs a CUDA GPU; skipped without one (the CPU-only checks of CUDA set-up errors are in
test_collectives.py)."""

import pytest
import scenarios
import torch
from harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_w1_nccl_equals_the_cpu():
    run_ranks(1, scenarios.byte_equal_to_in_process, [0], scenarios.PRESETS, False, "cuda:0",
              backend="nccl")


@pytest.mark.parametrize("labels", [[0, 0], [0, 1]], ids=["1x2", "2x1"])
def test_w2_gloo_on_one_gpu_equals_the_cpu(labels):
    run_ranks(2, scenarios.byte_equal_to_in_process, labels, scenarios.PRESETS, False,
              "cuda:0")


def test_w4_gloo_on_one_gpu_two_levels_equal_the_cpu():
    run_ranks(4, scenarios.byte_equal_to_in_process, [0, 0, 1, 1], scenarios.PRESETS, False,
              "cuda:0")


def test_pipelined_chunks_on_one_gpu_equal_one_chunk():
    reports = run_ranks(4, scenarios.pipelined_chunks_equal_one_chunk, [0, 0, 1, 1], "cuda:0")
    assert reports[0] == ["4", "3", "auto"], reports[0]


def test_nan_reaches_every_owner_on_cuda():
    run_ranks(2, scenarios.nan_reaches_the_owner, [0, 1], scenarios.PRESETS, "cuda:0")
