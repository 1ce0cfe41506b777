"""Multi-token prediction: forward and loss against a hand computation, gradient scale, upstream's keys."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.transformer import multi_token_prediction as mtp_mod
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, roll_tensor
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.transformer.test_te_layers_fake import fake_te  # noqa: F401 (fixture)

VOCAB, SEQ = 64, 8


def _model(mtp_layers=2, tied=False, **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, mtp_num_layers=mtp_layers,
                mtp_loss_scaling_factor=0.3)
    base.update(kw)
    cfg = TransformerConfig(**base)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    torch.manual_seed(3)
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=16,
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False),
                    share_embeddings_and_output_weights=tied)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(2, SEQ), torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _hand_mtp_losses(model, ids, pos, labels, mask):
    """Each depth's mean loss computed step by step from the submodules (no MTP code)."""
    h = model.decoder(model.embedding(ids, pos))
    out_w = model.output_layer.weight
    losses, cur_ids, cur_pos, cur_labels, cur_mask = [], ids, pos, labels, mask
    for layer in model.mtp.layers:
        shift = lambda t: torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)  # noqa: E731
        cur_ids, cur_pos, cur_labels, cur_mask = shift(cur_ids), shift(cur_pos), shift(cur_labels), shift(cur_mask)
        e = model.embedding.word_embeddings.weight[cur_ids.t()] + model.embedding.position_embeddings.weight[cur_pos.t()]
        x = torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1) @ layer.eh_proj.weight.t()
        h = layer.final_layernorm(layer.mtp_model_layer(x)[0])
        logits = h @ out_w.t()  # [s, b, v]
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), cur_labels.t().reshape(-1), reduction="none")
        ce = ce.view(SEQ, 2).t() * cur_mask
        losses.append(ce.sum() / cur_mask.sum())
    return losses


def test_roll_tensor_shifts_left_and_zeroes_the_end():
    t = torch.tensor([[1, 2, 3], [4, 5, 6]])
    rolled, total = roll_tensor(t)
    assert rolled.tolist() == [[2, 3, 0], [5, 6, 0]] and int(total) == 16
    assert t.tolist() == [[1, 2, 3], [4, 5, 6]]  # input unchanged


def test_mtp_forward_and_loss_match_a_hand_computation():
    model = _model()
    ids, pos, labels = _batch()
    mask = torch.ones(2, SEQ)
    mask[1, 2] = 0.0
    mtp_mod.clear_mtp_losses()
    lm = model(ids, pos, labels=labels, loss_mask=mask)
    # the returned loss is the main model's only (MTP does not change it)
    plain = model.compute_language_model_loss(labels, model.output_layer(model.decoder(model.embedding(ids, pos)))[0])
    torch.testing.assert_close(lm, plain)
    expected = _hand_mtp_losses(model, ids, pos, labels, mask)
    logged = mtp_mod.reduce_mtp_losses(2, num_microbatches=1)
    assert list(logged) == ["mtp_1 loss", "mtp_2 loss"]
    for k, value in enumerate(expected):
        assert logged[f"mtp_{k + 1} loss"] == pytest.approx(float(value.detach()), rel=1e-5)
    assert mtp_mod._MTP_LOSSES == {}  # reduced and cleared


def test_mtp_gradient_is_scaling_factor_times_mean_over_depths():
    """d(lm.sum() backward)/d(mtp params) equals the gradient of 0.3 / 2 * (loss_1 + loss_2) (scale 1)."""
    model = _model()
    ids, pos, labels = _batch()
    mask = torch.ones(2, SEQ)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    model(ids, pos, labels=labels, loss_mask=mask).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    model.zero_grad()
    (0.3 / 2 * sum(_hand_mtp_losses(model, ids, pos, labels, mask))).backward()
    for name, g in got.items():
        torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6)
    # off: the MTP block gets no gradient from the main loss alone
    model.zero_grad()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.0))
    model(ids, pos, labels=labels, loss_mask=mask).sum().backward()
    assert all(float(model.get_parameter(n).grad.abs().sum()) == 0.0 for n in got)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def test_mtp_without_labels_uses_shifted_inputs_and_logits_unchanged():
    model = _model(mtp_layers=1, tied=True)
    ids, pos, _ = _batch()
    model.eval()
    logits = model(ids, pos)
    ref = model.output_layer(model.decoder(model.embedding(ids, pos)),
                             weight=model.embedding.word_embeddings.weight)[0].transpose(0, 1)
    torch.testing.assert_close(logits, ref)
    assert model.output_layer.weight is None  # tied: the output layer uses the embedding


def test_mtp_keys_follow_upstream_and_moe_last_layer_kind():
    model = _model(mtp_layers=1, num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1],
                   moe_router_enable_expert_bias=True)
    assert model.mtp.layers[0].mtp_model_layer.is_moe  # the last decoder layer is MoE
    keys = {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
                 "transformer_layer.self_attention.linear_qkv.weight",
                 "transformer_layer.self_attention.linear_qkv.layer_norm_weight",
                 "transformer_layer.mlp.router.weight", "transformer_layer.mlp.router.expert_bias",
                 "transformer_layer.mlp.experts.experts.linear_fc1.weight"):
        assert f"mtp.layers.0.{name}" in keys, name
    assert not any("mtp_model_layer" in k for k in keys)
    assert model.mtp.layers[0].eh_proj.weight.shape == (32, 64)


def test_mtp_spec_and_refusals():
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    assert get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) is None
    with pytest.raises(ValueError, match="mtp_num_layers"):
        GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=16,
                 mtp_block_spec=get_gpt_mtp_block_spec(_model().config, spec, use_transformer_engine=False))
    with pytest.raises(ValueError, match=r"mtp_num_layers \(--mtp-num-layers=0\)"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=0)


def test_mtp_on_a_later_stage_refuses_learned_position_embeddings():
    cfg = _model().config
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    with pytest.raises(ValueError, match=r"--mtp-num-layers\) with --pipeline-model-parallel-size > 1 and learned"):
        GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=16, pre_process=False,
                 mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))


def test_mtp_with_transformer_engine_layers(fake_te):  # noqa: F811 (stand-in TE on CPU)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, mtp_num_layers=1,
                            transformer_impl="transformer_engine", num_moe_experts=2, moe_router_topk=1,
                            moe_layer_freq=[1, 0])
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=True)
    torch.manual_seed(0)
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=16,
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=True))
    layer = model.mtp.layers[0]
    assert isinstance(layer.eh_proj, fake_te.TEColumnParallelLinear) and not layer.mtp_model_layer.is_moe
    ids, pos, labels = _batch()
    mtp_mod.clear_mtp_losses()
    loss = model(ids, pos, labels=labels)
    loss.sum().backward()
    assert layer.eh_proj.weight.grad is not None and float(layer.eh_proj.weight.grad.abs().sum()) > 0
    keys = {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}
    assert {"mtp.layers.0.eh_proj._extra_state", "mtp.layers.0.enorm._extra_state",
            "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight"} <= keys
    mtp_mod.clear_mtp_losses()


def _cuda_te():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return torch.cuda.is_available() and HAVE_TE


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_te(), reason="needs CUDA and Transformer Engine")
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_mtp_te_fp8_weights_train_on_gpu(recipe):
    """Real TE: the MTP depth's linears get FP8 weights with fp8_param, run under the FP8 autocast, and the MTP loss
    reaches them (finite, nonzero gradients); first/last-bf16 leaves the decoder's end layers plain."""
    from megatron.core.fp8_utils import is_quantized_tensor

    if torch.cuda.get_device_capability()[0] < 9 and recipe == "blockwise":
        pytest.skip("blockwise FP8 needs Hopper or newer")
    cfg = TransformerConfig(num_layers=3, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
                            mtp_num_layers=1, transformer_impl="transformer_engine", fp8="e4m3", fp8_recipe=recipe,
                            fp8_param=True, first_last_layers_bf16=True, bf16=True, params_dtype=torch.bfloat16,
                            num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1, 1], add_bias_linear=False)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPTModel(cfg, spec, vocab_size=128, max_sequence_length=32,
                         mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=True))
    assert is_quantized_tensor(model.mtp.layers[0].eh_proj.weight)
    assert not is_quantized_tensor(model.decoder.layers[0].self_attention.linear_proj.weight)
    assert is_quantized_tensor(model.decoder.layers[1].self_attention.linear_proj.weight)
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    mtp_mod.clear_mtp_losses()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    model(ids, None, labels=ids).float().mean().backward()
    grads = [p.grad if p.grad is not None else getattr(p, "main_grad", None)
             for n, p in model.named_parameters() if n.startswith("mtp.layers.0.mtp_model_layer.")]
    assert any(g is not None and torch.isfinite(g.float()).all() and float(g.float().abs().sum()) > 0 for g in grads)
    assert 3.0 < mtp_mod.reduce_mtp_losses(1, 1)["mtp_1 loss"] < 7.0
