"""Router z-loss (--moe-z-loss-coeff): coeff x mean over tokens of logsumexp(logits)^2, its gradient reaching the
router weight through the aux-loss path (the forward output unchanged), logged without the coefficient."""
import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import TopKRouter
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, reduce_moe_losses, z_loss_func

W = torch.tensor([[0.5, -1.0, 0.25], [0.0, 2.0, -0.5], [1.5, 0.5, 0.0], [-1.0, 0.0, 1.0]])  # [E=4, h=3]
X = torch.tensor([[1.0, 0.5, -1.0], [0.0, 1.0, 2.0]])  # 2 tokens


@pytest.fixture(autouse=True)
def _aux_scale_one():
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    reduce_moe_losses(["z_loss", "load_balancing_loss"], 1, 1, 1)  # clear what other tests recorded
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def _router(coeff, **kw):
    cfg = TransformerConfig(transformer_impl="local",
                            num_layers=1, hidden_size=3, num_attention_heads=1, num_moe_experts=4,
                            moe_router_topk=2, moe_z_loss_coeff=coeff, **kw)
    r = TopKRouter(cfg, layer_number=1)
    with torch.no_grad():
        r.weight.copy_(W)
    return r


def _by_hand(w):
    logits = X @ w.t()
    lse = [torch.log(torch.exp(row).sum()) for row in logits]
    return sum(v**2 for v in lse) / len(lse)  # mean of logsumexp^2, without the coefficient


def test_z_loss_value_and_log():
    assert float(z_loss_func(X @ W.t(), 0.1)) == pytest.approx(0.1 * float(_by_hand(W)), rel=1e-6)
    router = _router(0.1)
    router(X)
    router(X)  # two micro-batches
    logged, per_layer = reduce_moe_losses(["z_loss"], num_layers=1, num_moe_layers=1, num_microbatches=2)
    assert logged["z_loss"] == pytest.approx(float(_by_hand(W)), rel=1e-6)  # the mean, without the coefficient
    assert per_layer["z_loss"] == [pytest.approx(logged["z_loss"])]
    assert reduce_moe_losses(["z_loss"], 1, 1, 1) == ({"z_loss": 0.0}, {"z_loss": [0.0]})  # cleared


def test_per_layer_values_and_mean_over_moe_layers():
    """Layers 1 and 3 of 3 are MoE layers: per layer [z1, 0, z3] (--moe-per-layer-logging), scalar (z1 + z3) / 2."""
    first, third = _router(0.1), _router(0.1)
    third.layer_number = 3
    with torch.no_grad():
        third.weight.mul_(2.0)
    first(X)
    third(X)
    scalars, per_layer = reduce_moe_losses(["z_loss"], num_layers=3, num_moe_layers=2, num_microbatches=1)
    z1, z3 = float(_by_hand(W)), float(_by_hand(2 * W))
    assert per_layer["z_loss"] == [pytest.approx(z1, rel=1e-6), 0.0, pytest.approx(z3, rel=1e-6)]
    assert scalars["z_loss"] == pytest.approx((z1 + z3) / 2, rel=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
def test_z_loss_gradient(per_token):
    coeff = 0.05
    router = _router(coeff, calculate_per_token_loss=per_token)
    probs, _ = router(X)
    torch.autograd.backward(probs, torch.zeros_like(probs))  # only the aux path sends gradient
    w = W.clone().requires_grad_()
    (coeff * _by_hand(w)).backward()
    scale = X.shape[0] if per_token else 1  # per-token: divided by the global token count later, as upstream
    torch.testing.assert_close(router.weight.grad, w.grad * scale, rtol=1e-5, atol=1e-7)
    # the probs themselves are those without z-loss
    plain = _router(None)
    torch.testing.assert_close(probs.detach(), plain(X)[0].detach(), rtol=0, atol=0)


def test_no_z_loss_without_coeff_or_in_eval():
    for router in (_router(None), _router(0.1).eval()):
        probs, _ = router(X)
        if probs.requires_grad:
            torch.autograd.backward(probs, torch.zeros_like(probs))
            assert router.weight.grad is None or not router.weight.grad.any()
    assert reduce_moe_losses(["z_loss"], 1, 1, 1)[0] == {"z_loss": 0.0}
    with pytest.raises(ValueError, match=r"moe_z_loss_coeff \(--moe-z-loss-coeff=-1.0\) must be >= 0"):
        _router(-1.0)
