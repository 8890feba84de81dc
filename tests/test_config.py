"""MoEConfig is frozen and strictly typed: every field class rejects look-alike values, naming the field."""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from moe_dispatch.config import MoEConfig

BASE = dict(hidden_size=32, num_experts=8, topk=2, ffn_hidden_size=16)
FIELDS = {f.name: f.type for f in dataclasses.fields(MoEConfig)}

BOOL_FIELDS = [n for n, t in FIELDS.items() if t == "bool"]
INT_FIELDS = [n for n, t in FIELDS.items() if t == "int"]
OPTIONAL_INT_FIELDS = [n for n, t in FIELDS.items() if t == "Optional[int]"]
FLOAT_FIELDS = [n for n, t in FIELDS.items() if t == "float"]
OPTIONAL_FLOAT_FIELDS = [n for n, t in FIELDS.items() if t == "Optional[float]"]
STR_FIELDS = [n for n, t in FIELDS.items() if t in ("str", "Optional[str]")]

# A valid non-default value per Optional field (with whatever other fields it needs), to show that
# the strict checks still accept real values.
VALID = {
    "num_groups": dict(num_groups=4),
    "group_topk": dict(num_groups=4, group_topk=2),
    "shared_expert_ffn_hidden_size": dict(shared_expert_ffn_hidden_size=8),
    "topk_scaling_factor": dict(topk_scaling_factor=2),
    "z_loss_coeff": dict(z_loss_coeff=1e-3),
    "capacity_factor": dict(capacity_factor=1),
    "ep_capacity_factor": dict(ep_capacity_factor=1.5),
}


def cfg(**kw):
    return MoEConfig(**{**BASE, **kw})


def test_every_field_has_a_type_class():
    classified = BOOL_FIELDS + INT_FIELDS + OPTIONAL_INT_FIELDS + FLOAT_FIELDS + OPTIONAL_FLOAT_FIELDS + STR_FIELDS
    assert sorted(classified + ["params_dtype"]) == sorted(FIELDS)
    assert BOOL_FIELDS == ["pre_softmax", "enable_expert_bias", "pad_to_capacity", "probs_in_experts",
                           "strict_call_order", "fp8_wgrad"]


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, np.bool_(True), torch.tensor(False)],
                         ids=["str-no", "str-False", "int0", "int1", "None", "numpy", "tensor"])
def test_bool_fields_take_only_bools(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a bool"):
        cfg(**{field: value})


def test_fp8_wgrad_needs_fp8():
    with pytest.raises(ValueError, match="fp8_wgrad=False .* needs fp8 set"):
        cfg(fp8_wgrad=False)
    assert cfg(fp8="e4m3", fp8_wgrad=False).fp8_wgrad is False
    assert cfg().fp8_wgrad is True and cfg(fp8="e4m3").fp8_wgrad is True


def test_bool_fields_take_bools():
    c = cfg(pre_softmax=True, probs_in_experts=True, capacity_factor=1.0, pad_to_capacity=True,
            score_function="sigmoid", enable_expert_bias=True)
    assert (c.pre_softmax, c.probs_in_experts, c.pad_to_capacity, c.enable_expert_bias) == (True,) * 4
    assert cfg(probs_in_experts=False).probs_in_experts is False


@pytest.mark.parametrize("field", INT_FIELDS + OPTIONAL_INT_FIELDS)
@pytest.mark.parametrize("value", [True, 2.0, "2", np.int64(2)], ids=["bool", "float", "str", "numpy"])
def test_int_fields_reject_bools_floats_and_strings(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{**VALID.get(field, {}), field: value})


@pytest.mark.parametrize("field", INT_FIELDS)
def test_required_int_fields_reject_none(field):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: None})


@pytest.mark.parametrize("field", OPTIONAL_INT_FIELDS + OPTIONAL_FLOAT_FIELDS)
def test_optional_fields_take_none_and_a_value(field):
    assert getattr(cfg(**{field: None}), field) is None
    if field == "num_groups":
        assert cfg(num_groups=None, group_topk=None).num_groups is None
    changes = VALID[field]
    assert getattr(cfg(**changes), field) == changes[field]


@pytest.mark.parametrize("field", FLOAT_FIELDS + OPTIONAL_FLOAT_FIELDS)
@pytest.mark.parametrize("value", [True, "1.0", float("inf")], ids=["bool", "str", "inf"])
def test_float_fields_reject_bools_strings_and_inf(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_float_fields_take_ints(field):
    assert getattr(cfg(**{field: 1}), field) == 1


@pytest.mark.parametrize("field", FLOAT_FIELDS + OPTIONAL_FLOAT_FIELDS)
def test_float_field_values_of_an_int_equal_the_float(field):
    """The EP ranks agree on field_values (repr text and the fingerprint): 1 and 1.0 are one
    setting, whichever a rank wrote (issue 29)."""
    from moe_dispatch.distributed.agreement import fingerprint
    extra = {"ep_capacity_factor": dict(ep_capacity_factor=2)}.get(field, {})
    a = cfg(**{**extra, field: 2})
    b = cfg(**{**{k: float(v) for k, v in extra.items()}, field: 2.0})
    assert repr(a.field_values()) == repr(b.field_values())
    assert fingerprint(a.dispatch_config()) == fingerprint(b.dispatch_config())


@pytest.mark.parametrize("field", STR_FIELDS)
@pytest.mark.parametrize("value", [1, True, b"fp32"], ids=["int", "bool", "bytes"])
def test_choice_fields_reject_non_strings(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


@pytest.mark.parametrize("seed", [-1, 2**63, True, 1.0])
def test_init_seed_range_and_type(seed):
    with pytest.raises(ValueError, match="init_seed"):
        cfg(init_seed=seed)


def test_init_seed_bounds_are_accepted_and_seed_a_generator():
    for seed in (0, 2**63 - 1):
        assert cfg(init_seed=seed).init_seed == seed
        assert torch.Generator().manual_seed(cfg(init_seed=seed).init_seed).initial_seed() == seed


def test_frozen():
    c = cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.topk = 99
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(c, "probs_in_experts", "no")
    with pytest.raises(dataclasses.FrozenInstanceError):
        del c.hidden_size
    assert (c.topk, c.probs_in_experts, c.hidden_size) == (2, False, 32)


def test_replace_revalidates_and_leaves_the_original():
    c = cfg()
    d = c.replace(topk=4, dispatcher="allgather")
    assert (d.topk, d.dispatcher, c.topk, c.dispatcher) == (4, "allgather", 2, "alltoall")
    assert dataclasses.replace(c, topk=4, dispatcher="allgather") == d
    with pytest.raises(ValueError, match="topk"):
        c.replace(topk=99)
    with pytest.raises(ValueError, match="probs_in_experts must be a bool"):
        c.replace(probs_in_experts="no")
    with pytest.raises(ValueError, match="hidden_size"):
        c.replace(hidden_size=32.0)
    with pytest.raises(ValueError, match="pad_to_capacity"):  # cross-field rules too
        c.replace(pad_to_capacity=True)
    with pytest.raises(ValueError, match="no field topkk"):
        c.replace(topkk=2)
    assert c == cfg()


def test_equal_configs_hash_alike_and_survive_pickling():
    # Spawned ranks receive the config pickled; a frozen config is also a valid dict key.
    c = cfg(router_dtype="fp64", params_dtype=torch.bfloat16)
    assert c == cfg(router_dtype="fp64", params_dtype=torch.bfloat16) and hash(c) == hash(cfg(router_dtype="fp64",
                                                                                        params_dtype=torch.bfloat16))
    assert pickle.loads(pickle.dumps(c)) == c


DISPATCH_SETTINGS = [
    {}, dict(dispatcher="allgather", router_dtype=None), dict(router_dtype="fp64", probs_in_experts=True),
    dict(capacity_factor=1.25, pad_to_capacity=True, pad_multiple=4), dict(capacity_factor=2, pad_multiple=8),
    dict(ep_capacity_factor=1.5, strict_call_order=True),
]


@pytest.mark.parametrize("settings", DISPATCH_SETTINGS, ids=str)
def test_dispatch_config_takes_the_validated_values_once(settings, monkeypatch):
    """A MoEConfig's dispatch_config() does not validate again, and needs not: what the MoEConfig
    accepted, DispatchConfig's own checks accept too (rebuilding it through them gives it back)."""
    from moe_dispatch.config import DispatchConfig
    config = cfg(**settings)

    def validate_again(self):
        raise AssertionError("DispatchConfig validated a MoEConfig's values a second time")

    with monkeypatch.context() as m:
        m.setattr(DispatchConfig, "__post_init__", validate_again)
        dc = config.dispatch_config()
        with pytest.raises(AssertionError, match="second time"):  # built directly, it does validate
            dc.replace()
    assert dc.replace() == dc and dc.kind == config.dispatcher and dc.sync_free == ("ep_capacity_factor" in settings)


def test_dispatch_config_checks_an_overriding_kind_and_direct_builds():
    from moe_dispatch.config import DispatchConfig
    assert cfg().dispatch_config("allgather").kind == "allgather"
    with pytest.raises(ValueError, match="dispatcher kind must be one of"):
        cfg().dispatch_config("ring")
    with pytest.raises(ValueError, match="topk=9 exceeds num_experts=8"):
        DispatchConfig(kind="alltoall", num_experts=8, topk=9, hidden_size=4)
    with pytest.raises(ValueError, match="capacity_factor must be None or a finite number > 0"):
        cfg().dispatch_config().replace(capacity_factor=float("nan"))
