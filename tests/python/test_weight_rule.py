"""One rule for the integrations that free gathered weights, ZeRO stage 3 and FSDP2
(docs/configuration.md): the default preset's qWD weights run as qsdp there, its gradient codec
kept, with one line saying so; a weight codec the user names is kept, and qwd named is refused
naming weight_codec."""

import pytest
import torch

import sdp4bit.fsdp
from sdp4bit import Sdp4bitError
from sdp4bit.deepspeed import section

LINE = "its weights run with qsdp (8-bit) instead; set weight_codec"


def zero3(sdp4bit_section: dict, stage: int = 3):
    ds_config = {"zero_optimization": {"stage": stage},
                 "sdp4bit": {"ranks_per_node": 1, **sdp4bit_section}}
    settings = section.settings_from_config(ds_config)
    section.check_stage(settings, ds_config)
    return settings.config


def fsdp2(overrides: dict):
    config = sdp4bit.fsdp.preset_config("sdp4bit", overrides)
    if config.resolved.keeps_reference:
        sdp4bit.fsdp.enable(torch.nn.Linear(2, 2), config)  # refused before any collective
    return config


SIDES = {"ZeRO stage 3": lambda overrides: zero3({"preset": "sdp4bit", **overrides}),
         "FSDP2": fsdp2}


@pytest.mark.parametrize("side", SIDES)
def test_the_default_preset_runs_with_qsdp_weights_and_says_so(side, capsys):
    assert SIDES[side]({}).codecs() == ("qsdp", "tlq-hs")
    said = capsys.readouterr().out
    assert said.count(LINE) == 1 and side in said


@pytest.mark.parametrize("side", SIDES)
def test_a_named_weight_codec_is_kept_and_qwd_named_is_refused(side, capsys):
    assert SIDES[side]({"weight_codec": "qw"}).codecs() == ("qw", "tlq-hs")
    assert LINE not in capsys.readouterr().out
    with pytest.raises(Sdp4bitError, match="weight_codec"):
        SIDES[side]({"weight_codec": "qwd"})


def test_the_rule_is_only_for_freed_weights(capsys):
    # Control: ZeRO stage 2 keeps every weight, so the preset's qWD stays, with no line.
    assert zero3({"preset": "sdp4bit"}, stage=2).codecs() == ("qwd", "tlq-hs")
    assert LINE not in capsys.readouterr().out
