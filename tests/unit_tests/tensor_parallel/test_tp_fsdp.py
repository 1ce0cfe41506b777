"""DDP and Megatron-FSDP with tensor parallelism on 4 gloo ranks (TP=2 x DP=2): FSDP shards each TP rank's pieces
over the data-parallel group only, and after 3 optimizer steps equals DDP (gradients reduced over DP only, sequence-
parallel grads summed over TP); meta-device init under TP materializes only meta tensors (the MoE router's
``expert_bias`` keeps its value) and equals eager init."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.expert_bias import update_expert_bias
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import check_expert_bias, routers, set_expert_bias_sentinel
from tests.unit_tests.tensor_parallel._tp_common import VOCAB, SEQ, build, make_config, position_ids

GLOBAL_BATCH = 4


def _opt(model):
    # clip_grad 0 here; the TP grad norm (each value counted once, summed over TP) is tested in test_tp_pretrain.py
    return get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.0, adam_eps=1e-6), [model])


def _batches(steps):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        t = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _moe_kw():
    return dict(num_moe_experts=3, moe_router_topk=2, moe_ffn_hidden_size=16, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.01, moe_router_score_function="sigmoid")


def _train(wrapper, steps=3):
    opt = _opt(wrapper)
    dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    per = GLOBAL_BATCH // dp_size
    sl = slice(dp * per, (dp + 1) * per)
    losses = []
    for tok, lab in _batches(steps):
        opt.zero_grad()
        loss = wrapper(tok[sl], position_ids(per), labels=lab[sl]).mean()
        loss.backward()
        finalize_model_grads([wrapper])
        ok, _, _ = opt.step()
        assert ok
        update_expert_bias(wrapper.module)
        losses.append(float(loss))
    return opt, losses


def _fsdp_equals_ddp_body(rank, ws, name, sp, moe):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    kw = _moe_kw() if moe else {}
    cfg = make_config(name, tp=2, sp=sp, **kw)
    model_parallel_cuda_manual_seed(3)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build(name, cfg, seed=3))
    assert ddp.process_group is parallel_state.get_data_parallel_group()
    model_parallel_cuda_manual_seed(3)
    fsdp = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True),
                                    build(name, cfg, seed=3, meta=True))
    assert fsdp.mesh.size() == 2  # the data-parallel dimension only
    _, ddp_losses = _train(ddp)
    opt, fsdp_losses = _train(fsdp)
    assert ddp_losses == pytest.approx(fsdp_losses, rel=1e-5, abs=1e-6)
    ddp_params = dict(ddp.module.named_parameters())
    for n, p in fsdp.module.named_parameters():
        assert isinstance(p, DTensor), n
        assert p.shape == ddp_params[n].shape, n  # the TP piece, sharded over DP
        torch.testing.assert_close(p.full_tensor(), ddp_params[n], rtol=1e-4, atol=2e-5, msg=lambda m: f"{n}: {m}")
        assert isinstance(opt.state[p]["exp_avg"], DTensor)
    # replicated parameters agree across TP ranks (same data, same reduced grads), split ones differ
    tp = parallel_state.get_tensor_model_parallel_group()
    for n, p in ddp.module.named_parameters():
        other = [torch.empty_like(p) for _ in range(2)]
        dist.all_gather(other, p.detach().contiguous(), group=tp)
        assert torch.equal(other[0], other[1]) != bool(getattr(p, "tensor_model_parallel", False)), n
    if moe:
        for a, b in zip(routers(ddp.module), routers(fsdp.module)):
            torch.testing.assert_close(a.expert_bias, b.expert_bias, rtol=0, atol=1e-6)
            assert a.expert_bias.abs().sum() > 0


@pytest.mark.parametrize("name,sp,moe", [("gqa_swiglu", True, False), ("mha_tied", False, True)])
def test_fsdp_tp_equals_ddp_tp(name, sp, moe):
    run_distributed(_fsdp_equals_ddp_body, 4, name, sp, moe)


def _meta_init_body(rank, ws):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = make_config("gqa_swiglu", tp=2, **_moe_kw())
    model_parallel_cuda_manual_seed(8)
    meta = build("gqa_swiglu", cfg, seed=8, meta=True)
    assert all(r.expert_bias.device.type == "cpu" for r in routers(meta))  # real even under the meta device
    eb = set_expert_bias_sentinel(meta)
    fsdp = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), meta)
    check_expert_bias(fsdp.module, eb)
    model_parallel_cuda_manual_seed(8)
    eager = build("gqa_swiglu", cfg, seed=8)
    eager_params = dict(eager.named_parameters())
    for n, p in fsdp.module.named_parameters():
        assert torch.equal(p.full_tensor(), eager_params[n]), f"meta init differs from eager init: {n}"
    fc1 = fsdp.module.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    assert fc1.shape[0] == 2 * 16 // 2 and fc1.tensor_model_parallel and fc1.partition_dim == 0


def test_meta_init_with_tp_keeps_expert_bias():
    run_distributed(_meta_init_body, 4)
