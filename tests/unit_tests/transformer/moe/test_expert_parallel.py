"""Expert parallelism on real gloo ranks: EP=2 (both token dispatchers) equals EP=1 on the same weights, in the
outputs, the input and parameter gradients (also after the DDP reduction, expert parameters over the expert-DP group)
and the expert-bias update."""
import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed


def _config(ep, dispatcher):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(transformer_impl="local",
                             num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                             moe_router_topk=2, ffn_hidden_size=24, add_bias_linear=True, gated_linear_unit=True,
                             moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                             moe_aux_loss_coeff=0.01, expert_model_parallel_size=ep,
                             moe_token_dispatcher_type=dispatcher)


def _run(ep, dispatcher, rank):
    """Layer (seed 0, expert_bias set), per-rank tokens -> (layer, output, input grad, DDP-reduced grads)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.moe import MoELayer
    from megatron.core.transformer.utils import init_weights

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    torch.manual_seed(0)
    config = _config(ep, dispatcher)
    layer = MoELayer(config)
    init_weights(layer)
    layer.router.expert_bias.copy_(torch.tensor([0.05, -0.02, 0.0, 0.01]))
    torch.manual_seed(100 + rank)  # every rank its own tokens; rank 1 routes fewer tokens (uneven splits)
    x = torch.randn(5 - rank, 3, 16, requires_grad=True)
    w = torch.randn(5 - rank, 3, 16)
    out, _ = layer(x)
    (out * w).sum().backward()
    local_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), layer)
    ddp.finish_grad_sync()
    return layer, out.detach(), x.grad.clone(), local_grads, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _global_name(name, ep_rank, local):
    if name.startswith("experts.local_experts."):
        i, rest = name[len("experts.local_experts."):].split(".", 1)
        return f"experts.local_experts.{ep_rank * local + int(i)}.{rest}"
    return name


def _body(rank, world_size):
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.transformer.moe import update_expert_bias

    for dispatcher in ("alltoall", "allgather"):
        ref, ref_out, ref_dx, ref_local, ref_ddp = _run(1, dispatcher, rank)
        update_expert_bias(ref)
        layer, out, dx, local, ddp = _run(2, dispatcher, rank)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        assert ep_rank == rank % 2 and layer.num_local_experts == 2
        assert layer.local_expert_indices == [2 * ep_rank, 2 * ep_rank + 1]
        # init does not depend on EP: local expert i is global expert 2 * ep_rank + i of the EP=1 layer
        ref_params = dict(ref.named_parameters())
        for n, p in layer.named_parameters():
            assert torch.equal(p.detach(), ref_params[_global_name(n, ep_rank, 2)].detach()), n
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
        for n in sorted(ref_local):  # an EP rank's expert gathers the tokens of the whole EP group: their sum
            if n.startswith("experts."):
                dist.all_reduce(ref_local[n], group=parallel_state.get_expert_model_parallel_group())
        for n, g in local.items():
            expected = ref_local[_global_name(n, ep_rank, 2)]
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5, msg=f"{dispatcher} local grad {n}")
        for n, g in ddp.items():
            torch.testing.assert_close(g, ref_ddp[_global_name(n, ep_rank, 2)], rtol=1e-5, atol=1e-5,
                                       msg=f"{dispatcher} DDP grad {n}")
        assert any(g.abs().sum() > 0 for n, g in ddp.items() if n.startswith("experts."))
        counts = layer.router.local_tokens_per_expert.clone()
        update_expert_bias(layer)
        torch.testing.assert_close(layer.router.expert_bias, ref.router.expert_bias, rtol=0, atol=0)
        assert not torch.equal(ref.router.expert_bias, torch.tensor([0.05, -0.02, 0.0, 0.01]))
        assert counts.sum() == (5 - rank) * 3 * 2 and layer.router.local_tokens_per_expert.sum() == 0


@pytest.mark.parametrize("world_size", [4])
def test_ep2_equals_ep1_both_dispatchers(world_size):
    """4 ranks: EP groups [0, 1], [2, 3]; expert-DP groups [0, 2], [1, 3] (the DDP expert reduction)."""
    run_distributed(_body, world_size)


def _bad_layout(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import MoELayer

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"num_moe_experts \(3, --num-experts\) must be divisible by the expert"):
        MoELayer(TransformerConfig(transformer_impl="local",
                                   num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=3,
                                   moe_router_topk=1))
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=1 \(--expert-model-parallel-size\) differs"):
        MoELayer(TransformerConfig(transformer_impl="local",
                                   num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
                                   moe_router_topk=1))
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    cfg = TransformerConfig(transformer_impl="local",
                            num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=1,
                            expert_model_parallel_size=2)
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"process_group= cannot be combined with expert parallelism "
                                         r"\(--expert-model-parallel-size > 1\)"):
        FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), MoELayer(cfg),
                                 process_group=dist.group.WORLD)


def test_bad_expert_layouts_are_refused():
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(ValueError, match=r"expert_model_parallel_size=2 .* divide num_moe_experts \(3"):
        TransformerConfig(transformer_impl="local",
                          num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=3, moe_router_topk=1,
                          expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type .* got 'flex'"):
        TransformerConfig(transformer_impl="local",
                          num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=1,
                          moe_token_dispatcher_type="flex")
    run_distributed(_bad_layout, 2)
