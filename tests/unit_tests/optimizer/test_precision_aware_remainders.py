"""``store_param_remainders`` (upstream's OptimizerConfig field, default True) under the precision-aware optimizer
with ``--bf16`` and the distributed optimizer: a bf16 weight's fp32 master kept as its low 16 bits (int16) beside
the weight (TE FusedAdam's rule), bit-exact rebuild, steps equal to whole fp32 mains, 2 B per parameter instead of 4,
and checkpoints holding fp32 masters under upstream's keys that interchange with runs without remainders."""
import os

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.precision_aware import main_param_bytes, merge_fp32, remainders_enabled, split_fp32
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import build_gpt, tiny_config
from tests.unit_tests.optimizer.test_distrib_optimizer import _step


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


def test_split_merge_is_bit_exact_with_te_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.logspace(-38, 38, 20000)
    special = [0.0, -0.0, float("inf"), -float("inf"), 3.3e38, -3.3e38, 1e-40, -1e-40, 1.0, -2.5]
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x407F8000], dtype=torch.int32).view(torch.float32)  # lo = 0x8000
    x = torch.cat([x, torch.tensor(special), ties])
    weight, rem = split_fp32(x)
    assert weight.dtype == torch.bfloat16 and rem.dtype == torch.int16 and weight.shape == rem.shape == x.shape
    assert torch.equal(_bits(merge_fp32(weight, rem)), _bits(x))  # every value, signs of zeros and infs included
    low = _bits(x) & 0xFFFF
    tie = low == 0x8000
    assert int(tie.sum()) >= 3
    assert torch.equal(weight[~tie].view(torch.int16), x[~tie].bfloat16().view(torch.int16))  # to nearest
    # ties: away from zero (the high half plus one), where a cast rounds to even
    assert weight[-3].item() == 1.0078125 and x[-3].bfloat16().item() == 1.0
    assert weight[-2].item() == 1.015625 and x[-2].bfloat16().item() == 1.015625
    assert weight[-1].item() == -1.0078125 and x[-1].bfloat16().item() == -1.0
    assert torch.equal(rem.to(torch.int32) & 0xFFFF, low)  # the low half, as it is
    x2 = torch.randn(3, 5, generator=g)
    assert torch.equal(merge_fp32(*split_fp32(x2)), x2)


@pytest.mark.parametrize("kw,on", [(dict(bf16=True), True), (dict(bf16=True, store_param_remainders=False), False),
                                   (dict(bf16=False), False)])
def test_remainders_follow_upstreams_conditions(kw, on):
    cfg = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, use_precision_aware_optimizer=True, **kw)
    assert cfg.store_param_remainders is kw.get("store_param_remainders", True)  # upstream's default
    assert remainders_enabled(cfg) is on
    assert not remainders_enabled(OptimizerConfig(lr=1e-3, bf16=True))  # only with the precision-aware optimizer


def _build(seed, remainders, overlap=False, moments="bf16"):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[moments]
    cfg = tiny_config(moe=False, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16)
    model = build_gpt(cfg, seed).bfloat16()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
        overlap_param_gather=overlap, bucket_size=4000 if overlap else None), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        lr=1e-2, clip_grad=1.0, bf16=True, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
        exp_avg_dtype=dt, exp_avg_sq_dtype=dt, store_param_remainders=remainders), [ddp])
    return ddp, opt


def _masters(opt) -> dict:
    return {(opt.param_to_name[s.model_param], s.start): opt._fp32_main(m).clone()
            for s, m in zip(opt.slices, opt.main_params)}


@torch.no_grad()
def _round_weights_as_remainders(opt) -> int:
    """A run with whole fp32 mains: set its bf16 weights to the masters rounded as the remainders' weights are (ties
    away from zero, where its cast rounded to even): every rank its own slices, summed over the 2 ranks (each
    element has one owner). Returns how many weight elements changed (the ties)."""
    import torch.distributed as dist

    opt._finish_param_gathers()
    changed = 0
    for p in opt.all_params:
        full = torch.zeros(p.numel(), dtype=torch.float32)
        for s, m in zip(opt.slices, opt.main_params):
            if s.model_param is p:
                full[s.start : s.stop] = split_fp32(m.detach())[0].float()
        dist.all_reduce(full)
        new = full.to(torch.bfloat16).view(p.shape)
        changed += int((new.view(torch.int16) != p.view(torch.int16)).sum())
        p.copy_(new)
    return changed


def _assert_same_run(a, b, step):
    (da, oa), (db, ob) = a, b
    ma, mb = _masters(oa), _masters(ob)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(_bits(ma[k]), _bits(mb[k])), (step, k)
    oa._finish_param_gathers()
    ob._finish_param_gathers()
    for (n, p), (_, q) in zip(da.module.named_parameters(), db.module.named_parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p.view(torch.int16), q.view(torch.int16)), (step, n)


def _exact_body(rank, ws):
    ties = 0
    for overlap in (False, True):
        runs = {r: _build(1, r, overlap) for r in (True, False)}
        opt = runs[True][1]
        assert opt.param_remainders and not runs[False][1].param_remainders
        for step in range(4):
            losses = {r: _step(ddp, o, step, rank, ws) for r, (ddp, o) in runs.items()}
            assert losses[True] == losses[False], (step, losses)
            # the masters' ties (low half 0x8000): the one place a cast to bf16 (to even) and the remainders'
            # weights (away from zero) differ; the reference takes the remainders' rounding for the comparison
            n_ties = sum(int(((_bits(m) & 0xFFFF) == 0x8000).sum()) for m in runs[False][1].main_params)
            changed = _round_weights_as_remainders(runs[False][1])
            assert changed <= int(_dp_total(n_ties)), (step, changed, n_ties)
            ties += changed
            _assert_same_run(runs[True], runs[False], step)
        # storage: each main is its weight's own slice (a view), the master's low half an int16 state
        owned = sum(m.numel() for m in opt.main_params)
        for s, m in zip(opt.slices, opt.main_params):
            assert m.dtype == torch.bfloat16 and m.data_ptr() == s.model_param.data_ptr() + 2 * s.start
            assert opt.optimizer.state[m]["master_param"].dtype == torch.int16
        assert main_param_bytes(opt.optimizer, opt.main_params) == 2 * owned
        ref = runs[False][1]
        assert main_param_bytes(ref.optimizer, ref.main_params) == 4 * owned
        assert any(int(opt.optimizer.state[m]["master_param"].count_nonzero()) > 0 for m in opt.main_params)
        # logged norms are those of the fp32 masters
        assert opt.get_params_norm() == ref.get_params_norm()
    assert ties > 0  # the comparison did meet ties (first Adam steps of size ~lr make them common)


def _dp_total(n: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([n])
    dist.all_reduce(t)
    return int(t)


def test_steps_with_remainders_equal_fp32_main_steps_bitwise():
    """2 gloo ranks, bf16 GPT, DDP + distributed optimizer (without and with --overlap-grad-reduce /
    --overlap-param-gather): 4 steps with remainders and with whole fp32 mains give bitwise equal losses and fp32
    masters, and bf16 weights equal but at ties of the master (low half 0x8000), which the remainders' weights round
    away from zero (TE's rule: the only rounding that 16 bits can undo) where a cast rounds to even; the reference
    takes that rounding after each step so the runs stay comparable."""
    run_distributed(_exact_body, 2)


def _save_body(rank, ws, root, remainders, kind):
    from megatron.core import dist_checkpointing

    ddp, opt = _build(1, remainders)
    for step in range(2):
        _step(ddp, opt, step, rank, ws)
    sd = ddp.sharded_state_dict()
    osd = opt.sharded_state_dict(sd, metadata={"distrib_optim_sharding_type": kind})
    if kind == "fully_reshardable":  # upstream's keys, fp32 values
        for st in osd["param_state"].values():
            assert sorted(st) == ["exp_avg", "exp_avg_sq", "param"]
            assert st["param"].key.startswith("optimizer.state.param.") and st["param"].data.dtype == torch.float32
    elif kind == "fully_sharded_model_space":  # this fork's older layout: its key for the fp32 main
        for st in osd["param_state"].values():
            assert sorted(st) == ["exp_avg", "exp_avg_sq", "fp32_param"] and st["fp32_param"].dtype == torch.float32
    dist_checkpointing.save({"model": sd, "optimizer": osd}, os.path.join(root, "ckpt"))
    torch.save(_masters(opt), os.path.join(root, f"masters{rank}.pt"))


def _load_body(rank, ws, root, kind):
    for remainders in (True, False):
        _load_one(rank, ws, root, remainders, kind)


def _load_one(rank, ws, root, remainders, kind):
    from megatron.core import dist_checkpointing

    ddp, opt = _build(7, remainders)  # another init: everything must come from the checkpoint
    sd = ddp.sharded_state_dict()
    osd = opt.sharded_state_dict(sd, is_loading=True, metadata={"distrib_optim_sharding_type": kind})
    loaded = dist_checkpointing.load({"model": sd, "optimizer": osd}, os.path.join(root, "ckpt"))
    ddp.load_state_dict(loaded["model"])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dp_reshardable: no "mains differ from the weights" warning
        opt.load_state_dict(loaded["optimizer"])
    saved = {}
    for r in range(ws):
        saved.update(torch.load(os.path.join(root, f"masters{r}.pt"), weights_only=True))
    mine = _masters(opt)
    assert mine.keys() == {k for k in saved if k in mine} and len(mine) > 0
    for k, v in mine.items():  # the same DP size: the same slices
        assert torch.equal(_bits(v), _bits(saved[k])), k
    if remainders:  # the weight slices hold the masters' high halves (rounded as the remainders' rule)
        for s, m in zip(opt.slices, opt.main_params):
            assert torch.equal(m.view(torch.int16), split_fp32(mine[(opt.param_to_name[s.model_param], s.start)])[0]
                               .view(torch.int16))
    # one more step from the loaded state: the same as a run without remainders loaded from the same checkpoint
    if not remainders:
        _round_weights_as_remainders(opt)  # (the weights' rounding at ties, see the exactness test)
    loss = _step(ddp, opt, 5, rank, ws)
    torch.save((loss, _masters(opt)), os.path.join(root, f"after_{remainders}_{rank}.pt"))


@pytest.mark.parametrize("saved_with,kind", [(True, "dp_reshardable"), (False, "fully_reshardable"),
                                             (True, "fully_sharded_model_space")])
def test_checkpoints_interchange_with_and_without_remainders(tmp_path, saved_with, kind):
    """Saved with (or without) remainders on 2 ranks: fp32 masters under upstream's keys (``param``), loaded
    bitwise into a run with and one without remainders; the next step is the same in both."""
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "ckpt"))
    run_distributed(_save_body, 2, root, saved_with, kind)
    run_distributed(_load_body, 2, root, kind)
    for rank in range(2):
        a = torch.load(os.path.join(root, f"after_True_{rank}.pt"), weights_only=True)
        b = torch.load(os.path.join(root, f"after_False_{rank}.pt"), weights_only=True)
        assert a[0] == b[0]
        for k in a[1]:
            assert torch.equal(_bits(a[1][k]), _bits(b[1][k])), k


def test_upstream_checkpoint_with_remainders_under_param_is_rebuilt():
    """Upstream with store_param_remainders saves TE FusedAdam's int16 remainder where the fp32 main belongs
    (``param``; as int16 or as float values): loaded after the model's bf16 weights, the masters are rebuilt from
    both, bitwise, into a run with and one without remainders, with one warning; real masters load as they are."""
    import warnings

    ddp, opt = _build(1, True)
    for step in range(2):
        _step(ddp, opt, step, 0, 1)
    want = _masters(opt)
    real = opt.state_dict()
    upstream_like = opt.state_dict()
    for i, m in enumerate(opt.main_params):
        rem = opt.optimizer.state[m]["master_param"]
        upstream_like["param_state"][i]["fp32_param"] = rem.float() if i % 2 else rem.clone()
    weights = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    for remainders in (True, False):
        for sd, rebuilt in ((upstream_like, True), (real, False)):
            ddp2, opt2 = _build(7, remainders)
            ddp2.module.load_state_dict(weights)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt2.load_state_dict(sd)
            lines = [str(w.message) for w in caught if "16-bit remainders" in str(w.message)]
            assert len(lines) == (1 if rebuilt else 0), lines
            if rebuilt:
                assert f"of {len(opt2.main_params)} bf16 parameter slices" in lines[0]
            got = _masters(opt2)
            for k in want:
                assert torch.equal(_bits(got[k]), _bits(want[k])), (remainders, rebuilt, k)
