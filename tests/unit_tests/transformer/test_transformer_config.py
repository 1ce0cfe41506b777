import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer import TransformerConfig


def test_derived_defaults():
    c = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert c.ffn_hidden_size == 256
    assert c.kv_channels == 16
    assert c.num_query_groups == 4
    assert c.hidden_dropout == 0.0 and c.attention_dropout == 0.0
    assert c.params_dtype == torch.float32
    assert c.activation_func is F.gelu
    m = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, ffn_hidden_size=96)
    assert m.moe_ffn_hidden_size == 96
    assert m.moe_router_topk == 2 and m.moe_router_score_function == "softmax"


def test_transformer_impl_default_is_upstreams():
    """Upstream's default 'transformer_engine'; left at the default on a machine without TE (and no fp8/fp4) it
    becomes 'local' (the --transformer-impl rule); an explicit value is kept; fp8 keeps TE (upstream's
    ``TransformerConfig(fp8="hybrid", ...)`` builds)."""
    import dataclasses

    from megatron.core.extensions.transformer_engine import HAVE_TE

    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}["transformer_impl"]
    assert field.default == "transformer_engine"
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    c = TransformerConfig(**base)
    assert c.transformer_impl == ("transformer_engine" if HAVE_TE else "local") and type(c.transformer_impl) is str
    assert TransformerConfig(**base, transformer_impl="transformer_engine").transformer_impl == "transformer_engine"
    assert TransformerConfig(**base, transformer_impl="local").transformer_impl == "local"
    f8 = TransformerConfig(**base, fp8="hybrid", fp8_param=True)
    assert f8.transformer_impl == "transformer_engine" and f8.fp8 == "hybrid"
    assert dataclasses.replace(c).transformer_impl == c.transformer_impl


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(hidden_size=30, num_attention_heads=4), "num_attention_heads"),
        (dict(num_query_groups=3), "--num-query-groups"),
        (dict(normalization="BatchNorm"), "--normalization"),
        (dict(transformer_impl="te"), "--transformer-impl"),
        (dict(fp8="e5m2"), "--fp8-format"),
        (dict(fp8="e4m3", transformer_impl="local"), "--transformer-impl transformer_engine"),
        (dict(fp8_recipe="foo"), "--fp8-recipe"),
        (dict(num_moe_experts=4, moe_router_topk=5), "--moe-router-topk"),
        (dict(num_moe_experts=4, moe_router_score_function="relu"), "--moe-router-score-function"),
        (dict(moe_router_enable_expert_bias=True), "--moe-router-enable-expert-bias"),
        (dict(tensor_model_parallel_size=3), "num_attention_heads .*--tensor-model-parallel-size"),
        (dict(tensor_model_parallel_size=2, num_query_groups=1), "num_query_groups .*--tensor-model-parallel-size"),
        (dict(tensor_model_parallel_size=2, ffn_hidden_size=33), "ffn_hidden_size .*--tensor-model-parallel-size"),
        (dict(tensor_model_parallel_size=2, num_moe_experts=4, moe_ffn_hidden_size=15), "--moe-ffn-hidden-size"),
        (dict(sequence_parallel=True), "--sequence-parallel"),
        (dict(num_layers=0), "--num-layers"),
    ],
)
def test_bad_config_names_the_flag(kwargs, needle):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        TransformerConfig(**base)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(num_moe_experts=4, moe_layer_freq=[1, 2]), "--moe-layer-freq"),
        (dict(num_moe_experts=4, moe_layer_freq=[1]), "--moe-layer-freq"),
        (dict(recompute_granularity="full"), "--recompute-granularity"),
        (dict(context_parallel_size=0), "--context-parallel-size"),
        (dict(context_parallel_size=2, attention_dropout=0.1), "--attention-dropout 0.1 is not supported with "
                                                               "--context-parallel-size 2"),
    ],
)
def test_unsupported_options_rejected(kwargs, needle):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        TransformerConfig(**base)


def test_moe_layer_freq_list_selects_layers():
    from megatron.core.transformer.transformer_layer import is_moe_layer

    c = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_moe_experts=2, moe_router_topk=1,
                          moe_layer_freq=[0, 1, 1])
    assert [is_moe_layer(c, i) for i in (1, 2, 3)] == [False, True, True]
    c2 = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=2, moe_router_topk=1,
                           moe_layer_freq=2)
    assert [is_moe_layer(c2, i) for i in (1, 2, 3, 4)] == [True, False, True, False]


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(tensor_model_parallel_size=3), "num_attention_heads (--num-attention-heads=4) must be divisible by "
                                             "tensor_model_parallel_size (--tensor-model-parallel-size=3)"),
        (dict(tensor_model_parallel_size=2, num_query_groups=1),
         "num_query_groups (--num-query-groups=1) must be divisible by tensor_model_parallel_size "
         "(--tensor-model-parallel-size=2)"),
        (dict(tensor_model_parallel_size=2, ffn_hidden_size=34 + 1), "ffn_hidden_size (--ffn-hidden-size=35)"),
        (dict(tensor_model_parallel_size=2, num_moe_experts=4, moe_ffn_hidden_size=15),
         "moe_ffn_hidden_size (--moe-ffn-hidden-size=15) must be divisible by tensor_model_parallel_size "
         "(--tensor-model-parallel-size=2)"),
        (dict(sequence_parallel=True), "sequence_parallel (--sequence-parallel=True) needs tensor_model_parallel_size "
                                       "(--tensor-model-parallel-size=1) > 1"),
        (dict(num_moe_experts=0), "num_moe_experts (--num-experts=0) must be positive"),
        (dict(num_moe_experts=4, moe_router_topk=0), "moe_router_topk (--moe-router-topk=0) must be in "
                                                     "[1, num_moe_experts (--num-experts=4)]"),
        (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias (--moe-router-enable-expert-bias="
                                                   "True) needs num_moe_experts (--num-experts)"),
    ],
)
def test_messages_name_field_flag_and_value(kwargs, text):
    """The checks validate_args leaves to the config: each message names the field, its flag and the value."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    base.update(kwargs)
    with pytest.raises(ValueError) as exc:
        TransformerConfig(**base)
    assert text in str(exc.value), (text, str(exc.value))
