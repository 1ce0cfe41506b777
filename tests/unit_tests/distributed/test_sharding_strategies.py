"""``--data-parallel-sharding-strategy`` under Megatron-FSDP (``wrap_data_parallel``), for real on 2 gloo ranks:
each strategy's 3 training steps equal plain DDP's (fp32), the per-rank sizes of parameters, gradients and
optimizer state show what it shards, meta init keeps values and expert_bias, and a checkpoint saved under one
strategy loads under the others."""
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    wrap_data_parallel,
)
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import (
    batches,
    build_gpt,
    check_expert_bias,
    full_tensor,
    position_ids,
    routers,
    set_expert_bias_sentinel,
    tiny_config,
)

GLOBAL_BATCH = 4
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
WRAPPER = {"no_shard": DistributedDataParallel, "optim": DistributedDataParallel,
           "optim_grads": FullyShardedDataParallel, "optim_grads_params": FullyShardedDataParallel}


def _wrap(cfg, strategy, model):
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy)
    return wrap_data_parallel(cfg, ddp_config, model)


def _opt(model):
    # adam_eps 1e-6 and no linear biases (the config below): see test_distrib_optimizer's equivalence test
    return get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0, adam_eps=1e-6), [model])


def _local_numel(t) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def _step(model, opt, seed, rank, ws, probe=None):
    opt.zero_grad()
    model.zero_grad_buffer()
    tok, lab = batches(1, GLOBAL_BATCH, seed=seed)[0]
    m = GLOBAL_BATCH // ws
    loss = model(tok[rank * m:(rank + 1) * m], position_ids(m), labels=lab[rank * m:(rank + 1) * m]).float().mean()
    if probe is not None:
        probe(model)  # between forward and backward
    loss.backward()
    model.finish_grad_sync()
    ok, norm, _ = opt.step()
    assert ok and math.isfinite(norm)
    t = loss.detach().reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / ws


def _sum_ranks(n: int) -> int:
    t = torch.tensor([n])
    dist.all_reduce(t)
    return int(t)


# ---- training equals DDP; what each strategy shards ------------------------------------------------------------
def _equivalence_body(rank, ws, strategy):
    cfg = tiny_config(moe=False, add_bias_linear=False)
    ref = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build_gpt(cfg, 1))
    ref_opt = _opt(ref)
    model = _wrap(cfg, strategy, build_gpt(cfg, 1))
    opt = _opt(model)
    assert type(model) is WRAPPER[strategy]
    assert type(opt) is (DistributedOptimizer if strategy == "optim" else MegatronOptimizer)
    whole = sum(p.numel() for p in ref.module.parameters())
    gathered = {}

    def probe(m):  # the first layer's fc1 weight as the forward left it
        w = m.module.decoder.layers[0].mlp.linear_fc1.weight
        gathered["fc1"] = (isinstance(w, DTensor), _local_numel(w), w.numel())

    for i in range(3):
        lr_, l = _step(ref, ref_opt, i, rank, ws), _step(model, opt, i, rank, ws, probe)
        assert abs(lr_ - l) <= 1e-5, (strategy, i, lr_, l)
    ref_params = dict(ref.module.named_parameters())
    for n, p in model.module.named_parameters():
        assert torch.allclose(full_tensor(p), ref_params[n], rtol=0, atol=1e-5), (strategy, n)
    assert any(not torch.allclose(p, q) for p, q in zip(build_gpt(cfg, 1).parameters(), ref.module.parameters()))

    params = sum(_local_numel(p) for p in model.module.parameters())
    grads = sum(_local_numel(p.grad) for p in model.module.parameters() if p.grad is not None)
    state = sum(_local_numel(v) for st in opt.state.values() for k, v in st.items() if k != "step")
    is_dtensor, fc1_local, fc1_whole = gathered["fc1"]
    if strategy == "no_shard":
        assert (params, grads, state) == (whole, whole, 2 * whole)
    elif strategy == "optim":  # ZeRO-1: full params and grads, 1/DP of the Adam state (exp_avg, exp_avg_sq)
        assert (params, grads) == (whole, whole)
        assert whole / ws - ws <= state / 2 <= math.ceil(whole / ws), (state, whole)
        assert _sum_ranks(state) == 2 * whole
    else:  # FSDP2: params (between steps), grads and state are this rank's dim-0 chunks
        assert params < whole and grads == params and state == 2 * params, (params, grads, state, whole)
        assert params <= 0.6 * whole  # about 1/2 (chunk rounding per parameter)
        assert _sum_ranks(params) == whole
    # after forward: ZeRO-2 keeps the layer's parameters gathered for backward, ZeRO-3 has resharded them
    if strategy == "optim_grads":
        assert (is_dtensor, fc1_local) == (False, fc1_whole)
    elif strategy == "optim_grads_params":
        assert is_dtensor and fc1_local == fc1_whole // ws
    else:
        assert (is_dtensor, fc1_local) == (False, fc1_whole)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_three_steps_equal_ddp_and_sizes_show_what_is_sharded(strategy):
    run_distributed(_equivalence_body, 2, strategy)


# ---- meta init; checkpoints across strategies ------------------------------------------------------------------
def _meta_model(cfg, strategy, seed):
    model = build_gpt(cfg, seed, meta=True)
    bias = set_expert_bias_sentinel(model)
    return _wrap(cfg, strategy, model), bias


def _ckpt_body(rank, ws, ckpt):
    from megatron.core import dist_checkpointing

    cfg = tiny_config(moe=True)
    eager = dict(build_gpt(cfg, 3).named_parameters())
    # meta init under the ZeRO-1 wrapper (DDP) and the ZeRO-2 one (FSDP2): eager values, expert_bias kept
    for strategy in ("optim", "optim_grads"):
        model, bias = _meta_model(cfg, strategy, 3)
        check_expert_bias(model.module, bias)
        for n, p in model.module.named_parameters():
            assert torch.equal(full_tensor(p), eager[n]), (strategy, n)
    saved, _ = _meta_model(cfg, "optim_grads_params", 3)
    opt = _opt(saved)
    for i in range(2):
        _step(saved, opt, i, rank, ws)
    want = {n: full_tensor(p).detach().clone() for n, p in saved.module.named_parameters()}
    assert any(not torch.equal(want[n], eager[n]) for n in want)  # trained: not the init values
    dist_checkpointing.save({"model": saved.sharded_state_dict()}, ckpt)
    for strategy in ("no_shard", "optim", "optim_grads"):
        model, _ = _meta_model(cfg, strategy, 7)  # another init: the values must come from the checkpoint
        for r in routers(model.module):
            r.expert_bias.zero_()
        sd = model.sharded_state_dict()
        assert {v.key for v in sd.values()} == {v.key for v in saved.sharded_state_dict().values()}
        model.load_state_dict(dist_checkpointing.load({"model": sd}, ckpt)["model"])
        for n, p in model.module.named_parameters():
            assert torch.equal(full_tensor(p), want[n]), (strategy, n)
        check_expert_bias(model.module, [r.expert_bias for r in routers(saved.module)])


def test_meta_init_and_checkpoint_saved_under_one_strategy_loads_under_the_others(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_ckpt_body, 2, ckpt)


def test_fsdp_wrapper_refuses_optim_strategy():
    cfg = tiny_config(moe=False)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim")
    with pytest.raises(ValueError, match="'optim' shards only the optimizer state: wrap with"):
        FullyShardedDataParallel(cfg, ddp_config, build_gpt(cfg, 0))
