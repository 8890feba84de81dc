"""Expert identity in the state dict, single process: expert_ids travel with the weights, a
state dict of other experts is a ValueError naming the ids, a full one loads by id."""
from __future__ import annotations

import pytest
import torch

from moe_dispatch.experts import GroupedMLP, SequentialMLP
from tests.experts.reference import make_config


@pytest.mark.parametrize("cls", [GroupedMLP, SequentialMLP])
def test_state_dict_carries_ids_and_loads_by_id(cls):
    cfg = make_config("gelu", num_experts=8)
    full = cls(cfg, 8).state_dict()
    assert full["expert_ids"].tolist() == list(range(8)) and full["expert_ids"].dtype == torch.int64
    part = cls(make_config("gelu", seed=5, num_experts=8), 4, local_expert_offset=4)
    part.load_state_dict(full)  # takes experts 4..7 by id
    assert torch.equal(part.weight1, full["weight1"][4:]) and torch.equal(part.weight2, full["weight2"][4:])
    again = cls(cfg, 4, local_expert_offset=4)
    again.load_state_dict(part.state_dict())
    assert torch.equal(again.weight1, part.weight1)


def test_other_experts_are_a_value_error():
    cfg = make_config("gelu", num_experts=8)
    rank0 = GroupedMLP(cfg, 4).state_dict()
    rank1 = GroupedMLP(cfg, 4, local_expert_offset=4)
    before = rank1.weight1.clone()
    with pytest.raises(ValueError, match=r"expert_ids.*\[0, 1, 2, 3\].*\[4, 5, 6, 7\]"):
        rank1.load_state_dict(rank0)
    assert torch.equal(rank1.weight1, before)


def test_missing_ids_strict_and_not():
    cfg = make_config("gelu")
    src = GroupedMLP(cfg, 4).state_dict()
    del src["expert_ids"]
    dst = GroupedMLP(make_config("gelu", seed=3), 4)
    with pytest.raises(RuntimeError, match="expert_ids"):
        dst.load_state_dict(src)
    result = dst.load_state_dict(src, strict=False)
    assert result.missing_keys == ["expert_ids"] and torch.equal(dst.weight1, src["weight1"])


def test_distributed_state_dict_api_round_trip():
    """torch.distributed.checkpoint.state_dict resolves every state-dict key (expert_ids too) to
    an attribute; its get/set round trip loads the experts by id."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    cfg = make_config("gelu", num_experts=8)
    src = GroupedMLP(cfg, 4, local_expert_offset=4)
    state = get_model_state_dict(src)
    assert state["expert_ids"].tolist() == [4, 5, 6, 7] and torch.equal(src.expert_ids, state["expert_ids"])
    dst = GroupedMLP(make_config("gelu", seed=5, num_experts=8), 4, local_expert_offset=4)
    set_model_state_dict(dst, state)
    assert torch.equal(dst.weight1, src.weight1) and torch.equal(dst.weight2, src.weight2)
