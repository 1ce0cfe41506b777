"""--moe-router-fusion (config ``moe_router_fusion``): Transformer Engine's ``fused_topk_with_score_function`` gives
the probs, routing map and logit gradients of the torch routing where ``te_routing_matches`` says it computes the
same routing (GPU with TE); without CUDA/TE the flag keeps the torch ops (CPU). A CPU model of TE's kernel (from
its documented semantics) checks the rule: equal where it allows the kernel, different in the two cases it
excludes."""
import pytest
import torch

from megatron.core.extensions.transformer_engine import te_fused_topk_with_score_function
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import TopKRouter
from megatron.core.transformer.moe.router import (
    can_fuse_routing,
    te_routing_matches,
    topk_routing_with_score_function,
)
from megatron.core.transformer.utils import init_weights

HAVE_FUSED = te_fused_topk_with_score_function is not None and torch.cuda.is_available()
needs_fused = pytest.mark.skipif(not HAVE_FUSED, reason="needs CUDA and Transformer Engine's fused router")

# (score_function, use_pre_softmax, expert bias, num_groups, group_topk, scaling_factor, topk)
CASES = [
    ("softmax", False, False, None, None, None, 2),
    ("softmax", False, False, None, None, 2.5, 1),
    ("softmax", True, False, None, None, None, 2),
    ("softmax", True, False, 4, 2, None, 4),
    ("sigmoid", False, False, None, None, None, 2),
    ("sigmoid", False, True, None, None, 1.5, 3),
    ("sigmoid", False, True, 4, 2, None, 4),
    ("sigmoid", False, False, None, None, None, 1),
]
EXCLUDED = [  # TE computes these differently: softmax with expert bias; softmax group routing on the logits
    ("softmax", False, True, None, None, None, 2),
    ("softmax", False, False, 4, 2, None, 4),
]


def _te_model(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, bias):
    """TE's kernel's routing in torch ops: the scores (softmax only with pre-softmax), the bias added for
    sigmoid only, groups ranked by the sum of their best topk // group_topk of those, the top-k, the bias taken off,
    softmax over the top-k (softmax without pre-softmax), sigmoid normalised (topk > 1), scaled."""
    s = logits.float()
    if score_function == "softmax" and use_pre_softmax:
        s = torch.softmax(s, -1)
    elif score_function == "sigmoid":
        s = torch.sigmoid(s)
    sel = s + bias if (bias is not None and score_function == "sigmoid") else s
    if num_groups:
        t, e = sel.shape
        g = sel.view(t, num_groups, -1).topk(topk // group_topk, -1).values.sum(-1)
        keep = torch.zeros(t, num_groups, dtype=torch.bool).scatter(1, g.topk(group_topk, -1).indices, True)
        sel = sel.view(t, num_groups, -1).masked_fill(~keep[..., None], float("-inf")).view(t, e)
    idx = sel.topk(topk, -1).indices
    top = s.gather(1, idx)
    if score_function == "softmax" and not use_pre_softmax:
        top = torch.softmax(top, -1)
    if score_function == "sigmoid" and topk > 1:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    top = top * (1.0 if scaling_factor is None else scaling_factor)
    return torch.zeros_like(s).scatter(1, idx, top), torch.zeros_like(s, dtype=torch.bool).scatter(1, idx, True)


def _inputs(device="cpu", tokens=64, experts=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g) * 0.3
    return logits.to(device), bias.to(device)


def _route(logits, case, bias, fused):
    sf, pre, use_bias, ng, gk, scale, topk = case
    return topk_routing_with_score_function(logits, topk, sf, expert_bias=bias if use_bias else None,
                                            use_pre_softmax=pre, scaling_factor=scale, num_groups=ng, group_topk=gk,
                                            fused=fused)


@pytest.mark.parametrize("case", CASES + EXCLUDED)
def test_rule_against_a_model_of_te_kernel(case):
    sf, pre, use_bias, ng, gk, scale, topk = case
    logits, bias = _inputs(seed=3)
    probs, routing_map, scores = _route(logits, case, bias, fused=True)  # CPU: the torch ops
    assert scores is not None
    te_probs, te_map = _te_model(logits, topk, pre, ng, gk, scale, sf, bias if use_bias else None)
    allowed = te_routing_matches(sf, bias if use_bias else None, pre, ng)
    assert allowed is (case in CASES)
    if allowed:
        assert torch.equal(te_map, routing_map)
        torch.testing.assert_close(te_probs, probs, rtol=1e-6, atol=1e-7)
    else:
        assert not torch.equal(te_map, routing_map)


def test_flag_reaches_config_and_cpu_keeps_torch_ops():
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    base = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--num-experts", "4",
            "--micro-batch-size", "1", "--seq-length", "8", "--vocab-size", "64", "--mock-data", "--train-iters", "1",
            "--lr", "1e-3"]
    assert core_transformer_config_from_args(validate_args(parse_args(args=base + ["--moe-router-fusion"]))) \
        .moe_router_fusion is True
    assert core_transformer_config_from_args(validate_args(parse_args(args=base))).moe_router_fusion is False
    logits, _ = _inputs()
    assert not can_fuse_routing(logits, "softmax")  # CPU tensors: torch ops
    results = []
    for fused in (False, True):
        cfg = TransformerConfig(transformer_impl="local",
                                num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=8,
                                moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_router_fusion=fused)
        torch.manual_seed(0)
        router = TopKRouter(cfg, layer_number=1)
        init_weights(router)
        router.train()
        x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        probs, routing_map = router(x)
        (probs * torch.arange(8.0)).sum().backward()
        results.append((probs.detach(), routing_map, x.grad, router.weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("case", CASES)
def test_fused_equals_torch_routing(case):
    logits0, bias = _inputs("cuda", tokens=1000, experts=32, seed=5)
    assert can_fuse_routing(logits0, case[0], bias if case[2] else None, case[1], case[3])
    g = torch.randn(logits0.shape, generator=torch.Generator().manual_seed(7)).cuda()
    out = []
    for fused in (False, True):
        logits = logits0.clone().requires_grad_(True)
        probs, routing_map, scores = _route(logits, case, bias, fused)
        assert (scores is None) is fused
        (probs * g).sum().backward()
        out.append((probs.detach(), routing_map, logits.grad))
    (p0, m0, g0), (p1, m1, g1) = out
    assert m1.dtype == torch.bool and torch.equal(m1, m0)
    assert p1.dtype == torch.float32
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=max(1e-5 * g0.abs().max().item(), 1e-6))  # topk 1: ~0


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("score_function, expert_bias", [("softmax", False), ("sigmoid", True), ("softmax", True)])
def test_fused_router_equals_torch_router(score_function, expert_bias, monkeypatch):
    """TopKRouter with --moe-router-fusion on CUDA (aux loss and z-loss on): probs, routing map, the token counts
    of the bias update, and the gradients of the input and the router weight equal the torch router's (softmax
    with expert bias keeps the torch ops)."""
    import megatron.core.extensions.transformer_engine as te_ext

    calls = []
    fn = te_ext.te_fused_topk_with_score_function
    monkeypatch.setattr(te_ext, "te_fused_topk_with_score_function", lambda *a, **k: calls.append(1) or fn(*a, **k))
    results = []
    for fused in (False, True):
        cfg = TransformerConfig(transformer_impl="local",
                                num_layers=1, hidden_size=64, num_attention_heads=2, num_moe_experts=16,
                                moe_router_topk=4, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                                moe_router_score_function=score_function, moe_router_enable_expert_bias=expert_bias,
                                moe_router_fusion=fused)
        torch.manual_seed(0)
        router = TopKRouter(cfg, layer_number=1)
        init_weights(router)
        router = router.cuda().train()
        if expert_bias:
            router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 16, device="cuda"))
        x = torch.randn(128, 2, 64, generator=torch.Generator().manual_seed(1)).cuda().requires_grad_(True)
        probs, routing_map = router(x)
        (probs * torch.arange(16.0, device="cuda")).sum().backward()
        counts = router.local_tokens_per_expert.clone() if expert_bias else None
        results.append((probs.detach(), routing_map, x.grad, router.weight.grad, counts))
    (p0, m0, x0, w0, c0), (p1, m1, x1, w1, c1) = results
    fusable = not (score_function == "softmax" and expert_bias)
    assert len(calls) == (1 if fusable else 0)  # the fused router ran TE's kernel (once); the torch router never
    assert torch.equal(m1, m0)
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-6)
    for got, want in ((x1, x0), (w1, w0)):  # sums over experts with cancellation: tolerance relative to the scale
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    if expert_bias:
        assert torch.equal(c1, c0)
