"""`python -m megatron_patch SCRIPT`: an unmodified Megatron-LM-style script gets the sdp4bit
flags and sdp4bit is enabled before it builds a model; what the arguments decide (the node
size, flags sdp4bit cannot run with) stops the job as they are parsed; the start-up line shows
once per job.

Megatron-LM's `megatron.training` is not installable from PyPI, so a stand-in with the same
seams is written to a temporary directory: `arguments.parse_args(extra_args_provider,
ignore_unknown_args)` building the parser (with the Megatron-LM flags the refusals read),
`initialize` importing `parse_args` by name (as in core_v0.16.1) and `global_vars.get_args()`;
the script parses its arguments twice, as pretrain_gpt.py does (ft_integration's
`parse_args(ignore_unknown_args=True)`, then `initialize_megatron`)."""

import os
import subprocess
import sys
import textwrap

import pytest

from sdp4bit.groups import NODE_SIZE_VARIABLES

#: sdp4bit's start-up line for megatron-core.
START_UP = "sdp4bit enabled for megatron-core's distributed optimizer"
#: What a launcher says about the rank and the node, none of it kept from the test's own
#: environment.
LAUNCHER_VARIABLES = (*NODE_SIZE_VARIABLES, "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                      "WORLD_SIZE")
#: The Megatron-LM flags of a run sdp4bit takes.
MEGATRON_FLAGS = ("--use-distributed-optimizer", "--bf16")

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
            for flag in ("--use-distributed-optimizer", "--bf16", "--fp16",
                         "--accumulate-allreduce-grads-in-fp32"):
                parser.add_argument(flag, action="store_true")
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            if ignore_unknown_args:
                args, _ = parser.parse_known_args()
            else:
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
        import os
        from megatron.training import arguments
        from megatron.training.initialize import initialize_megatron
        import megatron_patch.megatron_core as integration
        from megatron_patch.megatron_core.settings import current
        def own_args(parser):
            parser.add_argument("--own-flag", type=int, default=0)
            return parser
        arguments.parse_args(ignore_unknown_args=True)  # as ft_integration.setup() does
        args = initialize_megatron(extra_args_provider=own_args)
        print("own flag", args.own_flag, "micro batch", args.micro_batch_size)
        print("enabled", integration.is_enabled())
        if integration.is_enabled():
            s = current()
            print("config", s.config.describe())
            print("ranks per node", s.local_world_size, "iteration", s.iteration())
            print("replica check interval", s.replica_check_interval)
            if os.environ.get("ENABLE_AGAIN"):
                # sdp4bit enabled by the script itself (not by the launcher's parse_args),
                # with nothing to tell it the rank.
                print("--- enabled by the script ---", flush=True)
                integration.enable(s.config, local_world_size=s.local_world_size)
    """,
}


@pytest.fixture
def standin(tmp_path):
    for name, text in STANDIN.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def start(standin, *flags, launcher_env=None):
    """Starts the stand-in script through the launcher, with `launcher_env` as the only
    launcher variables (default: torchrun's for a single rank)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(launcher_env if launcher_env is not None else
               {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(standin),
                                                          os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "megatron_patch", str(standin / "pretrain_standin.py"), *flags]
    # From the temporary directory: `-m` puts the working directory first on sys.path.
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=standin)


def finish(process) -> subprocess.CompletedProcess:
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def launch(standin, *flags, launcher_env=None):
    return finish(start(standin, *flags, launcher_env=launcher_env))


def test_flags_reach_the_script_and_enable_sdp4bit(standin):
    done = launch(standin, *MEGATRON_FLAGS, "--sdp4bit", "--sdp4bit-grad-inter-bits", "8",
                  "--own-flag", "3",
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


def test_the_start_up_line_shows_once_per_job(standin):
    # Two ranks started by srun (the rank and the node size from SLURM, no torchrun
    # variables), the script parsing its arguments twice; then it enables sdp4bit itself,
    # as a script that does not go through the launcher would, before any process group
    # exists: that line too shows on the first rank alone (test_telemetry.py has the control,
    # a line shown where the launcher names no other rank).
    ranks = [start(standin, *MEGATRON_FLAGS, "--sdp4bit",
                   launcher_env={"SLURM_PROCID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
                                 "SLURM_TASKS_PER_NODE": "2", "ENABLE_AGAIN": "1"})
             for rank in range(2)]
    for rank, done in enumerate(finish(process) for process in ranks):
        assert done.returncode == 0, done.stderr
        assert "enabled True" in done.stdout and "ranks per node 2" in done.stdout
        by_the_launcher, by_the_script = done.stdout.split("--- enabled by the script ---")
        assert by_the_launcher.count(START_UP) == (1 if rank == 0 else 0), (rank, done.stdout)
        assert by_the_script.count(START_UP) == (1 if rank == 0 else 0), (rank, done.stdout)


def test_an_unknown_node_size_stops_the_job_as_its_arguments_are_parsed(standin):
    # Started with a rank but no launcher variable that says the node size (test_arguments.py
    # reads it from torchrun's, DeepSpeed's and SLURM's; the start-up test above runs under
    # SLURM's, the first test with the flag).
    done = launch(standin, *MEGATRON_FLAGS, "--sdp4bit", launcher_env={"RANK": "0"})
    assert done.returncode != 0
    assert "set --sdp4bit-ranks-per-node" in done.stderr
    assert "own flag" not in done.stdout


def test_megatron_flags_sdp4bit_cannot_run_with_stop_the_script(standin):
    done = launch(standin, "--bf16", "--sdp4bit")  # no --use-distributed-optimizer
    assert done.returncode != 0
    assert "pass --use-distributed-optimizer" in done.stderr
    assert "own flag" not in done.stdout  # stopped as the arguments were parsed


def test_the_scripts_checkout_provides_megatron_training_from_any_directory(standin, tmp_path):
    # As `python pretrain_gpt.py` does: the script's directory (the Megatron-LM checkout) goes
    # first on sys.path, so megatron.training is found without PYTHONPATH or its directory
    # as the working one; the stand-in's sitecustomize is not used here.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and k not in LAUNCHER_VARIABLES}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    command = [sys.executable, "-m", "megatron_patch", str(standin / "pretrain_standin.py"),
               *MEGATRON_FLAGS, "--sdp4bit"]
    done = subprocess.run(command, env={**env, "PYTHONWARNINGS": "ignore"}, cwd=elsewhere,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "enabled True" in done.stdout
    # A script outside any checkout: one line saying what to do.
    (elsewhere / "lonely.py").write_text("print('never')\n")
    done = subprocess.run([sys.executable, "-m", "megatron_patch", "lonely.py"], env=env,
                          cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "cannot import Megatron-LM's megatron.training" in done.stderr
