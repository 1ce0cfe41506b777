import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.utils import init_weights


def per_token_reference(layer, x, probs, routing_map):
    """The MoE output token by token: each routed expert's output (with its bias) weighted by the router's prob."""
    flat = x.reshape(-1, x.shape[-1])
    ref = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for e in routing_map[t].nonzero().flatten().tolist():
            y, b = layer.experts.local_experts[e](flat[t : t + 1])
            ref[t] += probs[t, e] * (y + b)[0]
    return ref


def _layer(seed=0, **kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                ffn_hidden_size=24)
    base.update(kw)
    torch.manual_seed(seed)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    layer = MoELayer(TransformerConfig(**base))
    init_weights(layer)
    return layer


@pytest.mark.parametrize("score_function,topk", [("softmax", 2), ("sigmoid", 2), ("softmax", 1), ("sigmoid", 3)])
def test_moe_matches_per_token_reference(score_function, topk):
    layer = _layer(moe_router_score_function=score_function, moe_router_topk=topk, moe_router_enable_expert_bias=True)
    layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(5, 3, 16)
    out, bias = layer(x)
    assert bias is None and out.shape == x.shape and out.dtype == x.dtype
    probs, routing_map = layer.router(x)
    torch.testing.assert_close(out.reshape(-1, 16), per_token_reference(layer, x, probs, routing_map), rtol=1e-5,
                               atol=1e-6)


def test_expert_params_not_allreduce_router_is():
    layer = _layer()
    for name, p in layer.named_parameters():
        assert p.allreduce is (not name.startswith("experts.")), name


def test_aux_loss_changes_router_grad_not_output():
    x = torch.randn(8, 2, 16)
    grads, outs = [], []
    for coeff in (0.0, 0.1):
        layer = _layer(moe_aux_loss_coeff=coeff)
        out, _ = layer(x)
        out.sum().backward()
        grads.append(layer.router.weight.grad.clone())
        outs.append(out.detach())
        if coeff > 0:
            aux = layer.router.last_aux_loss
            assert aux is not None and aux.item() > 0
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.allclose(grads[0], grads[1])


def test_moe_backward_reaches_every_selected_expert():
    layer = _layer(num_moe_experts=3, moe_router_topk=3)
    out, _ = layer(torch.randn(4, 2, 16))
    out.pow(2).sum().backward()
    for e in layer.experts.local_experts:
        assert e.linear_fc1.weight.grad is not None and e.linear_fc1.weight.grad.abs().sum() > 0


def test_fp8_pads_expert_tokens_to_gemm_multiple_and_drops_padding():
    """Under --fp8-format each expert sees a token count that is a multiple of QUANTIZED_ROW_ALIGN (FP8 GEMMs need
    it); the padded rows are dropped, so outputs and gradients equal the unpadded computation."""
    from megatron.core.transformer.moe.experts import QUANTIZED_ROW_ALIGN

    layer = _layer(seed=1)
    x = torch.randn(7, 3, 16, requires_grad=True)  # 21 tokens x top-2: counts not multiples of 32
    ref_out, _ = layer(x)
    ref_out.sum().backward()
    ref_grad = x.grad.clone()
    seen = []
    hooks = [e.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0])) for e in layer.experts.local_experts]
    layer.config.fp8 = "hybrid"  # the local MLP computes in full precision; only the padding path is exercised
    x.grad = None
    out, _ = layer(x)
    out.sum().backward()
    for h in hooks:
        h.remove()
    assert len(seen) == 4 and all(n % QUANTIZED_ROW_ALIGN == 0 and n > 0 for n in seen), seen
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_grad, rtol=0, atol=1e-6)
