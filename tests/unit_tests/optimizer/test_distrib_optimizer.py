"""DistributedOptimizer (``--use-distributed-optimizer`` under DDP), for real on gloo ranks: per-rank state is 1/DP
of the whole, 5 steps equal the replicated optimizer's (fp32), and a checkpoint saved on 2 ranks loads on 4 and
on 1 (stacked MoE layout + gated fc1) with equal params and an equal next step."""
import math
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config

GLOBAL_BATCH = 4


def _build(cfg, seed, distributed: bool, lr=1e-2):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                  build_gpt(cfg, seed))
    opt = get_megatron_optimizer(OptimizerConfig(lr=lr, clip_grad=1.0, use_distributed_optimizer=distributed), [ddp])
    return ddp, opt


def _step(ddp, opt, seed, rank, ws):
    """One step on this rank's part of a fixed global batch; returns the global mean loss."""
    opt.zero_grad()
    ddp.zero_grad_buffer()
    tok, lab = batches(1, GLOBAL_BATCH, seed=seed)[0]
    m = GLOBAL_BATCH // ws
    loss = ddp(tok[rank * m:(rank + 1) * m], position_ids(m), labels=lab[rank * m:(rank + 1) * m]).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, norm, _ = opt.step()
    assert ok and math.isfinite(norm)
    t = loss.detach().reshape(1).clone()
    if ws > 1:
        dist.all_reduce(t)
    return float(t) / ws


def _owned(opt):
    return sum(m.numel() for m in opt.main_params)


# ---- equivalence with the replicated optimizer, state size ----------------------------------------------------
def _equivalence_body(rank, ws):
    # no linear biases: the key part of the qkv bias has a zero gradient in exact arithmetic, so its gradient is
    # rounding noise, which Adam normalises into full-size steps (and a reduce-scatter rounds differently from an
    # all-reduce): that would compare noise, not the optimizer
    cfg = tiny_config(moe=False, add_bias_linear=False)
    a, oa = _build(cfg, 1, distributed=False)
    b, ob = _build(cfg, 1, distributed=True)
    assert type(oa) is MegatronOptimizer and isinstance(ob, DistributedOptimizer)
    whole = sum(p.numel() for p in b.module.parameters())
    for i in range(5):
        la, lb = _step(a, oa, i, rank, ws), _step(b, ob, i, rank, ws)
        assert abs(la - lb) <= 1e-6, (i, la, lb)
        for (n, p), q in zip(a.module.named_parameters(), b.module.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-6), (i, n, (p - q).abs().max())
    # the parameters moved (not a vacuous equality)
    ref = build_gpt(cfg, 1)
    assert any(not torch.allclose(p, q) for p, q in zip(ref.parameters(), b.module.parameters()))
    # per-rank state: fp32 main slices, exp_avg and exp_avg_sq, each 1/ws of the whole (the last rank less padding)
    owned = _owned(ob)
    assert whole / ws - ws <= owned <= math.ceil(whole / ws), (owned, whole, ws)
    state = sum(v.numel() for st in ob.state.values() for k, v in st.items() if k != "step")
    assert state == 2 * owned
    full_state = sum(v.numel() for st in oa.state.values() for k, v in st.items() if k != "step")
    assert full_state == 2 * whole
    total = torch.tensor([owned])
    dist.all_reduce(total)
    assert int(total) == whole  # the slices partition the parameters
    # the sharded exp_avg equals the replicated optimizer's, slice by slice
    rep = {n: oa.state[p] for n, p in a.module.named_parameters()}  # fp32: the model params are optimised
    name_b = {p: n for n, p in b.module.named_parameters()}
    for s, main in zip(ob.slices, ob.main_params):
        full = rep[name_b[s.model_param]]["exp_avg"].reshape(-1)[s.start:s.stop]
        assert torch.allclose(ob.state[main]["exp_avg"], full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("ws", [2, 4])
def test_matches_replicated_optimizer_and_state_is_sharded(ws):
    run_distributed(_equivalence_body, ws)


# ---- checkpoint: save on 2 ranks, load on 4 and on 1 ------------------------------------------------------------
def _ckpt_cfg(kind=None):
    # no biases: see _equivalence_body; dp_reshardable: dense, MoE in its _chained case
    return tiny_config(moe=kind != "dp_reshardable", gated_linear_unit=True, add_bias_linear=False)


def _full_params(ddp):
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _metadata(kind):
    if kind and kind.endswith("_chained"):
        # upstream's layout under expert parallelism (its experts in an optimizer of their own), here at EP=1
        from megatron.core.optimizer import distrib_optimizer

        distrib_optimizer._upstream_expert_layout = lambda: True  # this test process only
        kind = kind[: -len("_chained")]
    return None if kind is None else {"distrib_optim_sharding_type": kind}


def _save_body(rank, ws, ckpt, out, kind=None):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from megatron.core.optimizer import distrib_optimizer

    distrib_optimizer.GATHER_CHUNK_NUMEL = 13  # whole states gathered in many uneven pieces (this process only)
    ddp, opt = _build(_ckpt_cfg(kind), 1, distributed=True)
    for i in range(3):
        _step(ddp, opt, i, rank, ws)
    sd = ddp.sharded_state_dict()
    osd = opt.sharded_state_dict(sd, metadata=_metadata(kind))
    if kind == "dp_reshardable":
        assert osd["param_state_sharding_type"] == kind
        _check_dp_reshardable(opt, osd)
    elif kind == "dp_reshardable_chained":  # as upstream's ChainedOptimizer: {0: dense, 1: expert}, keys prefixed
        assert sorted(osd) == [0, 1]
        for i, (expert, part) in enumerate(((False, osd[0]), (True, osd[1]))):
            assert part["param_state_sharding_type"] == "dp_reshardable"
            assert {g["is_expert_parallel"] for g in part["optimizer"].data["param_groups"]} == {expert}
            keys = {t.key for t in nested_values(part) if hasattr(t, "key")}
            assert keys and all(k.startswith(f"chained_{i}.optimizer.distributed.dp_group_idx_0.") for k in keys)
    elif kind and kind.startswith("fully_reshardable"):  # whole fp32 states named like the parameter, main = param
        _check_fully_reshardable(opt, osd, sd, chained=kind.endswith("chained"))
    else:
        assert osd["param_state_sharding_type"] == "fully_sharded_model_space"
        keys = {t.key for st in osd["param_state"].values() for t in st.values()}
        assert any(k.startswith("optimizer.state.exp_avg.decoder.layers.") for k in keys)
    dist_checkpointing.save({"model": sd, "optimizer": osd}, ckpt)
    saved = _full_params(ddp)
    loss = _step(ddp, opt, 3, rank, ws)
    if rank == 0:
        torch.save({"saved": saved, "after": _full_params(ddp), "loss": loss}, os.path.join(out, "ref.pt"))


def _check_fully_reshardable(opt, osd, sd, chained: bool):
    """``chained`` (upstream's layout of MoE under expert parallelism): as its ChainedOptimizer, {0: the dense part,
    1: the expert part}, each with its own param groups; else one part. Every parameter has ``param`` /
    ``exp_avg`` / ``exp_avg_sq`` whole, fp32, with the parameter's placement and replica id, and this rank's slices
    of them are its own state."""
    from megatron.core.dist_checkpointing import ShardedTensorFactory

    assert sorted(osd) == ([0, 1] if chained else ["optimizer", "param_state", "param_state_sharding_type"])
    where = {}
    for part, expert in ((osd[0], False), (osd[1], True)) if chained else ((osd, None),):
        assert part["param_state_sharding_type"] == "fully_reshardable"
        if chained:
            assert {g["is_expert_parallel"] for g in part["optimizer"]["param_groups"]} == {expert}
        assert {g["step"] for g in part["optimizer"]["param_groups"]} == {3}
        params = [p for p in opt.all_params if expert is None or getattr(p, "allreduce", True) != expert]
        assert len(part["param_state"]) == len(params) > 0
        for i, p in enumerate(params):
            st = where[p] = part["param_state"][i]
            assert sorted(st) == ["exp_avg", "exp_avg_sq", "param"]
            msh = opt._param_sharded_tensor(p, sd)
            for k, t in st.items():
                assert t.key == f"optimizer.state.{k}.{msh.key}" and t.replica_id == msh.replica_id
                assert t.data.shape == p.shape and t.data.dtype == torch.float32
                if not isinstance(t, ShardedTensorFactory):
                    assert t.global_shape == msh.global_shape and t.global_offset == msh.global_offset
    assert len(where) == len(opt.all_params)
    for s, main in zip(opt.slices, opt.main_params):
        assert torch.equal(where[s.model_param]["param"].data.reshape(-1)[s.start:s.stop], main.detach())
        assert torch.equal(where[s.model_param]["exp_avg"].data.reshape(-1)[s.start:s.stop], opt.state[main]["exp_avg"])


def _check_dp_reshardable(opt, osd):
    """Upstream's bucket-space keys: per state one 1-D fp32 tensor of the bucket's unpadded size, this rank's part
    of its 1/DP range, holding its own slices' state at upstream's offsets."""
    (buf,) = opt._upstream_buffers(None)  # one dtype, no overlap-grad-reduce: one buffer of one bucket
    (bucket,) = buf.buckets
    prefix = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
    tensors = osd["param_state"][0][(torch.float32, torch.float32)][0]
    assert sorted(tensors) == ["exp_avg", "exp_avg_sq", "param"]
    lo = tensors["param"].global_offset[0]
    for k, t in tensors.items():
        assert t.key == f"{prefix}.{k}" and t.global_shape == (bucket.numel_unpadded,) and t.data.dtype == torch.float32
    assert lo == opt.dp_rank * bucket.numel // opt.dp_size
    assert osd["param_state"]["per_bucket_numel_unpadded"].data == [{buf.dtype_key: [bucket.numel_unpadded]}]
    whole = opt._gathered_whole_state()  # (checked against the owned slices by the fully_reshardable case)
    hi = lo + tensors["param"].data.numel()
    covered = 0
    for p, start, end in bucket.params:
        a, b = max(start, lo), min(end, hi)
        if a < b:
            covered += b - a
            for saved, key in (("param", "fp32_param"), ("exp_avg_sq", "exp_avg_sq")):
                expected = whole[p][key].reshape(-1)[a - start:b - start]
                assert torch.equal(tensors[saved].data[a - lo:b - lo], expected), (saved, a, b)
    assert covered > 0


def _load_body(rank, ws, ckpt, out, kind=None):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    ddp, opt = _build(_ckpt_cfg(kind), 7, distributed=True)  # another init: everything must come from the checkpoint
    sd = ddp.sharded_state_dict()
    osd = opt.sharded_state_dict(sd, is_loading=True, metadata=_metadata(kind))
    factories = torch.tensor([sum(isinstance(t, ShardedTensorFactory) for t in nested_values(osd))])
    dist.all_reduce(factories)
    # the gated fc1 state goes through its factory (model-space layouts)
    assert int(factories) > 0 or kind.startswith("dp_reshardable")
    loaded = dist_checkpointing.load({"model": sd, "optimizer": osd}, ckpt)
    ddp.load_state_dict(loaded["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dp_reshardable: the loaded mains are the loaded weights (no warning)
        opt.load_state_dict(loaded["optimizer"])
    ref = torch.load(os.path.join(out, "ref.pt"), weights_only=True)
    for n, p in ddp.module.named_parameters():
        assert torch.equal(p, ref["saved"][n]), n
    whole = sum(p.numel() for p in ddp.module.parameters())
    assert whole / ws - ws <= _owned(opt) <= math.ceil(whole / ws)
    assert opt._step_count == 3
    loss = _step(ddp, opt, 3, rank, ws)
    assert loss == pytest.approx(ref["loss"], rel=1e-6)
    for n, p in ddp.module.named_parameters():
        # an Adam step from the restored state: equal up to reduction-order rounding of the gradients
        assert torch.allclose(p, ref["after"][n], rtol=0, atol=1e-6), (n, (p - ref["after"][n]).abs().max())
    moved = max(float((ref["after"][n] - ref["saved"][n]).abs().max()) for n in ref["saved"])
    assert moved > 1e-4


@pytest.mark.parametrize("kind", [None, "fully_reshardable", "fully_reshardable_chained", "dp_reshardable",
                                  "dp_reshardable_chained"])
def test_checkpoint_saved_on_2_ranks_loads_on_4_and_1(tmp_path, kind):
    """Every layout: upstream's default without metadata (``fully_sharded_model_space``), ``fully_reshardable``
    (what ``--dist-ckpt-optim-fully-reshardable`` writes) and ``dp_reshardable`` (upstream's training default;
    another DP size loads it, the buckets being the same); ``_chained``: MoE as upstream's chained dense + expert
    optimizers under expert parallelism."""
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_save_body, 2, ckpt, str(tmp_path), kind)
    for ws in (4, 1):
        run_distributed(_load_body, ws, ckpt, str(tmp_path), kind)


def test_refuses_ddp_without_the_flag():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = tiny_config(moe=False)
    plain = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build_gpt(cfg, 0))
    with pytest.raises(ValueError, match="ddp_config.use_distributed_optimizer=True"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [plain])
    sharding = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                       build_gpt(cfg, 0))
    with pytest.raises(ValueError, match="OptimizerConfig.use_distributed_optimizer is False"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3), [sharding])


def _reload_body(rank, ws):
    """After the model alone is loaded (--no-load-optim / --finetune), reload_model_params refreshes the fp32
    slices; without it the next step would all-gather the stale slices over the loaded weights."""
    cfg = tiny_config(moe=False)
    ddp, opt = _build(cfg, 1, distributed=True, lr=0.0)
    loaded = build_gpt(cfg, 2)  # stands for the weights a checkpoint load wrote into the model
    with torch.no_grad():
        for p, q in zip(ddp.module.parameters(), loaded.parameters()):
            p.copy_(q)
    opt.reload_model_params()
    _step(ddp, opt, 0, rank, ws)  # lr 0: the parameters must stay the loaded ones
    for (n, p), q in zip(ddp.module.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), n


def test_reload_model_params_after_a_model_only_load():
    run_distributed(_reload_body, 2)


def test_dp_reshardable_refusals_name_the_layout():
    """A checkpoint whose buckets differ from this model's layout is refused naming both; unknown layouts by
    name."""
    ddp, opt = _build(tiny_config(moe=False), 1, distributed=True)
    sd = opt.sharded_state_dict(ddp.sharded_state_dict(), metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    mine = sd["param_state"]["per_bucket_numel_unpadded"].data
    sd["optimizer"] = sd["optimizer"].data
    sd["param_state"] = {"per_bucket_numel_unpadded": [{(torch.float32, torch.float32): [123]}]}
    with pytest.raises(ValueError, match=r"dp_reshardable\): its buckets hold .*123.*upstream's layout of this model"):
        opt.load_state_dict(sd)
    ((key, (unpadded,)),) = mine[0].items()  # one fp32 buffer of one bucket: every parameter, 64-aligned
    params = list(ddp.parameters())
    assert key == (torch.float32, torch.float32) and len(mine) == 1
    assert sum(p.numel() for p in params) <= unpadded < sum(p.numel() for p in params) + 64 * len(params)
    with pytest.raises(ValueError, match="distrib_optim_sharding_type 'dp_zero_gather_scatter' is not supported"):
        opt.sharded_state_dict(ddp.sharded_state_dict(), metadata={"distrib_optim_sharding_type":
                                                                   "dp_zero_gather_scatter"})


def test_param_groups_pair_by_identity_not_position():
    """A checkpoint whose param groups come in another order (another model's parameter order) restores each
    group's hyper-parameters into the group with the same wd_mult / lr_mult / expert / decoupled-lr identity."""
    ddp, opt = _build(tiny_config(moe=False), 1, distributed=True)
    sd = opt.state_dict()
    groups = sd["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    for g in groups:
        g["eps"] = 1e-3 if g["wd_mult"] else 1e-5  # tells the groups apart after the load
        g["step"] = 4
    groups.reverse()
    before = [g["wd_mult"] for g in opt.optimizer.param_groups]  # the groups' parameters decide their wd_mult
    opt.load_state_dict(sd)
    assert [g["wd_mult"] for g in opt.optimizer.param_groups] == before == [1.0, 0.0]
    assert [g["eps"] for g in opt.optimizer.param_groups] == [1e-3, 1e-5]
    assert opt._step_count == 4


def test_dp_reshardable_warns_when_loaded_mains_are_not_the_weights(tmp_path):
    """dp_reshardable is keyed by offsets only; a load whose fp32 mains differ from the (loaded) weights, as a
    misplaced layout would give, is named in a warning (here: the weights were not loaded from the checkpoint)."""
    from megatron.core import dist_checkpointing

    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    ddp, opt = _build(tiny_config(moe=False), 1, distributed=True)
    dist_checkpointing.save({"optimizer": opt.sharded_state_dict(ddp.sharded_state_dict(), metadata=metadata)},
                            str(tmp_path))
    other, opt2 = _build(tiny_config(moe=False), 5, distributed=True)
    osd = opt2.sharded_state_dict(other.sharded_state_dict(), is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load({"optimizer": osd}, str(tmp_path))
    with pytest.warns(UserWarning, match=r"dp_reshardable\): the loaded fp32 main params of \d+ parameter slices"):
        opt2.load_state_dict(loaded["optimizer"])
    for p, q in zip(ddp.module.parameters(), other.module.parameters()):  # the mains went into the weights anyway
        assert torch.equal(p, q)
