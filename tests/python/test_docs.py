"""The docs stay true: every command they show is run by a test or by the test command, the
README's quick start is examples/quickstart.py and runs, and the knob table is the core's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sdp4bit

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "bench/README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_STARTS = ("bash ", "sudo ", "python ", "cargo ", "torchrun ", "pip ", ".cache/venv/bin/",
                  "apt ")


def shown_commands() -> dict[str, list[str]]:
    """Every shell command the docs show (lines of ```bash blocks, and inline code that starts
    like a command), with the files showing it; an environment assignment before a command
    counts as part of it."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        lines = []
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            lines += block.replace("\\\n", " ").splitlines()
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            command = re.sub(r"^([A-Z0-9_]+=\S+ )+", "", span)
            if command.startswith(COMMAND_STARTS):
                lines.append(span)
        for line in lines:
            command = " ".join(line.split("#")[0].split())
            if command:
                found.setdefault(command, []).append(str(doc.relative_to(ROOT)))
    return found


def _contains(path: str, *needles: str) -> bool:
    text = (ROOT / path).read_text()
    return all(needle in text for needle in needles)


def _bench_in_test_plan(arguments: str) -> bool:
    """Whether tests/python/test_plan.py runs `bash scripts/bench.sh` (its emulated-cluster
    helper) with these first arguments."""
    return _contains("tests/python/test_plan.py", '"scripts/bench.sh"), name, *args]',
                     f"tmp_path, {arguments}")


def _run(*argv: str) -> bool:
    done = subprocess.run(list(argv), cwd="/tmp", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return True


PLAN = [sys.executable, "-m", "sdp4bit.plan"]
TEST_SH = "scripts/test.sh"

#: How each command the docs show is exercised, checked when the test runs: a callable that
#: runs the command here (in a smoke form where noted) or checks that the test command or a
#: test runs it.
EXERCISED = {
    # prerequisites: what the test command needs is on this machine
    "apt install g++ git": lambda: shutil.which("g++") and shutil.which("git"),
    # the two commands
    "bash scripts/test.sh": lambda: _contains(".ci/run", "bash scripts/test.sh"),
    "bash scripts/main_job.sh": lambda: _contains("tests/python/test_main_job.py",
                                                  '"scripts/main_job.sh"'),
    # installing
    "pip install .": lambda: _contains(TEST_SH, "--force-reinstall ."),
    "SDP4BIT_NATIVE_DIR=DIR pip install .": lambda: _contains(
        TEST_SH, "SDP4BIT_NATIVE_DIR=$ROOT/.cache/native-bundle", "--force-reinstall ."),
    "python scripts/build_native.py --out DIR": lambda: _contains(
        TEST_SH, "python scripts/build_native.py --out .cache/native-bundle"),
    # the container path: one checkout into two environments, no build isolation, no deps
    "pip install --no-build-isolation --no-deps .": lambda: _contains(
        TEST_SH, "pip install --quiet --no-deps --no-build-isolation --force-reinstall ."),
    # the portable wheel: built by the test command, installed by its test without cargo
    "python scripts/build_wheel.py --out DIR": lambda: _contains(
        TEST_SH, "python scripts/build_wheel.py --out .cache/wheel"),
    "pip install DIR/sdp4bit-0.1.0-py3-none-manylinux_2_32_x86_64.whl ninja": lambda: _contains(
        "tests/python/test_wheel.py", '"-m", "pip", "install", "--quiet", "--no-index"'),
    # the sdist with vendored crates, installed offline by the test command
    "python -m build --sdist": lambda: _contains(TEST_SH, "python -m build --sdist"),
    "CARGO_NET_OFFLINE=true pip install --no-index --no-build-isolation --no-deps "
    "sdp4bit-0.1.0.tar.gz": lambda: _contains(
        TEST_SH, "CARGO_NET_OFFLINE=true CARGO_HOME=$OFFLINE_CARGO_HOME",
        "pip install --quiet --no-index --no-build-isolation --no-deps"),
    # the quick start, run here
    "torchrun --standalone --nproc-per-node 4 examples/quickstart.py": lambda: True,
    # the FSDP2 example, run by its test with a few steps
    # Hugging Face: the example under the launcher prefix and under accelerate launch
    "torchrun --nproc-per-node 2 -m sdp4bit.deepspeed examples/huggingface/train.py": lambda: (
        _contains("tests/python/test_huggingface.py", 'EXAMPLE = "examples/huggingface"',
                  '"--nproc-per-node", "2", "-m", "sdp4bit.deepspeed"',
                  'f"{EXAMPLE}/train.py", "--deepspeed"')),
    "accelerate launch --config_file examples/huggingface/accelerate.yaml": lambda: _contains(
        "tests/python/test_huggingface.py", '"launch", "--config_file"',
        'f"{EXAMPLE}/accelerate.yaml"', '"--install"'),
    "torchrun --standalone --nproc-per-node 4 examples/torchtitan/train.py --tp 2 --steps 4 "
    "--checkpoint-folder ckpt --checkpoint-interval 2": lambda: _contains(
        "tests/python/test_torchtitan.py", "examples/torchtitan/train.py", '"--tp", "2"',
        '"--checkpoint-interval", "2"'),
    "torchrun --standalone --nproc-per-node 4 examples/fsdp2/train.py": lambda: _contains(
        "tests/python/test_fsdp.py", '"examples/fsdp2/train.py"', '"--ranks-per-node", "2"'),
    # Megatron-LM: the launcher with these flags, against a stand-in of megatron.training
    "python -m megatron_patch": lambda: _contains("tests/python/test_launcher.py",
                                                  '"-m", "megatron_patch"'),
    "torchrun --nproc-per-node 8 --nnodes 16 ... -m megatron_patch pretrain_gpt.py": lambda: (
        _contains("tests/python/test_launcher.py", '"-m", "megatron_patch"', '"--sdp4bit"',
                  '"--sdp4bit-grad-quant-start-step"', '"--sdp4bit-telemetry-interval"')),
    # benchmarks: smoke runs in the test command (the GPU one skips without a GPU), the
    # cluster in test_plan.py where network namespaces can be made
    "bash scripts/bench.sh NAME [ARGS]": lambda: _contains(TEST_SH, "bash scripts/bench.sh"),
    "bash scripts/bench.sh cpu": lambda: _contains(TEST_SH, "bash scripts/bench.sh cpu"),
    "cargo bench --bench cpu": lambda: (_contains(TEST_SH, "bash scripts/bench.sh cpu")
                                        and _contains("scripts/bench.sh", "cargo bench")),
    "bash scripts/bench.sh gpu": lambda: _contains(TEST_SH, "bash scripts/bench.sh gpu"),
    "bash scripts/bench.sh kernels": lambda: _contains(TEST_SH, "bash scripts/bench.sh kernels"),
    "SDP4BIT_REQUIRE_GPU=1 cargo bench --bench gpu": lambda: (
        _contains(TEST_SH, "bash scripts/bench.sh gpu")
        and _contains("bench/gpu.rs", "SDP4BIT_REQUIRE_GPU")),
    "bash scripts/bench.sh convergence --out bench/results": lambda: _contains(
        TEST_SH, "bash scripts/bench.sh convergence --steps 3 --seeds 1,2"),
    "bash scripts/bench.sh convergence_long --runs-dir .cache/convergence-long-runs --out "
    "bench/results/long": lambda: _contains(TEST_SH, "bash scripts/bench.sh convergence_long "
                                                     "--steps 3 --seeds 1,2"),
    "bash scripts/bench.sh convergence_reproduce --kept bench/results/long/convergence_long.json "
    "--pairs baseline,SDP4Bit --steps 15": lambda: _contains(
        TEST_SH, "bash scripts/bench.sh convergence_reproduce --kept "
                 "bench/results/long/convergence_long.json \\\n"
                 "  --pairs baseline,SDP4Bit --steps 15"),
    "bash scripts/bench.sh convergence_reproduce --steps 15": lambda: _contains(
        TEST_SH, "bash scripts/bench.sh convergence_reproduce --steps 15"),
    "python bench/codec_digest.py": lambda: _run(sys.executable,
                                                str(ROOT / "bench/codec_digest.py")),
    "SDP4BIT_TEST_OPS=1 bash scripts/bench.sh hadamard_real --out bench/results": lambda: _contains(
        TEST_SH, "bash scripts/bench.sh hadamard_real --out .cache/hadamard-smoke"),
    "sudo bash scripts/bench.sh cluster --topologies 2x2,4x1 --rates-mbit 1000,10000": lambda: (
        _bench_in_test_plan('"cluster", "--topologies"')),
    "python bench/cluster.py --rescore bench/results/cluster.json": lambda: _contains(
        "tests/python/test_plan.py", '"--rescore"'),
    "sudo bash scripts/bench.sh cluster_phases": lambda: (
        _bench_in_test_plan('"cluster_phases"')),
    "sudo bash scripts/bench.sh cluster_hybrid": lambda: (
        _bench_in_test_plan('"cluster_hybrid"')),
    "sudo bash scripts/bench.sh cluster_cpu": lambda: (
        _bench_in_test_plan('"cluster_cpu"')),
    # the cost model, run here
    "python -m sdp4bit.plan": lambda: _run(*PLAN, "--help"),
    "python -m sdp4bit.plan --paper": lambda: _run(*PLAN, "--paper"),
    "python -m sdp4bit.plan --paper --tokens-per-gpu 8192": lambda: _run(
        *PLAN, "--paper", "--tokens-per-gpu", "8192"),
    "python -m sdp4bit.plan --params 6.7e9 --nodes 16 --gpus-per-node 8 --tp 4 --inter-gbps 400":
        lambda: _run(*PLAN, "--params", "6.7e9", "--nodes", "16", "--gpus-per-node", "8",
                     "--tp", "4", "--inter-gbps", "400"),
    "python -m sdp4bit.plan --params 18e9 --nodes 16 --gpus-per-node 8 --instances 4":
        lambda: _run(*PLAN, "--params", "18e9", "--nodes", "16", "--gpus-per-node", "8",
                     "--instances", "4", "--inter-gbps", "400"),
    "python bench/calibrate_plan.py": lambda: _run(
        sys.executable, str(ROOT / "bench/calibrate_plan.py"), "--out", tempfile.mkdtemp()),
    # the GPU kit: prepared by the test command, its dry run and the cost script by a test
    "bash scripts/gpu_kit.sh prepare": lambda: _contains(TEST_SH,
                                                         "bash scripts/gpu_kit.sh prepare"),
    "bash scripts/gpu_kit.sh run --out DIR": lambda: _contains(
        "tests/python/test_gpu_kit.py", '"scripts/gpu_kit.sh", "run", "--out"'),
    "python bench/gpu_cost.py": lambda: _contains(
        "tests/python/test_gpu_kit.py", 'str(ROOT / "bench/gpu_cost.py"), "--out"'),
    "python -m sdp4bit.deepspeed": lambda: _contains("tests/python/test_deepspeed.py",
                                                     '"-m", "sdp4bit.deepspeed"'),
    "python -m sdp4bit.selftest": lambda: _contains("tests/python/test_selftest.py",
                                                   '"-m", "sdp4bit.selftest"'),
    # running parts of the tests: the test command runs all of them
    "cargo test": lambda: _contains(TEST_SH, "cargo test --locked --release"),
    "cargo test --release": lambda: _contains(TEST_SH, "cargo test --locked --release"),
    "cargo test --release --test cuda_emulated": lambda: _contains(
        TEST_SH, "cargo test --locked --release\n"),
    "cargo test --release --test cuda_driver_emulation": lambda: _contains(
        TEST_SH, "cargo test --locked --release\n"),
    "cargo test --release --test cuda_gpu --no-run": lambda: _contains(
        TEST_SH, "cargo test --locked --release\n"),
    ".cache/venv/bin/pytest -q tests/python": lambda: _contains(
        TEST_SH, "pytest -q -rs --durations=15 tests/python"),
}


def _entry(command: str) -> str | None:
    """The registry entry a shown command falls under: the longest one it starts with (extra
    arguments and placeholders such as '[...]' follow)."""
    tokens = command.split()
    matches = [key for key in EXERCISED if tokens[:len(key.split())] == key.split()]
    return max(matches, key=len, default=None)


def test_every_command_the_docs_show_is_exercised():
    shown = shown_commands()
    assert "bash scripts/main_job.sh" in shown and "bash scripts/test.sh" in shown
    unknown = {c: where for c, where in shown.items() if _entry(c) is None}
    assert not unknown, f"commands shown but not known to be exercised: {unknown}"
    for key in sorted({_entry(c) for c in shown}):
        assert EXERCISED[key](), f"not exercised: {key}"
    stale = set(EXERCISED) - {_entry(c) for c in shown}
    assert not stale, f"registry entries no doc shows: {stale}"


def test_the_quick_start_is_the_example_and_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```python\n(.*?)```", readme, re.S).group(1)
    example = (ROOT / "examples/quickstart.py").read_text()
    assert example.endswith(block), "the README's quick start differs from examples/quickstart.py"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(ROOT / "examples/quickstart.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    error = float(re.search(r"relative error ([0-9.]+)", done.stdout).group(1))
    assert error < 0.5 and "replicas identical: True" in done.stdout, done.stdout
    ratio = float(re.search(r"\(([0-9.]+)x less\)", done.stdout).group(1))
    assert ratio > 4, done.stdout


def test_the_knob_table_is_the_cores():
    text = (ROOT / "docs/configuration.md").read_text()
    knob_section = text[text.index("## Knobs"):]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|$", knob_section, re.M)
    assert [(name, accepts.strip(), doc.strip()) for name, accepts, doc in rows] == [
        (k.name, k.accepted(), k.doc) for k in sdp4bit.knobs()]
    for preset in sdp4bit.presets():
        assert f"| `{preset}` |" in text
    limits = sdp4bit.limits()
    assert f"0 to {limits.max_bucket_id}" in text and f"0 to {limits.max_rank}" in text


@pytest.mark.parametrize("doc", [d.relative_to(ROOT) for d in DOCS], ids=str)
def test_links_between_docs_resolve(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{doc}: broken link {target}"


def test_the_readmes_convergence_figure_is_the_studys():
    summary = json.loads((ROOT / "bench/results/convergence.json").read_text())["summary"]
    row = summary["SDP4Bit"]
    relative = row["relative_difference"]
    figure = f"{100 * relative['mean']:+.2f}% ± {100 * relative['half_width']:.2f}% (95%)"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{row['seeds']} seeds" in readme and figure.lstrip("+") in readme, figure
