"""The main job, as the README runs it (bash scripts/main_job.sh), end to end: megatron-core's
GPTModel and DistributedOptimizer on 4 ranks, a few steps; and, on CPU, what its --device cuda
decides before any GPU is touched (the arguments, the process groups' backend)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_trains_and_reports_bytes_saved(tmp_path):
    command = ["bash", str(ROOT / "scripts/main_job.sh"), "--steps", "6", "--log-every", "5",
               "--corpus-bytes", "400000"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "megatron-core GPTModel" in out and "DistributedOptimizer" in out, out
    assert "skipped steps 0; replicas bit-identical: True" in out, out
    assert "x less" in out and "MiB saved" in out, out
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
