"""The typed config: its fields are the Rust core's knobs, validated by the core."""

import dataclasses
import pickle

import op_calls
import pytest

import sdp4bit
from sdp4bit import Config, Sdp4bitError


def test_fields_are_the_cores_knobs_in_its_order():
    fields = [f.name for f in dataclasses.fields(Config)]
    assert fields == ["preset", *(k.name for k in sdp4bit.knobs())]
    schema = sdp4bit._native.schema()
    assert [k["name"] for k in schema["knobs"]] == fields[1:]
    for field, knob in zip(dataclasses.fields(Config)[1:], sdp4bit.knobs()):
        assert field.default is None
        assert field.metadata["doc"] == knob.doc and knob.doc
        assert knob.name in Config.__doc__ and knob.doc in Config.__doc__
    assert sdp4bit.presets() == tuple(schema["presets"])
    assert sdp4bit.limits() == sdp4bit.Limits(max_bucket_id=4095, max_rank=65535)


def test_a_preset_and_knobs_describe_the_cores_config():
    config = Config("sdp4bit", grad_inter_bits=8, seed=7)
    assert config.spec() == "sdp4bit;grad_inter_bits=8;seed=7"
    assert "inter_bits=8" in config.describe() and "seed=7" in config.describe()
    assert config.codecs() == ("qwd", "tlq-hs")
    assert config.compresses_weights and config.compresses_grads
    values = config.values()
    assert values["grad_inter_bits"] == "8" and values["hadamard_block"] == "32"
    assert values["global_qsgd_bits"] is None  # not used by TLq-HS
    assert repr(config) == "Config('sdp4bit', grad_inter_bits=8, seed=7)"
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.replace(seed=8).values()["seed"] == "8"
    assert Config("baseline").codecs() == ("none", "none")
    assert not Config("global-qsgd").compresses_weights


def test_the_core_resolves_a_config_once():
    config = Config("sdp4bit", seed=7)
    with op_calls.counted() as calls:
        for _ in range(3):
            assert config.resolved == sdp4bit.Resolved(
                weight_codec="qwd", grad_codec="tlq-hs", compresses_weights=True,
                compresses_grads=True, keeps_reference=True, grad_quant_start_step=0,
                exact_params="replicated", values=tuple(config.values().items()),
                canonical=config.describe(), fingerprint=config.fingerprint())
            assert config.validate().codecs() == ("qwd", "tlq-hs")
    assert calls == {"resolve_config": 1}
    assert Config("sdp4bit").fingerprint() == 0x28C5_7FAF_F446_FCA0  # pinned by tests/config.rs
    copy = pickle.loads(pickle.dumps(config))
    with op_calls.counted() as calls:
        assert copy.resolved == config.resolved and copy.replace(seed=7) == config
    op_calls.assert_none(calls, "for a config resolved before it was pickled")
    record = Config("zeropp", grad_quant_start_step=5, exact_params="none").resolved
    assert (record.keeps_reference, record.grad_quant_start_step, record.exact_params) == (
        False, 5, "none")
    assert not Config("baseline").resolved.compresses_grads


def test_codecs_come_first_whatever_the_keyword_order():
    # grad_codec resets the gradient knobs; grad_group_size applies after it.
    config = Config("sdp4bit", grad_group_size=256, grad_codec="tlq")
    assert config.spec() == "sdp4bit;grad_codec=tlq;grad_group_size=256"
    assert config.values()["grad_group_size"] == "256"


def test_from_knobs_takes_text_and_refuses_unknown_names():
    assert Config.from_knobs("qsdp", {"seed": "7", "weight_bits": "4"}) == \
        Config("qsdp", seed=7, weight_bits=4)
    assert Config.from_knobs("global-qsgd", {"global_qsgd_bits": 16}).values()[
        "global_qsgd_bits"] == "16"
    with pytest.raises(Sdp4bitError, match=r"unknown knob\(s\) \['weight_bitz'\]"):
        Config.from_knobs("sdp4bit", {"weight_bitz": 4})


@pytest.mark.parametrize("make, error, fragment", [
    (lambda: Config("sdp5bit").validate(), Sdp4bitError, "unknown preset 'sdp5bit'"),
    (lambda: Config(weight_bits=5).validate(), Sdp4bitError, "weight_bits=5"),
    (lambda: Config("qsdp", hadamard_block=32).validate(), Sdp4bitError, "hadamard_block"),
    (lambda: Config(weight_bits=True), TypeError, "weight_bits takes 4, 8"),
    (lambda: Config(seed=1.5), TypeError, "knob seed takes"),
    (lambda: Config(grad_codec="tlq;seed=1"), ValueError, "contains ';' or '='"),
    (lambda: Config(7), TypeError, "preset must be a name"),
])
def test_bad_configs_name_the_problem(make, error, fragment):
    with pytest.raises(error, match=fragment):
        make()
