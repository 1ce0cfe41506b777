"""Upstream megatron-core 0.19.2's TransformerConfig / ModelParallelConfig / MLATransformerConfig fields, as drop-in
callers (Megatron-Bridge, NeMo) pass them by keyword: every one is accepted at upstream's default and leaves the
config as built without it; a field of a feature this fork does not build (``transformer_config.NOT_BUILT``) raises
a ValueError naming it at any other value; the honoured ones act (init methods, softmax_scale, ...).

Upstream's field names and defaults are read by ``ast`` from the cached upstream site
(``tests/unit_tests/interop/upstream_env.upstream_source_site()``) when it is there; without it the tests use the fork's field
set (the upstream comparison is skipped)."""
import ast
import dataclasses
import math

import pytest
import torch

from megatron.core.transformer.transformer_config import NOT_BUILT, MLATransformerConfig, TransformerConfig
from megatron.core.transformer.utils import NormalInit, init_weights
from tests.unit_tests.interop.upstream_env import upstream_source_site

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, transformer_impl="local")
# fork defaults that differ from upstream's on purpose (tools/public_name_diff_accepted.txt says why)
DEVIATIONS = {"hidden_dropout", "attention_dropout"}
# upstream fields handled by _check_upstream_parallel_sizes / _fill_upstream_defaults rather than NOT_BUILT
SPECIAL = {"hierarchical_context_parallel_sizes", "gtp_weight_remat_size", "expert_gtp_weight_remat_size",
           "tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards",
           "expert_tensor_parallel_size", "multi_latent_attention"}


def _upstream_defaults(cls: str, path: str) -> dict:
    """``{field: default}`` of upstream's dataclass ``cls`` in ``path`` (under the site's megatron/core); a default
    that is an expression over names (``torch.float32``, ``F.gelu``) is ``...`` (not compared)."""
    site = upstream_source_site() / "megatron" / "core"
    if not (site / path).is_file():
        pytest.skip(f"upstream megatron-core cache {site} not set up")
    out = {}
    for node in ast.parse((site / path).read_text()).body:
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for stmt in node.body:
            if not isinstance(stmt, ast.AnnAssign) or stmt.value is None:
                continue
            value = stmt.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                kw = {k.arg: k.value for k in value.keywords}
                value = kw["default"] if "default" in kw else ast.Call(kw["default_factory"], [], [])
            source = ast.unparse(value)
            names = {n.id for n in ast.walk(ast.parse(source, mode="eval")) if isinstance(n, ast.Name)}
            attrs = any(isinstance(n, (ast.Attribute, ast.Lambda)) for n in ast.walk(value))
            out[stmt.target.id] = (... if attrs or names - {"list"} else
                                   eval(source, {"__builtins__": {"list": list}}))
    return out


def _upstream_transformer_defaults() -> dict:
    up = _upstream_defaults("ModelParallelConfig", "model_parallel_config.py")
    up.update(_upstream_defaults("TransformerConfig", "transformer/transformer_config.py"))
    return up


def _own_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_every_upstream_field_exists_with_upstream_default():
    up = _upstream_transformer_defaults()
    ours = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    assert len(up) > 300  # the parse found upstream's fields
    assert sorted(set(up) - set(ours)) == []
    differ = {name: (value, _own_default(ours[name])) for name, value in up.items()
              if value is not ... and _own_default(ours[name]) != value}
    assert set(differ) == DEVIATIONS, differ
    mla = _upstream_defaults("MLATransformerConfig", "transformer/transformer_config.py")
    mine = {f.name: _own_default(f) for f in dataclasses.fields(MLATransformerConfig)}
    assert {name: value for name, value in mla.items() if mine[name] != value} == {}


def _given_at_upstream_default(up: dict) -> dict:
    """Every upstream field with a comparable default, at that default (fresh lists), except the deviations and the
    shape fields BASE sets (upstream's 0 is no model)."""
    return {name: (list(value) if isinstance(value, list) else value) for name, value in up.items()
            if value is not ... and name not in DEVIATIONS and name not in BASE}


def test_upstream_defaults_accepted_and_equal_to_no_kwargs():
    up = _upstream_transformer_defaults()
    given = _given_at_upstream_default(up)
    assert {"init_method", "output_layer_init_method", "tp_comm_overlap", "use_te_rng_tracker",
            "expert_tensor_parallel_size", "hierarchical_context_parallel_sizes"} <= set(given)
    plain = TransformerConfig(**BASE)
    cfg = TransformerConfig(**BASE, **given)
    assert cfg == plain  # every field, derived defaults (init methods, expert TP size, ...) included
    # the same for MLA: upstream's MLA defaults over upstream's TransformerConfig ones
    mla_up = _upstream_defaults("MLATransformerConfig", "transformer/transformer_config.py")
    given_mla = {**given, **_given_at_upstream_default(mla_up)}
    assert given_mla["multi_latent_attention"] is True
    assert MLATransformerConfig(**BASE, **given_mla) == MLATransformerConfig(**BASE)


def test_the_drop_in_example_of_the_brief():
    cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, init_method=None)
    assert cfg.init_method == NormalInit(0.02)


def _non_default(f: dataclasses.Field):
    default = _own_default(f)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 3
    if isinstance(default, str):
        return default + "_other"
    return 4  # None / dtype / list defaults: any other value


@pytest.mark.parametrize("name", sorted(NOT_BUILT))
def test_not_built_field_refused_off_default(name):
    f = {f.name: f for f in dataclasses.fields(TransformerConfig)}[name]
    TransformerConfig(**BASE, **{name: _own_default(f)})  # the default is accepted
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{name}=.*not built in this fork"):
        TransformerConfig(**BASE, **{name: _non_default(f)})


@pytest.mark.parametrize("kw,match", [
    (dict(hierarchical_context_parallel_sizes=[2, 2]), r"hierarchical_context_parallel_sizes=\[2, 2\] "
                                                       r"\(--hierarchical-context-parallel-sizes\) is not supported"),
    (dict(gtp_weight_remat_size=2), r"gtp_weight_remat_size=2: generalized tensor parallel"),
    (dict(expert_gtp_weight_remat_size=2), r"expert_gtp_weight_remat_size=2: generalized tensor parallel"),
    (dict(tensor_parallel_num_weight_shards=4), r"tensor_parallel_num_weight_shards=4"),
    (dict(num_moe_experts=4, expert_tensor_parallel_size=2), r"expert_tensor_parallel_size .*=2.* is not supported"),
    (dict(multi_latent_attention=True), r"multi_latent_attention=True .*MLATransformerConfig"),
    (dict(moe_layer_recompute=True, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), r"moe_layer_recompute"),
])
def test_special_upstream_fields_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**BASE, **kw)


def test_neutral_values_of_special_fields_accepted():
    cfg = TransformerConfig(**BASE, hierarchical_context_parallel_sizes=[1], tensor_parallel_num_weight_shards=1,
                            expert_tensor_parallel_num_weight_shards=1, num_moe_experts=4,
                            expert_tensor_parallel_size=1)
    assert cfg.expert_tensor_parallel_size == 1
    assert TransformerConfig(**BASE).expert_tensor_parallel_size == 1  # None: the TP size, as upstream
    # without experts the expert TP size has no effect: accepted (recipes pass 1 for dense models)
    assert TransformerConfig(**BASE, expert_tensor_parallel_size=2).expert_tensor_parallel_size == 2


def test_inert_fields_accept_any_value():
    kw = dict(cross_entropy_loss_fusion=True, inference_sampling_seed=7, use_te_rng_tracker=True,
              barrier_with_L1_time=False, tp_comm_overlap_ag=False, config_logger_dir="/tmp/x",
              memory_efficient_layer_norm=True)
    cfg = TransformerConfig(**BASE, **kw)
    assert {k: getattr(cfg, k) for k in kw} == kw
    assert dataclasses.replace(cfg, **{k: v for k, v in kw.items()}) == cfg


def test_category_counts():
    """11 honoured, 81 not built (NOT_BUILT + the special parallel sizes), 93 inert: the accepted-list line."""
    added = [f.name for f in dataclasses.fields(TransformerConfig)]
    added = added[added.index("init_method"):]  # the upstream fields are appended from init_method on
    honoured = added[:added.index("barrier_with_L1_time")]
    not_built = set(NOT_BUILT) | (SPECIAL - {"expert_tensor_parallel_size", "multi_latent_attention"})
    assert (len(added), len(honoured), len(not_built), len(set(added) - set(honoured) - not_built)) == (185, 11, 81,
                                                                                                       93)


# ---- honoured: the init methods -------------------------------------------------------------------------------
def _layer(**kw):
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    torch.manual_seed(0)
    cfg = TransformerConfig(**{**BASE, "hidden_size": 64, "ffn_hidden_size": 256, "num_layers": 8}, **kw)
    attn, mlp = SelfAttention(cfg), MLP(cfg)
    init_weights(attn)
    init_weights(mlp)
    return cfg, attn, mlp


def test_default_init_methods_draw_upstreams_std():
    cfg, attn, mlp = _layer(init_method_std=0.05)
    assert cfg.init_method == NormalInit(0.05) and cfg.embedding_init_method == NormalInit(0.05)
    assert cfg.output_layer_init_method == NormalInit(0.05 / math.sqrt(2 * 8))
    for w, std in ((attn.linear_qkv.weight, 0.05), (mlp.linear_fc1.weight, 0.05),
                   (attn.linear_proj.weight, 0.05 / 4), (mlp.linear_fc2.weight, 0.05 / 4)):
        assert abs(w.std().item() / std - 1) < 0.05, (w.shape, w.std().item(), std)
        assert abs(w.mean().item()) < 0.1 * std


def test_given_init_methods_are_used():
    cfg, attn, mlp = _layer(init_method=lambda t: torch.nn.init.constant_(t, 0.5),
                            output_layer_init_method=lambda t: torch.nn.init.constant_(t, -0.25))
    assert bool((attn.linear_qkv.weight == 0.5).all()) and bool((mlp.linear_fc1.weight == 0.5).all())
    assert bool((attn.linear_proj.weight == -0.25).all()) and bool((mlp.linear_fc2.weight == -0.25).all())
    with pytest.raises(ValueError, match="init_method must be a callable"):
        TransformerConfig(**BASE, init_method=0.02)


def test_embedding_init_method_std():
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    torch.manual_seed(0)
    cfg = TransformerConfig(**BASE, embedding_init_method_std=0.2)
    assert cfg.embedding_init_method == NormalInit(0.2) and cfg.init_method == NormalInit(0.02)
    emb = LanguageModelEmbedding(cfg, vocab_size=512, max_sequence_length=64)
    init_weights(emb)
    assert abs(emb.word_embeddings.weight.std().item() / 0.2 - 1) < 0.05
    given = TransformerConfig(**BASE, init_method=NormalInit(0.3))  # upstream: the embeddings take init_method
    assert given.embedding_init_method == NormalInit(0.3)


# ---- honoured: softmax_scale, the deprecated MoE fields, the MoE / MTP loss scale hooks --------------------------
def test_softmax_scale_scales_the_logits():
    from megatron.core.transformer.attention import SelfAttention

    x = torch.randn(5, 2, 32)
    outs = {}
    for scale in (None, 1e-9, 8 ** -0.5):
        torch.manual_seed(0)
        attn = SelfAttention(TransformerConfig(**BASE, softmax_scale=scale))
        init_weights(attn)
        outs[scale] = attn(x)[0]
        if scale == 1e-9:  # (near) uniform causal attention: position t averages the values of 0..t
            s, b, _ = x.shape
            v = (x @ attn.linear_qkv.weight.t() + attn.linear_qkv.bias).view(s, b, 4, 3, 8)[..., 2, :]
            mean = v.cumsum(0) / torch.arange(1, s + 1).view(s, 1, 1, 1)
            ref = mean.reshape(s, b, 32) @ attn.linear_proj.weight.t()
            torch.testing.assert_close(outs[scale], ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs[None], outs[8 ** -0.5])  # the default is 1/sqrt(kv_channels)
    assert not torch.allclose(outs[None], outs[1e-9])


def test_moe_layer_recompute_and_topk_limited_devices():
    cfg = TransformerConfig(**BASE, num_moe_experts=4, moe_layer_recompute=True, moe_router_topk_limited_devices=1,
                            expert_model_parallel_size=2)
    assert (cfg.recompute_granularity, cfg.recompute_modules) == ("selective", ["core_attn", "moe"])
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    assert dataclasses.replace(cfg) == cfg  # __post_init__ again: the same config


def test_moe_and_mtp_grad_scale_funcs(monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None, raising=False)
    monkeypatch.setattr(MTPLossAutoScaler, "main_loss_backward_scale", None, raising=False)
    cfg = TransformerConfig(**BASE, num_moe_experts=4, mtp_num_layers=1, grad_scale_func=lambda t: t * 8,
                            moe_grad_scale_func=lambda: 6.0)
    schedules._set_moe_loss_scale(cfg, num_microbatches=2)
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.item() == 3.0  # its own func / microbatches
    assert MTPLossAutoScaler.main_loss_backward_scale.item() == 4.0  # grad_scale_func's 8 / microbatches
    cfg.mtp_grad_scale_func = lambda: torch.tensor([10.0])
    schedules._set_moe_loss_scale(cfg, num_microbatches=2)
    assert MTPLossAutoScaler.main_loss_backward_scale.item() == 5.0
