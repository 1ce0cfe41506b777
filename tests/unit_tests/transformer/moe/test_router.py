import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import MoELayer, TopKRouter, topk_routing_with_score_function
from megatron.core.transformer.moe.expert_bias import update_expert_bias
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.transformer.utils import init_weights
from tests.unit_tests.dist_utils import run_distributed


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                ffn_hidden_size=24)
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def _router(seed=0, **kw):
    torch.manual_seed(seed)
    r = TopKRouter(_cfg(**kw))
    init_weights(r)
    return r


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_topk_selection_and_probs(score_function):
    torch.manual_seed(0)
    logits = torch.randn(32, 6)
    probs, routing_map, scores = topk_routing_with_score_function(logits, 2, score_function)
    ref_scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    torch.testing.assert_close(scores, ref_scores)
    top = torch.topk(ref_scores, 2, dim=-1).indices
    expect_map = torch.zeros_like(routing_map).scatter(1, top, True)
    assert torch.equal(routing_map, expect_map)
    assert (routing_map.sum(-1) == 2).all()
    # combine weights: selected unbiased scores, normalised over the top-k; zero elsewhere
    sel = torch.gather(ref_scores, 1, top)
    expect = torch.zeros_like(probs).scatter(1, top, sel / sel.sum(-1, keepdim=True))
    torch.testing.assert_close(probs, expect)
    assert (probs[~routing_map] == 0).all()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_expert_bias_affects_selection_only(score_function):
    torch.manual_seed(1)
    logits = torch.randn(64, 4)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # forces expert 3 into every token's top-2
    p0, m0, s0 = topk_routing_with_score_function(logits, 2, score_function)
    p1, m1, s1 = topk_routing_with_score_function(logits, 2, score_function, expert_bias=bias)
    assert m1[:, 3].all()
    assert not m0[:, 3].all()
    assert torch.equal(s0, s1)  # scores are unbiased
    # probs of the biased selection are computed from the UNBIASED scores of the chosen experts
    top = m1.nonzero()[:, 1].view(-1, 2)
    sel = torch.gather(s0, 1, top)
    expect = torch.zeros_like(p1).scatter(1, top, sel / sel.sum(-1, keepdim=True))
    torch.testing.assert_close(p1, expect)
    # rows whose selection did not change have identical probs
    same = (m0 == m1).all(-1)
    assert same.any()
    torch.testing.assert_close(p0[same], p1[same])


def test_router_buffers_counts_accumulate_in_training_only():
    r = _router(moe_router_enable_expert_bias=True)
    assert r.expert_bias.dtype == torch.float32 and torch.equal(r.expert_bias, torch.zeros(4))
    assert "expert_bias" in r.state_dict() and "local_tokens_per_expert" not in r.state_dict()
    x = torch.randn(10, 3, 16)
    r.eval()
    r(x)
    assert r.local_tokens_per_expert.sum() == 0
    r.train()
    probs, routing_map = r(x)
    r(x)
    assert probs.shape == (30, 4) and routing_map.dtype == torch.bool
    assert r.local_tokens_per_expert.sum().item() == 2 * 30 * 2
    assert torch.equal(r.local_tokens_per_expert, 2 * routing_map.sum(0).float())


def test_no_expert_bias_buffers_when_disabled():
    r = _router()
    assert r.expert_bias is None and r.local_tokens_per_expert is None
    assert set(r.state_dict()) == {"weight"}


def test_get_updated_expert_bias_direction_and_magnitude():
    counts = torch.tensor([10.0, 2.0, 6.0, 6.0])  # mean 6
    bias = torch.tensor([0.5, -0.5, 0.25, 0.0])
    new = get_updated_expert_bias(counts, bias, 0.01)
    torch.testing.assert_close(new, bias + torch.tensor([-0.01, 0.01, 0.0, 0.0]), rtol=0, atol=0)


def test_update_expert_bias_single_process():
    torch.manual_seed(0)
    layer = MoELayer(_cfg(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.125))
    init_weights(layer)
    r = layer.router
    r.local_tokens_per_expert.copy_(torch.tensor([9.0, 1.0, 5.0, 5.0]))
    update_expert_bias([layer], None)
    assert torch.equal(r.expert_bias, torch.tensor([-0.125, 0.125, 0.0, 0.0]))
    assert torch.equal(r.local_tokens_per_expert, torch.zeros(4))
    r.local_tokens_per_expert.copy_(torch.tensor([1.0, 9.0, 5.0, 5.0]))
    update_expert_bias(layer, None)  # a single module is accepted too
    assert torch.equal(r.expert_bias, torch.zeros(4))


def _allreduce_body(rank, world_size):
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = MoELayer(_cfg(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.5))
    init_weights(layer)
    r = layer.router
    local = [torch.tensor([10.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 2.0, 5.0, 5.0])][rank]
    r.local_tokens_per_expert.copy_(local)
    # alone, rank 0 would move experts 2 and 3 up (local mean 3); the global counts [10, 2, 6, 6] say: unchanged
    update_expert_bias([layer], dist.group.WORLD)
    assert torch.equal(r.expert_bias, torch.tensor([-0.5, 0.5, 0.0, 0.0])), r.expert_bias
    assert torch.equal(r.local_tokens_per_expert, torch.zeros(4))
    # default group (the data-parallel group) gives the same
    r.local_tokens_per_expert.copy_(local)
    update_expert_bias([layer])
    assert torch.equal(r.expert_bias, torch.tensor([-1.0, 1.0, 0.0, 0.0]))
    gathered = [torch.zeros(4) for _ in range(world_size)]
    dist.all_gather(gathered, r.expert_bias)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def test_update_expert_bias_allreduces_counts_2_ranks():
    run_distributed(_allreduce_body, 2)


def test_expert_bias_real_under_meta_device():
    with torch.device("meta"):
        r = TopKRouter(_cfg(moe_router_enable_expert_bias=True))
    assert r.weight.is_meta
    for buf in (r.expert_bias, r.local_tokens_per_expert):
        assert not buf.is_meta and buf.device.type == "cpu"
        assert torch.equal(buf, torch.zeros(4))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_seq_aux_loss_is_the_mean_of_each_sequences_switch_loss(score_function):
    """--moe-router-load-balancing-type seq_aux_loss (DeepSeek-V2): input [s, b, h]; the switch loss computed over
    each sequence's tokens alone, averaged over the b sequences; logged as seq_load_balancing_loss."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, reduce_moe_losses

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    reduce_moe_losses(["seq_load_balancing_loss"], 1, 1, 1)
    try:
        coeff, s, b = 0.1, 6, 3
        r = _router(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=coeff,
                    moe_router_score_function=score_function)
        x = torch.randn(s, b, 16)
        r(x)
        per_seq = []
        with torch.no_grad():
            for j in range(b):
                logits = x[:, j] @ r.weight.t()
                scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
                chosen = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=-1).indices, 1.0)
                if score_function == "sigmoid":
                    scores = scores / scores.sum(-1, keepdim=True)
                f = chosen.sum(0) / (s * 2)
                per_seq.append(4 * (f * scores.mean(0)).sum())
        want = float(torch.stack(per_seq).mean())
        assert float(r.last_aux_loss) == pytest.approx(coeff * want, rel=1e-5)
        assert reduce_moe_losses(["seq_load_balancing_loss"], 1, 1, 1)[0]["seq_load_balancing_loss"] == pytest.approx(
            want, rel=1e-5)
        # one sequence: the plain switch loss
        plain = _router(moe_aux_loss_coeff=coeff, moe_router_score_function=score_function)
        plain.weight.data.copy_(r.weight.data)
        plain(x[:, :1])
        r(x[:, :1])
        assert float(r.last_aux_loss) == pytest.approx(float(plain.last_aux_loss), rel=1e-6)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def test_force_load_balancing_routes_by_random_logits_with_straight_through_grad():
    """--moe-router-force-load-balancing (upstream's benchmark option): the logits are random normal values (the
    weights do not matter), the gradient reaches the router weight as if they were the real logits."""
    r = _router(moe_router_force_load_balancing=True)
    x = torch.randn(32, 16)
    torch.manual_seed(7)
    probs, routing_map = r(x)
    torch.manual_seed(7)
    random_logits = torch.randn(32, 4).requires_grad_()
    want_probs, want_map, _ = topk_routing_with_score_function(random_logits, 2, "softmax")
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)
    assert torch.equal(routing_map, want_map)
    g = torch.randn(32, 4)
    (probs * g).sum().backward()
    (want_probs * g).sum().backward()
    torch.testing.assert_close(r.weight.grad, random_logits.grad.t() @ x, rtol=1e-5, atol=1e-6)
    assert routing_map.sum(0).min() > 0  # every expert gets tokens


@pytest.mark.parametrize("limit_groups", [False, True])
def test_aux_loss_counts_the_unbiased_topk_as_upstream(limit_groups):
    """The load-balancing loss counts the top-k of the unbiased scores (upstream's compute_routing_scores_for_aux_loss):
    an expert bias (or group-limited routing) that moves the routing leaves the loss as it was without it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    try:
        kw = dict(moe_aux_loss_coeff=0.1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        if limit_groups:
            kw.update(moe_router_num_groups=2, moe_router_group_topk=1)
        plain = _router(**{**kw, "moe_router_enable_expert_bias": False, "moe_router_num_groups": None,
                           "moe_router_group_topk": None})
        biased = _router(**kw)
        biased.weight.data.copy_(plain.weight.data)
        biased.expert_bias.copy_(torch.tensor([5.0, -5.0, -5.0, -5.0]))  # expert 0 always chosen
        x = torch.randn(16, 16)
        _, plain_map = plain(x)
        _, biased_map = biased(x)
        assert not torch.equal(plain_map, biased_map)  # the routing did move
        assert float(biased.last_aux_loss) == pytest.approx(float(plain.last_aux_loss), rel=1e-6)
        with torch.no_grad():  # the formula with the unbiased choice
            scores = torch.sigmoid(x @ plain.weight.t())
            chosen = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=-1).indices, 1.0)
            scores = scores / scores.sum(-1, keepdim=True)
            want = 0.1 * 4 * ((chosen.sum(0) / (16 * 2)) * scores.mean(0)).sum()
        assert float(biased.last_aux_loss) == pytest.approx(float(want), rel=1e-5)
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved
