"""The main job, as the README runs it (bash scripts/main_job.sh), end to end: megatron-core's
GPTModel and DistributedOptimizer on 4 ranks, a few steps, as DP = 4 and as TP = 2 x DP = 2;
and, on CPU, what its --tp and --device cuda decide before any GPU is touched (the arguments,
the process groups' backend)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


#: With --tp 2 (2 nodes x 2 ranks): each node a TP pair, DP groups {0, 2} and {1, 3}; the
#: replicated parameters travel exact and stay identical across each TP pair.
TP2_LINES = ["4 ranks (2 nodes x 2) as TP = 2 x DP = 2 (DP group of rank 0: ranks [0, 2])",
             "TP-replicated parameters bit-identical across each TP group: True",
             "bytes sent by rank 0 in its DP group of 2:", "of them exact (exact_params)"]


#: With --instances 2 (2 nodes x 2 ranks): two distributed-optimizer instances, the gradient
#: shards all-reduced across them with Global-QSGD; all four ranks end bit-identical.
INSTANCES_LINES = ["2 distributed-optimizer instances of 2 ranks", ";cross=8"]


@pytest.mark.parametrize("extra, lines", [([], []), (["--tp", "2"], TP2_LINES),
                                          (["--instances", "2"], INSTANCES_LINES)],
                         ids=["dp4", "tp2", "instances2"])
def test_main_job_trains_and_reports_bytes_saved(tmp_path, extra, lines):
    command = ["bash", str(ROOT / "scripts/main_job.sh"), "--steps", "6", "--log-every", "5",
               "--corpus-bytes", "400000", *extra]
    # The tests' build stays installed: the main job reinstalls only when the sources, or
    # SDP4BIT_TEST_OPS, differ from what the installed package was built with.
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "SDP4BIT_TEST_OPS": "1"})
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "megatron-core GPTModel" in out and "DistributedOptimizer" in out, out
    assert "skipped steps 0; replicas bit-identical: True" in out, out
    assert "x less" in out and "MiB saved" in out, out
    assert all(line in out for line in lines), out
    losses = [float(line.split()[1]) for line in out.splitlines()
              if line.strip() and line.split()[0].isdigit()]
    assert losses[-1] < losses[0], out


def _train_module():
    """examples/gpt_cpu/train.py as a module (its own directory on the path, as when run)."""
    sys.path.insert(0, str(ROOT / "examples/gpt_cpu"))
    try:
        return importlib.import_module("train")
    finally:
        sys.path.remove(str(ROOT / "examples/gpt_cpu"))


def test_device_and_backend_arguments():
    train = _train_module()
    args = train.parse_args([])
    assert (args.device, args.backend) == ("cpu", "auto")
    args = train.parse_args(["--device", "cuda", "--backend", "gloo"])
    assert (args.device, args.backend) == ("cuda", "gloo")
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "tpu"])
    assert train.parse_args(["--instances", "2"]).instances == 2
    with pytest.raises(SystemExit):
        train.parse_args(["--instances", "0"])


def test_tensor_parallel_arguments():
    train = _train_module()
    assert train.parse_args([]).tp == 1
    assert train.parse_args(["--tp", "2"]).tp == 2
    with pytest.raises(SystemExit):
        train.parse_args(["--tp", "0"])
    assert train.data_parallel_size(4, 1) == 4 and train.data_parallel_size(4, 2) == 2
    with pytest.raises(ValueError, match="--tp 3 does not divide the 4 ranks"):
        train.data_parallel_size(4, 3)


@pytest.mark.parametrize("device, requested, local_ranks, gpus, weights, backend, why", [
    ("cpu", "auto", 4, 0, True, "gloo", "CPU tensors"),
    ("cpu", "gloo", 4, 0, False, "gloo", "CPU tensors"),
    ("cuda", "auto", 2, 1, True, "gloo", "2 ranks share 1 GPU(s)"),
    ("cuda", "auto", 1, 1, True, "nccl", "one GPU per rank"),
    ("cuda", "auto", 8, 8, False, "nccl", "one GPU per rank"),
    ("cuda", "nccl", 2, 4, True, "nccl", "one GPU per rank"),
    ("cuda", "gloo", 2, 2, True, "gloo", "--backend gloo"),
])
def test_backend_choice(device, requested, local_ranks, gpus, weights, backend, why):
    got, reason = _train_module().choose_backend(device, requested, local_ranks, gpus, weights)
    assert got == backend and reason.startswith(why), reason


@pytest.mark.parametrize("device, requested, local_ranks, gpus, weights, error", [
    ("cpu", "nccl", 1, 0, True, "needs --device cuda"),
    ("cuda", "auto", 1, 0, True, "no CUDA device"),
    ("cuda", "nccl", 2, 1, True, "NCCL refuses"),
    ("cuda", "auto", 2, 1, False, "no CUDA path in gloo"),
    ("cuda", "gloo", 1, 1, False, "no CUDA path in gloo"),
])
def test_backend_choice_refuses_what_cannot_run(device, requested, local_ranks, gpus, weights,
                                                error):
    with pytest.raises(ValueError, match=error):
        _train_module().choose_backend(device, requested, local_ranks, gpus, weights)


def test_cuda_training_without_a_gpu_stops_before_the_process_group():
    done = subprocess.run([sys.executable, str(ROOT / "examples/gpt_cpu/train.py"),
                           "--device", "cuda"], capture_output=True, text=True, timeout=300,
                          cwd="/tmp", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1, done.stderr
    assert "train.py: --device cuda: torch sees no CUDA device on this host" in done.stderr


def test_each_seeds_and_ranks_batches_are_independent_of_every_other_ones():
    batch_generator = _train_module().batch_generator

    def stream(seed, rank, seeding):
        return torch.randint(0, 2**31, (64,), generator=batch_generator(seed, rank, seeding))

    # The study's committed seeding: seed s's rank 1 draws seed s + 1's rank 0's batches.
    assert torch.equal(stream(3, 1, "offset"), stream(4, 0, "offset"))
    streams = [stream(seed, rank, "hashed") for seed in range(1, 6) for rank in range(4)]
    assert all(not torch.equal(a, b) for i, a in enumerate(streams) for b in streams[i + 1:])
    assert torch.equal(stream(3, 1, "hashed"), stream(3, 1, "hashed"))
    with pytest.raises(ValueError, match="data seeding 'random'"):
        batch_generator(1, 0, "random")
