"""gpt_layer_specs names of upstream 0.19.2: the HAVE_* flags, get_gpt_decoder_layer_specs(vp_stage, pp_rank),
get_gpt_layer_with_inference_spec's parameters (refused), get_gpt_mtp_block_spec_for_backend; transformer_config's
HAVE_PACKAGING."""
import inspect

import pytest

from megatron.core.extensions import transformer_engine as te_ext
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer import transformer_config


def _cfg(**kw):
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                             **{"transformer_impl": "local", **kw})


def test_flags():
    assert specs.HAVE_TE is te_ext.HAVE_TE
    assert specs.HAVE_APEX is False and specs.HAVE_KITCHEN is False
    assert transformer_config.HAVE_PACKAGING is True


def test_decoder_layer_specs_take_vp_stage_and_pp_rank():
    cfg = _cfg(num_moe_experts=2, moe_layer_freq=[1, 0, 1, 0])
    whole = specs.get_gpt_decoder_layer_specs(cfg, False)
    assert specs.get_gpt_decoder_layer_specs(cfg, False, None, False, 1, 0) == whole
    assert specs.get_gpt_decoder_layer_specs(cfg, False, vp_stage=0, pp_rank=1) == whole
    assert len(whole) == 4 and whole[0] != whole[1] and whole[0] == whole[2]
    block = specs.get_gpt_decoder_block_spec(cfg, False, vp_stage=0, pp_rank=0)
    assert block.layer_specs == whole


def test_inference_spec_has_upstreams_parameters_and_refuses():
    params = inspect.signature(specs.get_gpt_layer_with_inference_spec).parameters
    assert list(params) == ["qk_layernorm", "multi_latent_attention", "qk_l2_norm", "num_experts",
                            "moe_grouped_gemm", "moe_use_legacy_grouped_gemm"]
    with pytest.raises(ValueError, match="inference-optimized layers .* not supported by this fork"):
        specs.get_gpt_layer_with_inference_spec(num_experts=4)


def test_mtp_block_spec_for_backend():
    layer = specs.get_gpt_layer_local_spec()
    assert specs.get_gpt_mtp_block_spec_for_backend(_cfg(), layer, backend=object()) is None
    cfg = _cfg()
    cfg.mtp_num_layers = 1
    with pytest.raises(NotImplementedError, match=r"use get_gpt_mtp_block_spec\(config, spec"):
        specs.get_gpt_mtp_block_spec_for_backend(cfg, layer, backend=object(), vp_stage=0, pp_rank=0)


def test_moe_module_specs():
    from megatron.core.models.gpt import moe_module_specs as moe
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec = moe.get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=True)
    assert spec == specs.get_mlp_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=True)
    assert spec.module is MoELayer
    assert moe.get_moe_module_spec(False, 4) != spec  # sequential experts without moe_grouped_gemm
    with pytest.raises(AssertionError):
        moe.get_moe_module_spec(use_te=False)
    with pytest.raises(NotImplementedError, match="BackendSpecProvider"):
        moe.get_moe_module_spec_for_backend(object(), num_experts=4)
    with pytest.raises(NotImplementedError, match="^get_mlp_module_spec_for_backend: backend spec providers"):
        specs.get_mlp_module_spec_for_backend(object())
    with pytest.raises(NotImplementedError, match="inference-optimized MoE layers"):
        moe.get_inference_optimized_moe_spec()
