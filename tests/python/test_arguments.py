"""The Megatron-LM flags: parsing into configs, and bad combinations rejected clearly, as the
arguments are parsed: contradictory sdp4bit flags, Megatron-LM flags sdp4bit cannot run with,
an unknown node size."""

import argparse

import pytest

import sdp4bit
from megatron_patch.arguments import add_arguments, config_from_args, ranks_per_node
from sdp4bit import Sdp4bitError
from sdp4bit.groups import NODE_SIZE_VARIABLES

FLAG = "--sdp4bit-ranks-per-node"


@pytest.fixture(autouse=True)
def launched_by_torchrun(monkeypatch):
    """Every launcher variable cleared, then torchrun's node size (2 ranks a node)."""
    for name in NODE_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    return monkeypatch


def parse(*flags):
    return config_from_args(add_arguments(argparse.ArgumentParser()).parse_args(list(flags)))


def megatron_parser() -> argparse.ArgumentParser:
    """The Megatron-LM flags the parse-time refusals read, as Megatron-LM defines them, with
    the sdp4bit flags."""
    parser = argparse.ArgumentParser()
    for flag in ("--use-distributed-optimizer", "--bf16", "--fp16",
                 "--accumulate-allreduce-grads-in-fp32", "--fp8-param-gather",
                 "--use-torch-fsdp2", "--use-megatron-fsdp",
                 "--reuse-grad-buf-for-mxfp8-param-ag"):
        parser.add_argument(flag, action="store_true")
    return add_arguments(parser)


def parse_megatron(*flags):
    return config_from_args(megatron_parser().parse_args(list(flags)))


def test_off_unless_asked():
    assert parse() is None


@pytest.mark.parametrize("flags, fragments", [
    (["--sdp4bit"], ["weight=qwd(bits=4", "grad=tlq-hs(intra_bits=8,inter_bits=4"]),
    (["--sdp4bit-preset", "qsdp"], ["weight=qsdp(bits=8", "grad=qsdp(bits=8"]),
    (["--sdp4bit-preset", "global-qsgd"], ["weight=none", "grad=global-qsgd(bits=auto"]),
    (["--sdp4bit-preset", "zeropp"], ["weight=zeropp", "grad=zeropp"]),
    (["--sdp4bit-preset", "baseline"], ["weight=none", "grad=none"]),
    # The paper's ablations.
    (["--sdp4bit", "--sdp4bit-weight-codec", "qw", "--sdp4bit-grad-codec", "none"],
     ["weight=qw(bits=4", "grad=none"]),
    (["--sdp4bit", "--sdp4bit-grad-codec", "tlq", "--sdp4bit-weight-codec", "none"],
     ["weight=none", "grad=tlq(", "hadamard=0"]),
    (["--sdp4bit", "--sdp4bit-grad-codec", "tlq-hs"], ["grad=tlq-hs(", "hadamard=32"]),
    (["--sdp4bit", "--sdp4bit-seed", "7", "--sdp4bit-grad-quant-start-step", "100",
      "--sdp4bit-hadamard-block", "64", "--sdp4bit-pipeline-chunks", "2"],
     ["seed=7", "grad_start=100", "hadamard=64", "chunks=2"]),
    (["--sdp4bit", "--sdp4bit-grad-quant-start-step", "100"], ["grad_start=100"]),
])
def test_flags_make_the_config(flags, fragments):
    text = parse(*flags).describe()
    for fragment in fragments:
        assert fragment in text, (fragment, text)


@pytest.mark.parametrize("flags, error, fragment", [
    (["--sdp4bit", "--sdp4bit-preset", "qsdp"], ValueError, "contradicts --sdp4bit-preset qsdp"),
    (["--sdp4bit-weight-bits", "4"], ValueError, "--sdp4bit-weight-bits given without --sdp4bit"),
    (["--sdp4bit", "--sdp4bit-weight-bits", "5"], Sdp4bitError, "weight_bits=5"),
    (["--sdp4bit-preset", "qsdp", "--sdp4bit-hadamard-block", "32"], Sdp4bitError,
     "hadamard_block"),
    (["--sdp4bit", "--sdp4bit-grad-group-size", "100"], Sdp4bitError, "grad_group_size=100"),
    (["--sdp4bit", "--sdp4bit-grad-codec", "tlq-xs"], Sdp4bitError, "unknown gradient codec"),
    (["--sdp4bit-preset", "baseline", "--sdp4bit-weight-rounding", "nearest"], Sdp4bitError,
     "weight_rounding"),
])
def test_bad_combinations_are_rejected(flags, error, fragment):
    with pytest.raises(error, match=fragment):
        parse(*flags)


def test_unknown_preset_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse("--sdp4bit-preset", "sdp5bit")
    assert "invalid choice: 'sdp5bit'" in capsys.readouterr().err


def test_every_knob_of_the_core_has_its_flag():
    parser = add_arguments(argparse.ArgumentParser())
    flags = {flag: action for action in parser._actions for flag in action.option_strings}
    for knob in sdp4bit.knobs():
        action = flags[f"--sdp4bit-{knob.name.replace('_', '-')}"]
        assert action.dest == f"sdp4bit_{knob.name}"
        assert knob.doc in action.help


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_WORLD_SIZE": "8"}, 8),                                    # torchrun
    ({"LOCAL_SIZE": "4"}, 4),                                          # DeepSpeed's launcher
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)"}, 4),  # srun
    ({"SLURM_TASKS_PER_NODE": "2(x3)"}, 2),                            # srun, no --ntasks-per-node
])
def test_the_node_size_comes_from_the_launcher(launched_by_torchrun, env, expected):
    launched_by_torchrun.delenv("LOCAL_WORLD_SIZE")
    for name, value in env.items():
        launched_by_torchrun.setenv(name, value)
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--sdp4bit"])
    assert config_from_args(args) is not None
    assert ranks_per_node(args) == expected
    flagged = add_arguments(argparse.ArgumentParser()).parse_args(["--sdp4bit", FLAG, "16"])
    assert ranks_per_node(flagged) == 16  # the flag wins


@pytest.mark.parametrize("env, problem", [
    ({}, "no launcher variable"),
    ({"SLURM_TASKS_PER_NODE": "4,2"}, "does not give one positive number"),  # unequal nodes
])
def test_an_unknown_node_size_stops_the_parse_naming_the_flag(launched_by_torchrun, env,
                                                              problem):
    launched_by_torchrun.delenv("LOCAL_WORLD_SIZE")
    for name, value in env.items():
        launched_by_torchrun.setenv(name, value)
    with pytest.raises(ValueError, match=problem) as error:
        parse("--sdp4bit")
    assert FLAG in str(error.value)
    # The flag settles it; a run without sdp4bit is not asked.
    assert parse("--sdp4bit", FLAG, "4") is not None
    assert parse() is None
    with pytest.raises(ValueError, match=f"{FLAG} must be a positive rank count"):
        parse("--sdp4bit", FLAG, "0")


@pytest.mark.parametrize("flags, named", [
    ([], "--use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--bf16", "--use-torch-fsdp2"], "--use-torch-fsdp2"),
    (["--use-distributed-optimizer", "--bf16", "--use-megatron-fsdp"], "--use-megatron-fsdp"),
    (["--use-distributed-optimizer", "--bf16", "--fp8-param-gather"], "--fp8-param-gather"),
    (["--use-distributed-optimizer", "--bf16", "--reuse-grad-buf-for-mxfp8-param-ag"],
     "--reuse-grad-buf-for-mxfp8-param-ag"),
    # Gradients only (weight=none): the fp16 gradient buffers are what is refused.
    (["--use-distributed-optimizer", "--fp16", "--sdp4bit-preset", "global-qsgd"],
     "--fp16 without --accumulate-allreduce-grads-in-fp32"),
    (["--use-distributed-optimizer", "--fp16", "--accumulate-allreduce-grads-in-fp32"],
     "these are fp16: train with --bf16"),
    (["--use-distributed-optimizer"], "these are fp32: train with --bf16"),
])
def test_megatron_flags_sdp4bit_cannot_run_with_stop_the_parse(flags, named):
    sdp4bit_flags = [] if "--sdp4bit-preset" in flags else ["--sdp4bit"]
    with pytest.raises(Sdp4bitError, match="cannot run with these Megatron-LM flags") as error:
        parse_megatron(*sdp4bit_flags, *flags)
    assert named in str(error.value)
    # Control: the same Megatron-LM flags without sdp4bit are Megatron's business.
    assert parse_megatron(*[f for f in flags if f.startswith("--") and "sdp4bit" not in f]) is None


@pytest.mark.parametrize("flags", [
    ["--use-distributed-optimizer", "--bf16"],
    # Gradients in fp32 buffers, weights left to Megatron: nothing to refuse.
    ["--use-distributed-optimizer", "--fp16", "--accumulate-allreduce-grads-in-fp32",
     "--sdp4bit-preset", "global-qsgd"],
])
def test_megatron_flags_sdp4bit_runs_with_pass_the_parse(flags):
    sdp4bit_flags = [] if "--sdp4bit-preset" in flags else ["--sdp4bit"]
    assert parse_megatron(*sdp4bit_flags, *flags) is not None


def test_every_refusal_is_named_at_once():
    with pytest.raises(Sdp4bitError) as error:
        parse_megatron("--sdp4bit", "--use-torch-fsdp2", "--fp8-param-gather")
    for flag in ("--use-distributed-optimizer", "--use-torch-fsdp2", "--fp8-param-gather",
                 "--bf16"):
        assert flag in str(error.value), flag


def test_a_parser_without_megatrons_flags_decides_no_refusal():
    # A script with a parser of its own: what its namespace lacks is left to the refusals
    # megatron-core's integration makes when the model is built.
    assert parse("--sdp4bit") is not None
