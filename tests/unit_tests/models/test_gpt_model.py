import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import TopKRouter, update_expert_bias

VOCAB, SEQ = 64, 16

CONFIGS = {
    "dense": dict(),
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_router_enable_expert_bias=True),
    "moe_sigmoid_aux": dict(num_moe_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
                            moe_aux_loss_coeff=0.01, moe_layer_freq=2),
    "rms_swiglu_gqa": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                           num_query_groups=2, add_bias_linear=False),
}


def _cfg(name="dense", **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
    base.update(CONFIGS[name])
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def _model(name="dense", seed=1234, tied=False, pos="learned_absolute", **kw):
    torch.manual_seed(seed)
    return GPTModel(_cfg(name, **kw), vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                    position_embedding_type=pos)


def _batch(b=2, s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    return ids, pos


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tied,pos", [(False, "learned_absolute"), (True, "rope")])
def test_forward_shapes_and_dtypes(name, tied, pos):
    model = _model(name, tied=tied, pos=pos)
    ids, p = _batch()
    logits = model(ids, p)
    assert logits.shape == (2, 8, VOCAB) and logits.dtype == torch.float32
    loss = model(ids, p, labels=ids)
    assert loss.shape == (2, 8) and loss.dtype == torch.float32
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1), reduction="none").view(2, 8)
    torch.testing.assert_close(loss, ref)
    assert torch.isfinite(loss).all()
    assert isinstance(model.decoder.layers, torch.nn.ModuleList) and len(model.decoder.layers) == 2
    if pos == "rope":
        assert "embedding.position_embeddings.weight" not in model.state_dict()


def test_bf16_params_loss_stays_fp32():
    model = _model(params_dtype=torch.bfloat16, bf16=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids, p = _batch()
    assert model(ids, p).dtype == torch.bfloat16
    assert model(ids, p, labels=ids).dtype == torch.float32


def test_causal_future_tokens_do_not_change_past_logits():
    model = _model("moe")
    ids, p = _batch()
    ids2 = ids.clone()
    ids2[:, 5:] = (ids2[:, 5:] + 1) % VOCAB
    a, b = model(ids, p), model(ids2, p)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_deterministic_for_a_seed():
    ids, p = _batch()
    a, b, c = _model("moe"), _model("moe"), _model("moe", seed=7)
    assert torch.equal(a(ids, p), b(ids, p))
    assert not torch.equal(a(ids, p), c(ids, p))


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_loss_decreases_with_sgd(name):
    model = _model(name)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ids, p = _batch(b=4, s=12)
    losses = []
    for _ in range(20):
        loss = model(ids, p, labels=ids).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if model.config.moe_router_enable_expert_bias:
            update_expert_bias([model], None)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    if name == "moe":
        biases = [m.expert_bias for m in model.modules() if isinstance(m, TopKRouter)]
        assert len(biases) == 2
        for bias in biases:
            assert torch.isfinite(bias).all() and bias.abs().sum() > 0  # it moved
            assert bias.abs().max() <= 20 * model.config.moe_router_bias_update_rate + 1e-9


def test_tied_embeddings_share_one_parameter():
    model = _model(tied=True)
    assert model.output_layer.weight is None
    w = model.shared_embedding_or_output_weight()
    assert w.shared is True
    assert "output_layer.weight" not in model.state_dict()
    ids, p = _batch()
    model(ids, p, labels=ids).mean().backward()
    assert w.grad is not None
    hidden_grad_from_output = w.grad.clone()
    assert hidden_grad_from_output[ids.unique()].abs().sum() > 0


def test_parameter_attributes():
    model = _model("moe", tied=True)
    for name, prm in model.named_parameters():
        assert hasattr(prm, "allreduce"), name
        assert prm.allreduce is (".experts." not in name), name
        if "layernorm" in name:
            assert prm.sequence_parallel is False, name
    assert model.embedding.word_embeddings.weight.shared is True
    untied = _model()
    assert not getattr(untied.embedding.word_embeddings.weight, "shared", False)


def test_init_values():
    model = _model(init_method_std=0.05, num_layers=4, hidden_size=64, ffn_hidden_size=256)
    std = lambda t: t.detach().float().std().item()  # noqa: E731
    assert abs(std(model.embedding.word_embeddings.weight) - 0.05) < 0.005
    fc2 = model.decoder.layers[0].mlp.linear_fc2.weight
    assert abs(std(fc2) - 0.05 / (2 * 4) ** 0.5) < 0.003  # scaled output-layer init
    ln = model.decoder.layers[0].input_layernorm
    assert torch.equal(ln.weight, torch.ones(64)) and torch.equal(ln.bias, torch.zeros(64))
    assert torch.equal(model.decoder.layers[0].self_attention.linear_qkv.bias, torch.zeros(3 * 64))


def test_perform_initialization_false_leaves_weights_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    GPTModel(_cfg(perform_initialization=False), vocab_size=VOCAB, max_sequence_length=SEQ)
    assert torch.equal(before, torch.get_rng_state())


def test_te_requested_without_te_is_a_clear_error():
    from megatron.core.tensor_parallel.te_layers import HAVE_TE

    if HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(RuntimeError, match="--transformer-impl transformer_engine"):
        _model(transformer_impl="transformer_engine")


def test_bad_position_embedding_type():
    with pytest.raises(ValueError, match="--position-embedding-type"):
        _model(pos="alibi")


def test_dropout_only_in_training_and_seeded():
    model = _model("moe", hidden_dropout=0.1, attention_dropout=0.1)
    ids, p = _batch()
    model.eval()
    a, b = model(ids, p), model(ids, p)
    assert torch.equal(a, b)
    model.train()
    torch.manual_seed(3)
    c = model(ids, p)
    torch.manual_seed(3)
    d = model(ids, p)
    assert torch.equal(c, d) and not torch.allclose(a, c)
