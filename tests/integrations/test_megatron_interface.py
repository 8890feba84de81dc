"""Our dispatchers, behind MegatronTokenDispatcher, offer everything megatron-core's
MoETokenDispatcher base class offers, in the installed release (CI runs this under 0.16.1, 0.17.0,
0.18.0 and 0.19.2): every method, and every attribute its __init__ sets. A release that grows the
interface fails here first."""
from __future__ import annotations

import inspect
import re

import pytest

pytest.importorskip("megatron.core")

from moe_dispatch import MoEConfig  # noqa: E402
from moe_dispatch.dispatcher import AllGatherDispatcher, AllToAllDispatcher  # noqa: E402
from moe_dispatch.integrations.megatron import MegatronTokenDispatcher  # noqa: E402

CONFIG = MoEConfig(hidden_size=8, num_experts=4, topk=2, ffn_hidden_size=8)

# Attributes of Megatron's base that ours deliberately lacks or gives another meaning, and why.
NOT_OURS = {
    "config": "ours holds its MoEConfig; Megatron's TransformerConfig stays on the layer",
    "tp_group": "the expert tensor-parallel group: expert TP must be 1 (install() rejects more)",
    "tp_ep_group": "the expert TP x EP group: with expert TP 1 it is ep_group",
}


def _megatron_base():
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    return MoETokenDispatcher


def test_every_method_of_megatrons_base():
    base = _megatron_base()
    methods = [n for n, v in vars(base).items() if callable(v) and not n.startswith("_")]
    assert {"dispatch_preprocess", "token_dispatch", "combine_postprocess"} <= set(methods)
    for cls in (AllGatherDispatcher, AllToAllDispatcher):
        dispatcher = MegatronTokenDispatcher(cls(CONFIG))
        missing = [n for n in methods if not callable(getattr(dispatcher, n, None))]
        assert not missing, (cls.__name__, missing)


def test_every_attribute_of_megatrons_base():
    source = inspect.getsource(_megatron_base().__init__)
    names = set(re.findall(r"self\.([A-Za-z_]\w*)\s*(?::[^=]+)?=", source))
    assert "ep_size" in names, names  # ep_rank and use_nccl_stream arrived in later releases
    dispatcher = MegatronTokenDispatcher(AllToAllDispatcher(CONFIG))
    missing = [n for n in sorted(names - set(NOT_OURS)) if not hasattr(dispatcher, n)]
    assert not missing, missing
    assert (dispatcher.ep_size, dispatcher.ep_rank, dispatcher.use_nccl_stream) == (1, 0, False)
    assert dispatcher.get_expert_zero_copy_buffers() == (None, None)
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        dispatcher.set_shared_experts(object())
