"""What sdp4bit's process groups take from the launcher and the job: ranks per node and rank 0
as launchers say them, and the job's timeout (sdp4bit.groups)."""

import datetime

import pytest
import torch.distributed as dist

from sdp4bit.groups import NODE_SIZE_VARIABLES, ProcessGroups, is_first_rank, node_size, timeout_of

FLAG = "--sdp4bit-ranks-per-node"


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*NODE_SIZE_VARIABLES, "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name, value, expected", [
    ("LOCAL_WORLD_SIZE", "8", 8),           # torchrun
    ("LOCAL_SIZE", "4", 4),                 # DeepSpeed's launcher
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 2),  # mpirun
    ("SLURM_NTASKS_PER_NODE", "8", 8),      # srun --ntasks-per-node
    ("SLURM_TASKS_PER_NODE", "4(x16)", 4),  # srun, equal nodes
])
def test_each_launcher_variable_gives_the_node_size(clean_env, name, value, expected):
    clean_env.setenv(name, value)
    assert node_size(None, FLAG) == expected


def test_the_setting_wins_and_the_order_is_torchrun_first(clean_env):
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_SIZE", "4")
    assert node_size(None, FLAG) == 2
    assert node_size(8, FLAG) == 8


@pytest.mark.parametrize("env, problem", [
    ({}, "no launcher variable"),
    ({"SLURM_TASKS_PER_NODE": "4,2"}, "does not give one positive number"),  # unequal nodes
    ({"LOCAL_SIZE": "zero"}, "does not give one positive number"),
])
def test_an_unknown_node_size_names_the_integrations_setting(clean_env, env, problem):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=problem) as error:
        node_size(None, FLAG)
    assert FLAG in str(error.value)
    with pytest.raises(ValueError, match=FLAG):
        node_size(0, FLAG)


def test_rank_zero_before_the_process_group_exists(clean_env):
    assert is_first_rank()  # no launcher: a single process
    clean_env.setenv("RANK", "3")
    assert not is_first_rank()
    clean_env.setenv("RANK", "0")
    assert is_first_rank()
    clean_env.delenv("RANK")
    clean_env.setenv("SLURM_PROCID", "1")
    assert not is_first_rank()


def test_sdp4bits_groups_take_the_jobs_timeout(tmp_path):
    """Its groups fail a dead peer when the framework's do (torch's own default for a new
    group is 30 minutes with gloo, 10 with NCCL, whatever init_process_group said)."""
    job = datetime.timedelta(seconds=7)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=job)
    try:
        assert timeout_of(dist.new_group([0])) == datetime.timedelta(minutes=30)  # control
        groups = ProcessGroups.create(local_world_size=1)
        assert groups.timeout == job
        assert timeout_of(groups.world) == job
        groups.close()
    finally:
        dist.destroy_process_group()
