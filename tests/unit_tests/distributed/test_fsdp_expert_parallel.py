"""Megatron-FSDP with expert parallelism on 4 gloo ranks (EP=2: EP groups [0, 1], [2, 3], expert-DP [0, 2], [1, 3]):
expert weights are FSDP2 units of the expert-data-parallel mesh, dense weights of the data-parallel mesh. From a
meta-device build (the router's ``expert_bias`` keeps its value) FSDP x EP equals DDP x EP, eagerly initialised, in
the initial weights, the losses, the clipped gradient norms and the weights after 3 steps (fp32). Checkpoints saved
under FSDP x EP load under (TP, EP, expert-DP, DP) = (1, 1, 4, 4) FSDP, (2, 2, 1, 2) FSDP and (1, 2, 2, 4) DDP."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, full_tensor, position_ids, routers, tiny_config

GLOBAL_BATCH = 8
EXPERTS = 4


def _config(ep, tp=1, **kw):
    return tiny_config(moe=True, num_moe_experts=EXPERTS, moe_ffn_hidden_size=10, gated_linear_unit=True,
                       expert_model_parallel_size=ep, tensor_model_parallel_size=tp,
                       moe_token_dispatcher_type="alltoall", **kw)


def _build(wrapper, ep, tp=1, seed=5, meta=False, instances=1):
    """``(model, optimizer)`` at (TP, EP) with ``instances`` distributed-optimizer instances (hybrid sharding);
    ``wrapper``: 'fsdp', 'ddp' or 'distopt' (DDP + the distributed optimizer); clipping at 0.05 (the norm
    matters)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.unit_tests.distributed._common import build_gpt

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             num_distributed_optimizer_instances=instances)
    model_parallel_cuda_manual_seed(seed)
    cfg = _config(ep, tp, init_model_with_meta_device=meta)
    model = build_gpt(cfg, seed, meta=meta)
    for r in routers(model):  # a real (non-meta) buffer even in a meta build: must survive materialisation
        with torch.no_grad():
            r.expert_bias.copy_(torch.tensor([0.03, -0.01, 0.02, 0.0]))
    fsdp, distopt = wrapper == "fsdp", wrapper == "distopt"
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=fsdp, use_distributed_optimizer=distopt,
                                               data_parallel_sharding_strategy="optim_grads_params" if fsdp else "no_shard")
    model = wrap_data_parallel(cfg, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.05, adam_eps=1e-6,
                                                 use_distributed_optimizer=distopt), [model])
    return model, opt


def _train(model, opt, steps, seed=1234):
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.expert_bias import update_expert_bias

    dp, n = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    per = GLOBAL_BATCH // n
    out = []
    for tok, lab in batches(steps, GLOBAL_BATCH, seed=seed):
        opt.zero_grad()
        loss = model(tok[dp * per:(dp + 1) * per], position_ids(per), labels=lab[dp * per:(dp + 1) * per]).mean()
        loss.backward()
        finalize_model_grads([model])
        ok, norm, _ = opt.step()
        assert ok
        update_expert_bias(model.module, parallel_state.get_data_parallel_group())
        out.append((float(loss), norm))
    return out


def _full_state(model):
    return {k: full_tensor(v).detach().clone() for k, v in model.module.state_dict().items()
            if not k.endswith("_extra_state")}


@torch.no_grad()
def _eval(model, seed=99):
    tok, lab = batches(1, GLOBAL_BATCH, seed=seed)[0]
    return float(model(tok, position_ids(GLOBAL_BATCH), labels=lab).mean())


def _save(model, opt, path):
    from tests.unit_tests.tensor_parallel._tp_common import save_model_and_optimizer

    save_model_and_optimizer(model, opt, path)


def _load(model, opt, path):
    from megatron.core import dist_checkpointing

    sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": sd, "optimizer": opt.sharded_state_dict(sd, is_loading=True)}, path)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def train_alike(ref, ref_opt, model, opt, steps=3):
    """``steps`` clipped steps of both: equal losses and gradient norms, equal weights after; returns
    ``(ref state, state)`` (full tensors)."""
    ref_steps, got = _train(ref, ref_opt, steps), _train(model, opt, steps)
    for (l_ref, n_ref), (l, n) in zip(ref_steps, got):
        assert l == pytest.approx(l_ref, rel=1e-5) and n == pytest.approx(n_ref, rel=1e-5), (ref_steps, got)
    assert all(n > 0.05 for _, n in got)  # every step was clipped: the norm decides the update
    ref_state, state = _full_state(ref), _full_state(model)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
    return ref_state, state


def save_and_resume_elsewhere(model, opt, path, layouts, check=None):
    """Save ``model``/``opt`` at ``path``; for each ``layouts`` entry (``_build`` keyword arguments) a model built
    with other weights loads it: its eval loss, then one more step's gradient norm and eval loss, equal the saving
    run's (``check(model)`` runs right after each load)."""
    _save(model, opt, path)
    before = _eval(model)
    (_, norm), = _train(model, opt, 1, seed=7)
    after = _eval(model)
    for kw in layouts:
        other, o = _build(seed=77, **kw)  # other weights: all must come from the checkpoint
        o.init_state()
        _load(other, o, path)
        assert _eval(other) == pytest.approx(before, rel=1e-5, abs=1e-6), kw
        if check is not None:
            check(other)
        (_, n), = _train(other, o, 1, seed=7)
        assert n == pytest.approx(norm, rel=1e-6), kw  # (a one-rank expert mesh once divided twice: 0.97x)
        assert _eval(other) == pytest.approx(after, rel=1e-5, abs=1e-6), kw


def _body(rank, world_size, tmp):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from megatron.core import parallel_state
    from megatron.core.distributed import FullyShardedDataParallel

    ref, ref_opt = _build("ddp", ep=2)
    ref_init = _full_state(ref)
    fsdp, opt = _build("fsdp", ep=2, meta=True)
    assert isinstance(fsdp, FullyShardedDataParallel) and parallel_state.get_expert_data_parallel_world_size() == 2
    experts = fsdp.module.decoder.layers[0].mlp.experts
    assert isinstance(experts, FSDPModule)
    edp_ranks = sorted(dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group()))
    assert edp_ranks == [rank % 2, rank % 2 + 2]
    for n, p in fsdp.module.named_parameters():
        assert isinstance(p, DTensor), n
        mesh_ranks = sorted(dist.get_process_group_ranks(p.device_mesh.get_group()))
        assert mesh_ranks == (edp_ranks if ".experts." in n else [0, 1, 2, 3]), (n, mesh_ranks)
    got = _full_state(fsdp)
    assert got.keys() == ref_init.keys()
    for k, v in ref_init.items():  # meta init == eager init, expert_bias kept
        assert torch.equal(got[k], v), k
    assert torch.equal(routers(fsdp.module)[0].expert_bias, torch.tensor([0.03, -0.01, 0.02, 0.0]))

    ref_state, state = train_alike(ref, ref_opt, fsdp, opt)
    assert not torch.equal(ref_state["decoder.layers.0.mlp.router.expert_bias"], ref_init[
        "decoder.layers.0.mlp.router.expert_bias"])  # the bias was updated, equally
    moved = [k for k in ref_state if ".experts." in k and not torch.equal(ref_state[k], ref_init[k])]
    assert moved, "no expert weight was trained"
    def bias_loaded(model):
        assert torch.equal(routers(model.module)[0].expert_bias, state["decoder.layers.0.mlp.router.expert_bias"])

    # the same checkpoint under other layouts: the eval loss, then one more step, equal the saving run's
    save_and_resume_elsewhere(fsdp, opt, os.path.join(tmp, "fsdp_ep2"),
                              [dict(wrapper="fsdp", tp=1, ep=1), dict(wrapper="fsdp", tp=2, ep=2),
                               dict(wrapper="ddp", tp=1, ep=2)], check=bias_loaded)


def test_fsdp_ep_equals_ddp_ep_and_checkpoints_reshard(tmp_path):
    run_distributed(_body, 4, str(tmp_path))


def _distopt_body(rank, world_size, tmp):
    """The distributed optimizer under EP=2: expert weights sharded over expert-DP, equal to DDP x EP after 3 clipped
    steps; its checkpoint loads at EP=1 (expert-DP 4) with the same eval loss and next step."""
    from megatron.core.optimizer import DistributedOptimizer

    ref, ref_opt = _build("ddp", ep=2)
    model, opt = _build("distopt", ep=2)
    assert isinstance(opt, DistributedOptimizer)
    assert [(sp.expert, sp.size) for sp in opt.spaces] == [(False, world_size), (True, world_size // 2)]
    train_alike(ref, ref_opt, model, opt)
    if tmp is not None:
        save_and_resume_elsewhere(model, opt, os.path.join(tmp, "distopt_ep2"), [dict(wrapper="distopt", ep=1)])


def test_distributed_optimizer_with_expert_parallelism(tmp_path):
    run_distributed(_distopt_body, 4, str(tmp_path))
    run_distributed(_distopt_body, 2, None)  # expert-DP of one rank: experts are not reduced, only divided by DP
