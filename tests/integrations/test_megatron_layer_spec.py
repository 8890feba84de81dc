"""``deterministic_layer_spec``: the ``--spec`` of Megatron-LM's own pretrain_gpt.py (core_v0.19.0
and HEAD). Megatron-LM's training package is absent from the megatron-core wheel (and HEAD's needs
Python 3.12), so where it does not import, a STAND-IN ``megatron.training.models.gpt`` carries
HEAD's MoE branch of ``default_layer_spec`` (megatron_layer_spec_worker.py). The GPU run of the real
script is scripts/megatron/pretrain_routes.sh."""
from __future__ import annotations

import inspect

import pytest

pytest.importorskip("megatron.core")

from tests.dispatcher.harness import run_ranks  # noqa: E402

from .megatron_layer_spec_worker import (  # noqa: E402
    LAYER_FREQ,
    build_worker,
    gpt_model_config,
    real_default_layer_spec_imports,
)


def test_resolves_as_pretrain_gpt_resolves_spec():
    """``--spec moe_dispatch.integrations.megatron deterministic_layer_spec``: Megatron's import_module
    reads vars(module)[name], so the function is a real attribute of the package, and Megatron-LM
    passes vp_stage by keyword when the callable's signature names it."""
    from megatron.core.transformer.spec_utils import import_module

    from moe_dispatch.integrations.megatron import deterministic_layer_spec, deterministic_layer_spec_fp8

    for name, fn in (("deterministic_layer_spec", deterministic_layer_spec),
                     ("deterministic_layer_spec_fp8", deterministic_layer_spec_fp8)):
        assert import_module(("moe_dispatch.integrations.megatron", name)) is fn
        assert "vp_stage" in inspect.signature(fn).parameters


@pytest.mark.skipif(real_default_layer_spec_imports(), reason="Megatron-LM's training package is here")
def test_without_megatron_lm_names_version_and_gpt_builders_edit():
    from megatron.core import package_info

    from moe_dispatch.integrations.megatron import deterministic_layer_spec

    with pytest.raises(ImportError) as info:
        deterministic_layer_spec(gpt_model_config(), vp_stage=None)
    message = str(info.value)
    assert f"megatron-core {package_info.__version__} is installed" in message, message
    assert "megatron.training.models.gpt.default_layer_spec" in message
    assert "gpt_builders.gpt_builder" in message and "deterministic_moe_spec(transformer_layer_spec)" in message


@pytest.fixture(scope="module")
def built():
    return run_ranks(build_worker, 1, timeout=180)[0]


def test_mixed_dense_and_moe_layers(built):
    """--moe-layer-freq [0, 1, 0, 1]: in the spec, the MoE layers' MLPs become DeterministicMoELayer
    (with our FP8 for deterministic_layer_spec_fp8), the dense layers keep Megatron's MLP; Megatron's
    own default_layer_spec, called after ours, is untouched (ours changes a copy)."""
    moe = ["dense" if f == 0 else "DeterministicMoELayer" for f in LAYER_FREQ]
    assert built["spec_mlps"] == {"ours": moe, "ours_fp8": moe,
                                  "stock": ["dense" if f == 0 else "MoELayer" for f in LAYER_FREQ]}, built
    assert built["spec_options"] == {"ours": [(None, True)] * 2, "ours_fp8": [("e4m3", True)] * 2}, built


def test_gpt_model_from_the_spec_trains_our_layers(built):
    """A GPTModel built from the spec resolved as --spec resolves it, on one CPU rank: the MoE layers
    are ours, installed at construction, the dense ones Megatron's MLP; a step reaches every MLP."""
    result = built
    assert result["mlps"] == ["MLP" if f == 0 else "DeterministicMoELayer" for f in LAYER_FREQ], result
    assert result["installed"] == [bool(f) for f in LAYER_FREQ], result
    assert result["all_grads"] and result["loss"] > 0, result
