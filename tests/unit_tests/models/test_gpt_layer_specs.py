"""Upstream's model-building API: ``GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length, ...)``,
the specs of ``models.gpt.gpt_layer_specs``, ``ModuleSpec`` / ``build_module``, ``AttnBackend`` and the new
``TransformerConfig`` fields. The spec decides Transformer Engine vs local layers, and is never silently ignored."""
import inspect

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module, get_submodules, import_module
from megatron.core.transformer.torch_norm import IdentityOp, WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

VOCAB, SEQ = 64, 16


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


# ---- spec_utils --------------------------------------------------------------------------------------------------
class _Thing:
    def __init__(self, a, b=0, submodules=None):
        self.a, self.b, self.submodules = a, b, submodules


def _fn():
    return 7


def test_build_module_classes_paths_functions():
    spec = ModuleSpec(module=_Thing, params={"b": 2}, submodules="subs")
    built = build_module(spec, 1)
    assert (built.a, built.b, built.submodules) == (1, 2, "subs")
    assert spec(5).a == 5  # ModuleSpec.__call__ builds too
    by_path = build_module(ModuleSpec(module=("torch.nn", "Identity")))
    assert isinstance(by_path, torch.nn.Identity)
    assert get_module(ModuleSpec(module=("torch.nn", "Linear"))) is torch.nn.Linear
    assert build_module(_fn) is _fn and build_module(ModuleSpec(module=_fn)) is _fn  # functions are not called
    assert get_submodules(spec) == "subs"
    with pytest.raises(TypeError, match="when instantiating _Thing"):
        build_module(spec)  # missing ``a``
    with pytest.raises(ImportError, match="'NoSuchClass'.*'torch.nn'"):
        import_module(("torch.nn", "NoSuchClass"))
    with pytest.raises(ValueError, match="carries no submodules"):
        get_submodules(object())


# ---- the specs ---------------------------------------------------------------------------------------------------
def test_local_and_te_specs_describe_the_layers():
    local = specs.get_gpt_layer_local_spec()
    assert local.module is TransformerLayer
    sub = local.submodules
    assert sub.input_layernorm is WrappedTorchNorm and sub.pre_mlp_layernorm is WrappedTorchNorm
    assert sub.self_attention.params == {"attn_mask_type": AttnMaskType.causal}
    assert sub.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert sub.mlp.module is MLP
    assert sub.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    te = specs.get_gpt_layer_with_transformer_engine_spec().submodules
    assert te.input_layernorm is IdentityOp and te.pre_mlp_layernorm is IdentityOp
    assert te.self_attention.submodules.linear_qkv.__name__ == "TELayerNormColumnParallelLinear"
    assert te.sharded_state_dict_keys_map == {}
    te_moe = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True).submodules
    assert te_moe.pre_mlp_layernorm is WrappedTorchNorm  # TE MoE layers keep a separate norm, as upstream
    assert te_moe.mlp.module is MoELayer and te_moe.mlp.submodules.experts.__name__ == "TEGroupedMLP"
    assert specs.get_gpt_layer_local_spec(num_experts=4).submodules.mlp.submodules.experts is SequentialMLP
    assert specs.get_gpt_layer_local_spec(4, True).submodules.mlp.submodules.experts is GroupedMLP
    assert specs.get_mlp_module_spec(use_te=False, num_experts=None).module is MLP


def test_spec_signatures_are_upstreams():
    names = list(inspect.signature(specs.get_gpt_layer_local_spec).parameters)
    assert names == ["num_experts", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention", "fp8",
                     "normalization", "qk_l2_norm", "use_kitchen", "use_kitchen_attention",
                     "kitchen_attention_backend"]
    names = list(inspect.signature(specs.get_gpt_layer_with_transformer_engine_spec).parameters)
    assert names[:7] == ["num_experts", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention", "fp8",
                         "qk_l2_norm", "use_te_op_fuser"]
    assert list(inspect.signature(specs.get_gpt_decoder_block_spec).parameters) == [
        "config", "use_transformer_engine", "normalization", "qk_l2_norm", "vp_stage", "pp_rank"]
    assert list(inspect.signature(GPTModel.__init__).parameters) == [
        "self", "config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process",
        "post_process", "fp16_lm_cross_entropy", "parallel_output", "share_embeddings_and_output_weights",
        "position_embedding_type", "rotary_percent", "rotary_base", "rope_scaling", "rope_scaling_factor",
        "scatter_embedding_sequence_parallel", "seq_len_interpolation_factor", "mtp_block_spec", "pg_collection",
        "vp_stage"]
    assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(GPTModel.__init__).parameters.values())


def test_unsupported_spec_options_are_refused():
    with pytest.raises(ValueError, match="qk_layernorm not supported"):
        specs.get_gpt_layer_local_spec(qk_layernorm=True)
    with pytest.raises(ValueError, match="use_te_op_fuser not supported"):
        specs.get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, use_te_op_fuser=True)
    with pytest.raises(ValueError, match="normalization must be"):
        specs.get_gpt_layer_local_spec(normalization="ScaleNorm")
    with pytest.raises(ValueError, match="inference-optimized"):
        specs.get_gpt_layer_with_inference_spec()
    # upstream's pipeline arguments are accepted: the spec holds every layer, the block takes its stage's
    assert len(specs.get_gpt_decoder_block_spec(_cfg(), False, vp_stage=0, pp_rank=1).layer_specs) == 2
    assert specs.get_gpt_mtp_block_spec(_cfg(), None, False) is None


def test_decoder_block_spec_follows_moe_layer_freq():
    cfg = _cfg(num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_layer_freq=2)
    block = specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    assert isinstance(block, TransformerBlockSubmodules) and len(block.layer_specs) == 4
    assert [s.submodules.mlp.module for s in block.layer_specs] == [MoELayer, MLP, MoELayer, MLP]
    model = GPTModel(cfg, block, VOCAB, SEQ)
    assert [layer.is_moe for layer in model.decoder.layers] == [True, False, True, False]


# ---- GPTModel ----------------------------------------------------------------------------------------------------
def test_upstream_positional_and_keyword_calls_build_the_same_model():
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    outs = []
    for build in (
        lambda c: GPTModel(c, specs.get_gpt_layer_local_spec(), VOCAB, SEQ, True, True, False, True, True),
        lambda c: GPTModel(config=c, transformer_layer_spec=specs.get_gpt_layer_local_spec(), vocab_size=VOCAB,
                           max_sequence_length=SEQ, share_embeddings_and_output_weights=True),
        lambda c: GPTModel(c, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True),
    ):
        torch.manual_seed(3)
        model = build(_cfg()).eval()
        assert model.share_embeddings_and_output_weights and model.vocab_size == VOCAB
        outs.append(model(ids, torch.arange(8).unsqueeze(0)))
    assert outs[0].shape == (2, 8, VOCAB)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_rope_arguments_are_used():
    model = GPTModel(_cfg(), specs.get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope",
                     rotary_base=500, rotary_percent=0.5)
    assert model.rotary_pos_emb.rotary_base == 500
    assert model.rotary_pos_emb.dim == (32 // 4) // 2  # half of the head dim rotated


def test_bad_calls_are_refused_clearly():
    with pytest.raises(TypeError, match="second argument is the layer spec"):
        GPTModel(_cfg(), VOCAB, SEQ)  # this fork's old positional order
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        GPTModel(_cfg(), specs.get_gpt_layer_local_spec())
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        GPTModel(_cfg(), None, VOCAB, SEQ, no_such_option=1)  # nothing is swallowed
    with pytest.raises(ValueError, match="fp16_lm_cross_entropy not supported"):
        GPTModel(_cfg(), None, VOCAB, SEQ, fp16_lm_cross_entropy=True, rope_scaling=True)
    with pytest.raises(TypeError, match="must be a ModuleSpec or TransformerBlockSubmodules"):
        GPTModel(_cfg(), "local", VOCAB, SEQ)


def test_a_spec_that_disagrees_with_the_config_is_refused():
    moe_spec = specs.get_gpt_layer_local_spec(num_experts=4)
    with pytest.raises(ValueError, match=r"TransformerLayer 1 \(dense.*\['mlp'\] differ"):
        GPTModel(_cfg(), moe_spec, VOCAB, SEQ)
    grouped = specs.get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
    with pytest.raises(ValueError, match=r"moe_grouped_gemm=False.*\['mlp'\] differ"):
        GPTModel(_cfg(num_moe_experts=4, moe_router_topk=2), grouped, VOCAB, SEQ)
    short = TransformerBlockSubmodules(layer_specs=[specs.get_gpt_layer_local_spec()])
    with pytest.raises(ValueError, match=r"has 1 layer specs; expected one per layer of the model \(num_layers=2"):
        GPTModel(_cfg(), short, VOCAB, SEQ)
    mixed = TransformerBlockSubmodules(layer_specs=[specs.get_gpt_layer_local_spec(),
                                                    specs.get_gpt_layer_with_transformer_engine_spec()])
    with pytest.raises(ValueError, match="mix Transformer Engine and local"):
        GPTModel(_cfg(), mixed, VOCAB, SEQ)


def test_the_spec_chooses_te_or_local():
    te_spec = specs.get_gpt_layer_with_transformer_engine_spec()
    cfg = _cfg()
    assert cfg.transformer_impl == "local"
    from megatron.core.tensor_parallel.te_layers import HAVE_TE

    if HAVE_TE:  # pragma: no cover - TE machines
        model = GPTModel(cfg, te_spec, VOCAB, SEQ)
        assert type(model.decoder.layers[0].self_attention.linear_qkv).__name__ == "TELayerNormColumnParallelLinear"
    else:
        with pytest.raises(RuntimeError, match="needs Transformer Engine"):
            GPTModel(cfg, te_spec, VOCAB, SEQ)  # the TE spec is honoured, not ignored
    assert cfg.transformer_impl == "transformer_engine"
    local_cfg = _cfg()
    local_cfg.transformer_impl = "transformer_engine"  # e.g. upstream's default, with the local spec
    model = GPTModel(local_cfg, specs.get_gpt_layer_local_spec(), VOCAB, SEQ)
    assert local_cfg.transformer_impl == "local"
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv, ColumnParallelLinear)
    fp8_cfg = _cfg(transformer_impl="transformer_engine", fp8="e4m3")
    with pytest.raises(ValueError, match="need Transformer Engine layers"):
        GPTModel(fp8_cfg, specs.get_gpt_layer_local_spec(), VOCAB, SEQ)


def test_config_fields_and_enums():
    assert [m.name for m in AttnBackend] == ["flash", "fused", "unfused", "local", "auto"]
    assert [m.value for m in AttnBackend] == [1, 2, 3, 4, 5]
    cfg = _cfg(pipeline_dtype=torch.bfloat16, attention_backend=AttnBackend.flash)
    assert cfg.pipeline_dtype is torch.bfloat16 and cfg.attention_backend is AttnBackend.flash
    assert _cfg().attention_backend is AttnBackend.auto and _cfg().pipeline_dtype is None
    assert _cfg(attention_backend="flash").attention_backend is AttnBackend.flash  # the name is taken too
    with pytest.raises(ValueError, match=r"attention_backend \(--attention-backend\) must be an AttnBackend"):
        _cfg(attention_backend="sdpa")
    with pytest.raises(ValueError, match="pipeline_dtype must be a torch.dtype"):
        _cfg(pipeline_dtype="bf16")


def test_rope_settings_from_the_config_or_the_arguments():
    """Upstream passes rotary_base / rotary_percent to GPTModel; this fork's config carries them too: either place
    works, and two different explicit values are refused (never silently one of them)."""
    from megatron.core.models.gpt import GPTModel

    def rope(cfg, **kw):
        m = GPTModel(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="rope", **kw)
        return m.rotary_pos_emb.rotary_base, m.rotary_pos_emb.dim

    assert rope(_cfg(rotary_base=500)) == (500, 8)
    assert rope(_cfg(), rotary_base=500) == (500, 8)
    assert rope(_cfg(rotary_percent=0.5))[1] == 4
    assert rope(_cfg(rotary_base=500), rotary_base=500)[0] == 500
    with pytest.raises(ValueError, match="rotary_base=700 but config.rotary_base=500"):
        rope(_cfg(rotary_base=500), rotary_base=700)
