"""`python -m megatron_patch SCRIPT`: an unmodified Megatron-LM-style script gets the sdp4bit
flags and sdp4bit is enabled before it builds a model.

Megatron-LM's `megatron.training` is not installable from PyPI, so a stand-in with the same
seams is written to a temporary directory: `arguments.parse_args(extra_args_provider,
ignore_unknown_args)` building the parser, `initialize` importing `parse_args` by name (as in
core_v0.16.1) and `global_vars.get_args()`."""

import os
import subprocess
import sys
import textwrap

import pytest

STANDIN = {
    "sitecustomize.py": """
        import os, megatron
        megatron.__path__.append(os.path.join(os.path.dirname(__file__), "megatron"))
    """,
    "megatron/training/__init__.py": "",
    "megatron/training/global_vars.py": """
        _ARGS = None
        def get_args():
            return _ARGS
    """,
    "megatron/training/arguments.py": """
        import argparse
        from megatron.training import global_vars
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(allow_abbrev=False)
            parser.add_argument("--micro-batch-size", type=int, default=1)
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            args = parser.parse_args()
            args.iteration = 7
            global_vars._ARGS = args
            return args
    """,
    "megatron/training/initialize.py": """
        from megatron.training.arguments import parse_args
        def initialize_megatron(extra_args_provider=None):
            return parse_args(extra_args_provider)
    """,
    "pretrain_standin.py": """
        from megatron.training.initialize import initialize_megatron
        import megatron_patch.megatron_core as integration
        def own_args(parser):
            parser.add_argument("--own-flag", type=int, default=0)
            return parser
        args = initialize_megatron(extra_args_provider=own_args)
        print("own flag", args.own_flag, "micro batch", args.micro_batch_size)
        print("enabled", integration.is_enabled())
        if integration.is_enabled():
            s = integration._SETTINGS
            print("config", s.config.describe())
            print("ranks per node", s.local_world_size, "iteration", s.iteration())
            print("replica check interval", s.replica_check_interval)
    """,
}


@pytest.fixture
def standin(tmp_path):
    for name, text in STANDIN.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def launch(standin, *flags):
    env = {**os.environ, "PYTHONPATH": str(standin), "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "megatron_patch", str(standin / "pretrain_standin.py"), *flags]
    # From the temporary directory: `-m` puts the working directory first on sys.path, and
    # the repository's megatron_patch (no compiled extension) must not shadow the installed one.
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                          cwd=standin)


def test_flags_reach_the_script_and_enable_sdp4bit(standin):
    done = launch(standin, "--sdp4bit", "--sdp4bit-grad-inter-bits", "8", "--own-flag", "3",
                  "--micro-batch-size", "2", "--sdp4bit-ranks-per-node", "8",
                  "--sdp4bit-grad-quant-start-step", "100", "--sdp4bit-telemetry-interval", "100",
                  "--sdp4bit-exact-params", "none", "--sdp4bit-replica-check-interval", "50")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "own flag 3 micro batch 2" in out
    assert "enabled True" in out
    assert "inter_bits=8" in out and "weight=qwd" in out and "grad_start=100" in out
    assert "ranks per node 8 iteration 7" in out
    assert "exact=none" in out and "replica check interval 50" in out


def test_without_sdp4bit_flags_nothing_changes(standin):
    done = launch(standin, "--own-flag", "1")
    assert done.returncode == 0, done.stderr
    assert "enabled False" in done.stdout


def test_bad_flag_combination_stops_the_script(standin):
    done = launch(standin, "--sdp4bit-preset", "qsdp", "--sdp4bit-hadamard-block", "32")
    assert done.returncode != 0
    assert "hadamard_block" in done.stderr


def test_the_scripts_checkout_provides_megatron_training_from_any_directory(standin, tmp_path):
    # As `python pretrain_gpt.py` does: the script's directory (the Megatron-LM checkout) goes
    # first on sys.path, so megatron.training is found without PYTHONPATH or its directory
    # as the working one; the stand-in's sitecustomize is not used here.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, "-m", "megatron_patch", str(standin / "pretrain_standin.py"),
               "--sdp4bit"]
    done = subprocess.run(command, env={**env, "PYTHONWARNINGS": "ignore"}, cwd=elsewhere,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "enabled True" in done.stdout
    # A script outside any checkout: one line saying what to do.
    (elsewhere / "lonely.py").write_text("print('never')\n")
    done = subprocess.run([sys.executable, "-m", "megatron_patch", "lonely.py"], env=env,
                          cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "cannot import Megatron-LM's megatron.training" in done.stderr
