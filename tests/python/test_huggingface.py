"""Hugging Face Trainer with DeepSpeed ZeRO 2 and the config's "sdp4bit" section, for real: the
example examples/huggingface/train.py (a tiny GPT-2, bf16, 2 gloo ranks on CPU) launched by
torchrun with the launcher prefix ``-m sdp4bit.deepspeed`` and by ``accelerate launch`` with
``--install``; its resume from the Trainer's checkpoint in fresh processes; sdp4bit's numbers in
the Trainer's logs (sdp4bit.huggingface). Each rank's results come from
huggingface_scenarios.py, which runs the example unchanged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EXAMPLE = "examples/huggingface"
BIN = Path(sys.executable).parent
STEPS, SAVED = 6, 3  # the uninterrupted run's steps; the checkpoint it resumes from
SENT, UNCOMPRESSED = "sdp4bit/bytes_sent", "sdp4bit/bytes_uncompressed"


def _launch(launcher: list[str], results: Path, *args: str) -> list[dict]:
    """Runs huggingface_scenarios.py with `args` (its own, then the example and the example's)
    on 2 ranks from the checkout under `launcher`; returns each rank's results."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    # The ranks must import the installed sdp4bit, but `-m` and accelerate's launcher put the
    # working directory on the path: they run from a directory that holds only the examples
    # (the paths in the commands and configs are relative to the checkout, as the docs show).
    workdir = results.parent / "workdir"
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "examples").exists():
        (workdir / "examples").symlink_to(ROOT / "examples")
    command = [*launcher, str(HERE / "huggingface_scenarios.py"), str(results), *args]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-6000:]}"
    return [torch.load(results / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _prefixed(results: Path, output: Path, *args: str, control: tuple = ()) -> list[dict]:
    """torchrun with the launcher prefix, the example's DeepSpeed config; `args` to the
    example, `control` to huggingface_scenarios.py."""
    return _launch([str(BIN / "torchrun"), "--nproc-per-node", "2", "-m", "sdp4bit.deepspeed"],
                   results, *control, f"{EXAMPLE}/train.py", "--deepspeed",
                   f"{EXAMPLE}/ds_config.json", "--output-dir", str(output), *args)


def _compressed_and_logged(ranks: list[dict]) -> None:
    """sdp4bit compressed (bytes sent, under half of ZeRO's own), the replicas held the same
    model after every step, and each rank's logs carry its counters and weight error, in the
    Trainer's history and as the callbacks after sdp4bit's (the reporting ones) receive them."""
    assert ranks[0]["digests"] == ranks[1]["digests"], "the replicas differ"
    assert torch.equal(ranks[0]["model"], ranks[1]["model"])
    for rank in ranks:
        sent, uncompressed = rank["wire_bytes"]
        assert 0 < sent < uncompressed / 2, rank["wire_bytes"]
        logged = [entry for entry in rank["log_history"] if SENT in entry]
        steps = [entry for entry in logged if "loss" in entry]
        assert len(steps) == len(rank["digests"]), "a step's log lacks sdp4bit's numbers"
        assert all(0 < a[SENT] < b[SENT] for a, b in zip(steps, steps[1:]))
        last = logged[-1]
        assert (last[SENT], last[UNCOMPRESSED]) == (sent, uncompressed)
        assert last["sdp4bit/bytes_saved"] == uncompressed - sent
        # The weight error: this rank's, and beyond what rounding the masters to bf16 gives
        # (DeepSpeed's own path's weight error: its bf16 weights are the masters rounded).
        assert last["sdp4bit/weight_rel_l2_error"] == rank["weight_error"]
        assert rank["weight_error"] > 1.25 * rank["bf16_rounding_error"] > 0, rank
        assert rank["logs"] == [{key: value for key, value in entry.items() if key != "step"}
                                for entry in rank["log_history"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list[dict]]:
    """STEPS steps under the launcher prefix, a checkpoint every SAVED."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return root, _prefixed(root / "results", root / "out", "--steps", str(STEPS),
                           "--save-steps", str(SAVED))


def test_trainer_under_the_launcher_prefix_compresses_and_logs(uninterrupted):
    _compressed_and_logged(uninterrupted[1])


def test_resume_from_the_trainers_checkpoint_continues_bit_identically(uninterrupted,
                                                                      tmp_path):
    # Fresh processes whose model starts from another seed resume from the checkpoint of step
    # SAVED: the same bf16 model and fp32 masters on every rank as the uninterrupted run,
    # after each step, and the replicas identical.
    root, whole = uninterrupted

    def resumed(name: str, control: tuple = ()) -> list[dict]:
        output = tmp_path / name
        shutil.copytree(root / "out" / f"checkpoint-{SAVED}", output / f"checkpoint-{SAVED}")
        return _prefixed(tmp_path / f"{name}-results", output, "--steps", str(STEPS),
                         "--save-steps", str(SAVED), "--init-seed", "2", "--resume",
                         control=control)

    ranks = resumed("resumed")
    for mine, theirs in zip(ranks, whole):
        assert mine["digests"] == theirs["digests"][SAVED:]
        assert torch.equal(mine["model"], theirs["model"])
        assert torch.equal(mine["masters"], theirs["masters"])
    assert ranks[0]["digests"] == ranks[1]["digests"]
    # The control: without sdp4bit's saved step counters the continuation differs.
    dropped = resumed("dropped", ("--drop", "counters"))
    assert not all(torch.equal(mine["masters"], theirs["masters"])
                   for mine, theirs in zip(dropped, whole)), "the test does not see the state"


def test_trainer_under_accelerate_launch_with_install(tmp_path):
    ranks = _launch([str(BIN / "accelerate"), "launch", "--config_file",
                     f"{EXAMPLE}/accelerate.yaml"], tmp_path / "results",
                    f"{EXAMPLE}/train.py", "--install", "--steps", "3", "--save-steps", "100",
                    "--output-dir", str(tmp_path / "out"))
    _compressed_and_logged(ranks)


def test_the_callback_stops_a_trainer_whose_engine_bypassed_sdp4bit():
    # What the callback sees when the script ran without the prefix and without install():
    # DeepSpeed's own ZeRO optimizer (no sdp4bit state) for a config asking for compression.
    from types import SimpleNamespace

    from sdp4bit.errors import Sdp4bitError
    from sdp4bit.huggingface import Sdp4bitCallback

    def begin(section: dict | None, optimizer) -> None:
        config = {"zero_optimization": {"stage": 2}}
        if section is not None:
            config["sdp4bit"] = section
        args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=config))
        Sdp4bitCallback().on_train_begin(args, None, None, optimizer=optimizer)

    section = {"preset": "sdp4bit", "ranks_per_node": 1}
    bypassed = SimpleNamespace(optimizer=SimpleNamespace())  # Accelerate's wrapper, ZeRO's own
    with pytest.raises(Sdp4bitError, match="built the Trainer's engine without sdp4bit"):
        begin(section, bypassed)
    # Nothing to stop: sdp4bit attached, the baseline preset, a disabled or absent section.
    begin(section, SimpleNamespace(optimizer=SimpleNamespace(_sdp4bit=object())))
    begin({"preset": "baseline", "ranks_per_node": 1}, bypassed)
    begin({**section, "enabled": False}, bypassed)
    begin(None, bypassed)
