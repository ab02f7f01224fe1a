"""The Megatron-LM flags: parsing into configs, and bad combinations rejected clearly."""

import argparse

import pytest

import sdp4bit
from megatron_patch.arguments import add_arguments, config_from_args
from sdp4bit import Sdp4bitError


def parse(*flags):
    return config_from_args(add_arguments(argparse.ArgumentParser()).parse_args(list(flags)))


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
