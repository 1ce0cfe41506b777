"""Upstream's hybrid-model names import here; building a hybrid model raises NotImplementedError naming the feature."""
import pytest

from megatron.core.models.hybrid import HybridModel
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


def test_hybrid_model_refuses_with_the_feature_named():
    with pytest.raises(NotImplementedError, match=r"^HybridModel: hybrid models \(Mamba / attention / MLP"):
        HybridModel(config=None, hybrid_stack_spec=hybrid_stack_spec, vocab_size=128, max_sequence_length=4)


def test_hybrid_stack_spec_builds_nothing():
    assert isinstance(hybrid_stack_spec, ModuleSpec) and hybrid_stack_spec.module is HybridStack
    assert isinstance(hybrid_stack_spec.submodules, HybridStackSubmodules)
    assert hybrid_stack_spec.submodules.mtp_block_spec is None
    with pytest.raises(NotImplementedError, match="^HybridStack: hybrid models .* not implemented in this fork"):
        build_module(hybrid_stack_spec, config=None)
