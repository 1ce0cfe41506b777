"""Expert capacity (--moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity, --moe-token-drop-policy):
exactly the tokens over capacity are dropped under both policies, padding gives every expert its capacity, the MoE
layer's output is the per-token reference over the kept routes with both dispatchers, EP=2 equals EP=1."""
import math

import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, get_capacity
from megatron.core.transformer.utils import init_weights
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.transformer.moe.test_moe_layer import per_token_reference


def _routing(t=10, e=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    top = logits.topk(k, dim=1)
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter(1, top.indices, True)
    probs = torch.zeros(t, e).scatter(1, top.indices, torch.softmax(top.values, dim=1))
    return probs, routing_map


def _reference_keep(probs, routing_map, capacity, policy):
    """Per expert, by hand: its routed tokens ranked by prob (descending) or position; the first ``capacity``."""
    keep = torch.zeros_like(routing_map)
    for e in range(routing_map.shape[1]):
        tokens = routing_map[:, e].nonzero().flatten().tolist()
        if policy == "probs":
            tokens.sort(key=lambda t: -float(probs[t, e]))
        keep[tokens[:capacity], e] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 0.75, 1.0])
def test_dropped_tokens_are_exactly_those_over_capacity(policy, factor):
    probs, routing_map = _routing()
    capacity = get_capacity(10 * 2, 4, factor)
    assert capacity == math.ceil(20 / 4 * factor)
    new_probs, new_map = apply_router_token_dropping(probs, routing_map, 2, factor, policy)
    expected = _reference_keep(probs, routing_map, capacity, policy)
    assert torch.equal(new_map, expected)
    assert torch.equal(new_probs, probs * expected)
    assert int(new_map.sum(0).max()) <= capacity
    assert int(routing_map.sum()) > int(new_map.sum())  # something was dropped (the test can fail)
    if factor == 0.5:  # 'probs' and 'position' keep different tokens here
        other = apply_router_token_dropping(probs, routing_map, 2, factor,
                                            "position" if policy == "probs" else "probs")[1]
        assert not torch.equal(other, new_map)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_pad_to_capacity_gives_every_expert_its_capacity(policy):
    probs, routing_map = _routing()
    capacity = get_capacity(20, 4, 0.75)
    new_probs, new_map = apply_router_token_dropping(probs, routing_map, 2, 0.75, policy, pad_to_capacity=True)
    assert new_map.sum(0).tolist() == [capacity] * 4
    kept = _reference_keep(probs, routing_map, capacity, policy)
    assert torch.equal(new_map & routing_map, kept)  # the routed tokens kept are those without padding
    assert torch.equal(new_probs, probs * new_map) and float(new_probs[new_map & ~routing_map].abs().sum()) == 0.0
    # capacity above the token count: nothing dropped, every token padded into every expert (upstream's rule)
    all_probs, all_map = apply_router_token_dropping(probs, routing_map, 2, 4.0, policy, pad_to_capacity=True)
    assert bool(all_map.all()) and torch.equal(all_probs, probs)
    assert torch.equal(apply_router_token_dropping(probs, routing_map, 2, 4.0, policy)[1], routing_map)


def _layer(dispatcher, **kw):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                               moe_router_topk=2, ffn_hidden_size=24, moe_token_dispatcher_type=dispatcher, **kw)
    layer = MoELayer(config)
    init_weights(layer)
    return layer


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_moe_layer_with_capacity_matches_per_token_reference(dispatcher, pad, policy):
    layer = _layer(dispatcher, moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=pad,
                   moe_token_drop_policy=policy)
    x = torch.randn(5, 3, 16)
    seen = []
    layer.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    out, _ = layer(x)
    probs, routing_map = layer.router(x)
    capacity = get_capacity(15 * 2, 4, 0.5)
    assert int(routing_map.sum(0).max()) <= capacity
    tokens_per_expert = seen[0]
    if pad:
        assert tokens_per_expert.tolist() == [capacity] * 4
    else:
        assert tokens_per_expert.tolist() == routing_map.sum(0).tolist() and int(tokens_per_expert.sum()) < 30
    torch.testing.assert_close(out.reshape(-1, 16), per_token_reference(layer, x, probs, routing_map), rtol=1e-5,
                               atol=1e-6)
    out.sum().backward()  # dropped / padded routes have no gradient problem


def test_capacity_config_errors_name_the_flags():
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4)
    with pytest.raises(ValueError, match=r"--moe-pad-expert-input-to-capacity\) needs moe_expert_capacity_factor"):
        TransformerConfig(**base, moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError, match=r"--moe-token-drop-policy"):
        TransformerConfig(**base, moe_expert_capacity_factor=1.0, moe_token_drop_policy="random")
    assert TransformerConfig(**base, moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None


def _ep_body(rank, world_size):
    from megatron.core import parallel_state

    for dispatcher in ("alltoall", "allgather"):
        outs = []
        for ep in (1, 2):
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
            layer = _layer(dispatcher, expert_model_parallel_size=ep, moe_expert_capacity_factor=0.5,
                           moe_pad_expert_input_to_capacity=True)
            torch.manual_seed(100 + rank)  # every rank its own tokens (capacity: of this rank's tokens)
            x = torch.randn(5 - rank, 3, 16, requires_grad=True)
            out, _ = layer(x)
            out.square().sum().backward()
            outs.append((out.detach(), x.grad.clone()))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5, msg=dispatcher)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5, msg=dispatcher)


def test_ep2_equals_ep1_with_capacity_and_padding():
    run_distributed(_ep_body, 2)


def test_capacity_flags_reach_the_config():
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from tests.unit_tests.training.test_training import TINY

    argv = TINY + ["--train-iters", 1, "--num-experts", 4, "--moe-expert-capacity-factor", 1.5,
                   "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy", "position"]
    cfg = core_transformer_config_from_args(validate_args(parse_args(args=[str(a) for a in argv])))
    assert (cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity, cfg.moe_token_drop_policy) == (
        1.5, True, "position")
