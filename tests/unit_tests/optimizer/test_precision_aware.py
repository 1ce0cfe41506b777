"""The precision-aware optimizer (``--use-precision-aware-optimizer``, ``precision_aware.py``): FusedAdam's storage
rules (bf16 rounded, fp16 / fp8 scaled per tensor), fp32 states equal to torch's AdamW, optimizer-state and
main-grad bytes per parameter, 100 steps of bf16 moments within 1 % of fp32 moments, upstream's refusals, and
checkpoints (unscaled fp32 under upstream's keys; loads across precisions, said in one line) for the distributed
optimizer on 2 gloo ranks and Megatron-FSDP."""
import logging
import math
import os
from argparse import Namespace

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.precision_aware import (
    PrecisionAwareAdamW,
    checkpoint_state_dtypes,
    conversion_message,
    log_state_conversion,
    state_bytes,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config
from tests.unit_tests.optimizer.test_distrib_optimizer import _step as distrib_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


# ---- storage rules ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,stored,rng,rtol", [("bf16", torch.bfloat16, None, 2**-8),
                                                  ("fp16", torch.float16, 65504.0 / 2, 2**-10),
                                                  ("fp8", torch.float8_e4m3fn, 448.0, 2**-3)])
def test_scaled_state_round_trip(name, stored, rng, rtol):
    p = torch.nn.Parameter(torch.zeros(64))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=DTYPES[name], exp_avg_sq_dtype=DTYPES[name])
    # tiny magnitudes: fp16 / fp8 without a scale would flush most of them to zero
    values = torch.linspace(-1.0, 1.0, 64) * 3e-9
    values[5] = 0.0
    opt.set_scaled_state(p, "exp_avg", values)
    st = opt.state[p]
    assert st["exp_avg"].dtype == stored and st["exp_avg"].shape == (64,)
    if rng is None:
        assert "exp_avg_scale" not in st
    else:
        assert float(st["exp_avg_scale"]) == pytest.approx(3e-9 / rng, rel=1e-6)
        assert float(st["exp_avg"].float().abs().max()) == pytest.approx(rng, rel=rtol)
    back = opt.get_unscaled_state(p, "exp_avg")
    assert back.dtype == torch.float32 and back[5] == 0
    assert torch.allclose(back, values, rtol=rtol, atol=0), (back - values).abs().max()
    opt.set_scaled_state(p, "exp_avg", torch.zeros(64))  # absmax 0: scale 0, values 0 (as FusedAdam)
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg"), torch.zeros(64))
    # state_dict holds unscaled fp32 values and no scales; load_state_dict stores them in this precision again
    opt.set_scaled_state(p, "exp_avg", values)
    sd = opt.state_dict()
    assert sorted(sd["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    q = torch.nn.Parameter(torch.zeros(64))
    other = PrecisionAwareAdamW([q], exp_avg_dtype=DTYPES[name], exp_avg_sq_dtype=DTYPES[name])
    other.load_state_dict(sd)
    assert other.state[q]["exp_avg"].dtype == stored
    assert torch.equal(other.get_unscaled_state(q, "exp_avg"), back)


def test_fp32_states_equal_torch_adamw_and_bf16_grads_are_read_as_fp32():
    torch.manual_seed(0)
    init = [torch.randn(7, 5), torch.randn(11)]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    c = [torch.nn.Parameter(t.clone()) for t in init]
    for p in c:
        p.grad_dtype = torch.bfloat16  # as the distributed optimizer's main params with --main-grads-dtype bf16
    ref = torch.optim.AdamW(a, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    mine = PrecisionAwareAdamW(b, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    bf16_grads = PrecisionAwareAdamW(c, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        grads = [torch.randn_like(t).bfloat16() for t in init]
        for ps, as_bf16 in ((a, False), (b, False), (c, True)):
            for p, g in zip(ps, grads):
                p.grad = g.clone() if as_bf16 else g.float()
        ref.step()
        mine.step()
        bf16_grads.step()
        for x, y, z in zip(a, b, c):
            assert torch.equal(x, y) and torch.equal(x, z), step
    for x, y in zip(a, b):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[x][k], mine.state[y][k])
    assert float(mine.state[b[0]]["step"]) == 5.0
    assert not torch.equal(a[0], init[0])


# ---- bytes per parameter -------------------------------------------------------------------------------------------
def _dist_opt(cfg, seed, bf16=False, main_grads="fp32", moments="fp32", aware=True, lr=1e-2):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = build_gpt(cfg, seed)
    if bf16:
        model = model.bfloat16()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=bf16 and main_grads == "fp32"), model)
    ocfg = OptimizerConfig(lr=lr, clip_grad=1.0, use_distributed_optimizer=True, bf16=bf16,
                           use_precision_aware_optimizer=aware, main_grads_dtype=DTYPES[main_grads],
                           exp_avg_dtype=DTYPES[moments], exp_avg_sq_dtype=DTYPES[moments])
    return ddp, get_megatron_optimizer(ocfg, [ddp])


def _step(ddp, opt, seed, rank=0, ws=1):
    """One step on this rank's part of test_distrib_optimizer's fixed global batch (its helper); the global mean loss."""
    return distrib_step(ddp, opt, seed, rank, ws)


@pytest.mark.parametrize("moments,per_param", [("fp32", 8), ("bf16", 4), ("fp16", 4), ("fp8", 2)])
def test_optimizer_state_bytes_per_parameter(moments, per_param):
    cfg = tiny_config(moe=False, add_bias_linear=False)
    ddp, opt = _dist_opt(cfg, 1, moments=moments)
    _step(ddp, opt, 0)
    n = sum(p.numel() for p in ddp.module.parameters())
    scales = 0 if moments in ("fp32", "bf16") else 2 * 4 * len(opt.main_params)  # one fp32 scale per moment
    assert state_bytes(opt.optimizer) == per_param * n + scales
    for st in opt.optimizer.state.values():
        assert st["exp_avg"].element_size() == per_param // 2


@pytest.mark.parametrize("main_grads,per_param", [("fp32", 4), ("bf16", 2)])
def test_main_grad_bytes_per_parameter(main_grads, per_param):
    """--bf16 with --main-grads-dtype bf16: the optimizer steps from the bf16 reduced gradient (2 B per parameter)
    instead of an fp32 copy (4 B); the update is the same up to the rounding of the gradient."""
    cfg = tiny_config(moe=False, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16)
    ddp, opt = _dist_opt(cfg, 1, bf16=True, main_grads=main_grads, moments="bf16")
    _step(ddp, opt, 0)
    n = sum(p.numel() for p in ddp.module.parameters())
    grads = [m.grad for m in opt.main_params]
    assert {g.dtype for g in grads} == {torch.float32 if main_grads == "fp32" else torch.bfloat16}
    assert sum(g.numel() * g.element_size() for g in grads) == per_param * n


def test_100_steps_bf16_moments_within_1_percent_of_fp32_moments():
    """A tiny dense GPT learning a fixed set of 4 batches for 100 steps: the bf16-moment loss curve stays within 1 %
    of the fp32-moment one at every step, and the loss fell (the comparison is not of two flat curves)."""
    cfg = tiny_config(moe=False, add_bias_linear=False)
    curves = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: intra-op threads only contend (20x slower on a busy machine)
    try:
        for moments in ("fp32", "bf16"):
            ddp, opt = _dist_opt(cfg, 1, moments=moments, lr=3e-3)
            curves[moments] = [_step(ddp, opt, i % 4) for i in range(100)]
    finally:
        torch.set_num_threads(threads)
    fp32, bf16 = curves["fp32"], curves["bf16"]
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16))
    assert worst <= 0.01, worst
    assert fp32[-1] < 0.8 * fp32[0] and bf16[-1] < 0.8 * bf16[0], (fp32[0], fp32[-1], bf16[-1])
    assert fp32 != bf16  # the moments really were rounded


# ---- refusals (upstream's rules) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(use_precision_aware_optimizer=True), r"only supported with the distributed optimizer \(--use-distributed"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, optimizer="sgd"),
     r"only supported with optimizer 'adam' \(--optimizer\), got 'sgd'"),
    (dict(exp_avg_dtype=torch.bfloat16), r"exp_avg_dtype \(--exp-avg-dtype\) can only be fp32 without"),
    (dict(main_grads_dtype=torch.bfloat16), r"main_grads_dtype \(--main-grads-dtype\) can only be fp32 without"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, main_params_dtype=torch.float16),
     r"main_params_dtype \(--main-params-dtype\) fp16 is not implemented in this fork"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, exp_avg_sq_dtype="fp4"),
     r"exp_avg_sq_dtype \(--exp-avg-sq-dtype\): 'fp4' is not one of"),
])
def test_config_refusals_name_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(lr=1e-3, **kw)


def test_cli_flags():
    from megatron.training.arguments import optimizer_config_from_args, parse_args, validate_args

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
            "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --distributed-backend gloo").split()
    a = validate_args(parse_args(args=base + "--bf16 --use-distributed-optimizer --use-precision-aware-optimizer "
                                 "--main-grads-dtype bf16 --exp-avg-dtype fp8 --exp-avg-sq-dtype bf16".split()))
    assert (a.main_grads_dtype, a.exp_avg_dtype, a.exp_avg_sq_dtype) == (torch.bfloat16, torch.uint8, torch.bfloat16)
    assert a.accumulate_allreduce_grads_in_fp32 is False  # bf16 main grads: reduced in bf16, as upstream
    cfg = optimizer_config_from_args(a)
    assert cfg.use_precision_aware_optimizer and cfg.exp_avg_dtype == torch.uint8
    a = validate_args(parse_args(args=base + ["--bf16"]))
    assert a.accumulate_allreduce_grads_in_fp32 is True
    for extra, msg in (("--use-precision-aware-optimizer", "--use-distributed-optimizer"),
                       ("--exp-avg-dtype bf16", "can only be fp32 without use_precision_aware_optimizer"),
                       ("--bf16 --accumulate-allreduce-grads-in-fp32 --use-distributed-optimizer "
                        "--use-precision-aware-optimizer --main-grads-dtype bf16",
                        "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32")):
        with pytest.raises(SystemExit) as exc:
            validate_args(parse_args(args=base + extra.split()))
        assert msg in str(exc.value), str(exc.value)


# ---- loads across precisions ---------------------------------------------------------------------------------------
def test_checkpoint_state_dtypes_and_the_conversion_line(caplog):
    up = Namespace(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8)
    assert checkpoint_state_dtypes(up) == {"exp_avg": "bf16", "exp_avg_sq": "fp8"}
    assert checkpoint_state_dtypes({"use_precision_aware_optimizer": False, "exp_avg_dtype": torch.bfloat16}) == {
        "exp_avg": "fp32", "exp_avg_sq": "fp32"}
    assert checkpoint_state_dtypes(Namespace()) == {"exp_avg": "fp32", "exp_avg_sq": "fp32"}  # older / no flag
    same = {"exp_avg": "fp32", "exp_avg_sq": "fp32"}
    assert conversion_message(same, same) is None and conversion_message(None, same) is None
    p = torch.nn.Parameter(torch.zeros(3))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.precision_aware"):
        msg = log_state_conversion(opt, {"checkpoint_state_dtypes": same})
    assert msg == caplog.records[-1].getMessage() and len(caplog.records) == 1
    assert "exp_avg fp32 -> bf16, exp_avg_sq fp32 -> bf16" in msg and "converted on load" in msg
    torch_opt = torch.optim.AdamW([p])
    msg = log_state_conversion(torch_opt, {"checkpoint_state_dtypes": checkpoint_state_dtypes(up)})
    assert "exp_avg bf16 -> fp32, exp_avg_sq fp8 -> fp32" in msg


def _save_body(rank, ws, ckpt, out, kind):
    from megatron.core import dist_checkpointing

    cfg = tiny_config(moe=False, add_bias_linear=False)
    ddp, opt = _dist_opt(cfg, 1, moments="bf16")
    for i in range(3):
        _step(ddp, opt, i, rank, ws)
    sd = ddp.sharded_state_dict()
    osd = opt.sharded_state_dict(sd, metadata={"distrib_optim_sharding_type": kind})
    if kind == "fully_reshardable":  # upstream's keys, whole fp32 (unscaled) values
        for i, p in enumerate(opt.all_params):
            st = osd["param_state"][i]
            assert sorted(st) == ["exp_avg", "exp_avg_sq", "param"]
            for k, t in st.items():
                assert t.key.startswith(f"optimizer.state.{k}.") and t.data.dtype == torch.float32 and t.dtype == \
                    torch.float32
    dist_checkpointing.save({"model": sd, "optimizer": osd}, ckpt)
    state = {opt.param_to_name[s.model_param] + f"[{s.start}:{s.stop}]": {
        k: opt.optimizer.get_unscaled_state(m, k).clone() for k in ("exp_avg", "exp_avg_sq")}
        for s, m in zip(opt.slices, opt.main_params)}
    torch.save(state, os.path.join(out, f"state{rank}.pt"))


def _load_body(rank, ws, ckpt, out, kind, moments):
    from megatron.core import dist_checkpointing

    cfg = tiny_config(moe=False, add_bias_linear=False)
    ddp, opt = _dist_opt(cfg, 7, moments="fp32" if moments == "torch" else moments, aware=moments != "torch")
    assert isinstance(opt.optimizer, torch.optim.AdamW if moments == "torch" else PrecisionAwareAdamW)
    metadata = {"distrib_optim_sharding_type": kind,
                "checkpoint_state_dtypes": {"exp_avg": "bf16", "exp_avg_sq": "bf16"}}
    sd = ddp.sharded_state_dict()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("megatron.core.optimizer.precision_aware")
    log.addHandler(handler)
    try:
        osd = opt.sharded_state_dict(sd, is_loading=True, metadata=metadata)
    finally:
        log.removeHandler(handler)
    if rank == 0:
        mine = "fp32" if moments == "torch" else moments
        if mine == "bf16":
            assert records == []
        else:
            assert len(records) == 1 and f"exp_avg bf16 -> {mine}" in records[0].getMessage()
    else:
        assert records == []  # one line: rank 0's
    loaded = dist_checkpointing.load({"model": sd, "optimizer": osd}, ckpt)
    ddp.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    saved = {}
    for r in range(2):
        saved.update(torch.load(os.path.join(out, f"state{r}.pt"), weights_only=True))
    tol = {"torch": 0, "fp32": 0, "bf16": 0, "fp16": 2**-10, "fp8": 2**-3}[moments]
    for s, m in zip(opt.slices, opt.main_params):
        name = opt.param_to_name[s.model_param]
        whole = {k: torch.cat([v[k] for kk, v in sorted(saved.items(), key=lambda kv: int(kv[0].split("[")[1]
                                                                                             .split(":")[0]))
                               if kk.startswith(name + "[")]) for k in ("exp_avg", "exp_avg_sq")}
        for k in ("exp_avg", "exp_avg_sq"):
            got = (opt.optimizer.state[m][k] if moments == "torch" else opt.optimizer.get_unscaled_state(m, k))
            expect = whole[k][s.start:s.stop]
            if moments in ("bf16", "fp16", "fp8"):
                assert opt.optimizer.state[m][k].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                           "fp8": torch.float8_e4m3fn}[moments]
            # fp16 / fp8: relative rounding, and below the smallest normal of the scaled range (absmax / range x
            # 2^-14 for fp16, 2^-6 for fp8 e4m3) an absolute step of half its subnormal spacing
            sub = {"fp16": 2**-25 / (65504.0 / 2), "fp8": 2**-10 / 448.0}.get(moments, 0.0)
            err = (got - expect).abs()
            assert (err <= tol * expect.abs() + sub * expect.abs().max()).all(), (name, k, err.max())
    _step(ddp, opt, 3, rank, ws)  # the loaded state steps


@pytest.mark.parametrize("kind", ["fully_reshardable", "dp_reshardable", "fully_sharded_model_space"])
def test_bf16_moments_checkpoint_loads_into_every_precision(tmp_path, kind):
    """Saved with bf16 moments on 2 ranks (unscaled fp32 values under upstream's keys), loaded on 2 ranks into
    bf16 (exact), fp32 (exact: bf16 values are fp32 values), fp16 / fp8 moments (scaled) and a plain torch AdamW (the
    optimizer without the flag), each load across precisions saying so in one line (each layout with some)."""
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_save_body, 2, ckpt, str(tmp_path), kind)
    loads = {"fully_reshardable": ("bf16", "fp8", "torch"), "dp_reshardable": ("fp32",),
             "fully_sharded_model_space": ("fp16",)}[kind]
    for moments in loads:
        run_distributed(_load_body, 2, ckpt, str(tmp_path), kind, moments)


# ---- Megatron-FSDP --------------------------------------------------------------------------------------------------
def _fsdp_body(rank, ws, ckpt):
    from torch.distributed.tensor import DTensor

    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    cfg = tiny_config(moe=False, add_bias_linear=False)
    losses, opts, models = {}, {}, {}
    for moments in ("fp32", "bf16", "fp8"):
        model = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True),
                                         build_gpt(cfg, 1, meta=True))
        opt = get_megatron_optimizer(OptimizerConfig(
            lr=1e-2, adam_eps=1e-6, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
            exp_avg_dtype=DTYPES[moments], exp_avg_sq_dtype=DTYPES[moments]), [model])
        assert isinstance(opt.optimizer, PrecisionAwareAdamW)
        losses[moments] = []
        for i, (tok, lab) in enumerate(batches(3, 4, seed=5)):
            opt.zero_grad()
            loss = model(tok[rank * 2:(rank + 1) * 2], position_ids(2), labels=lab[rank * 2:(rank + 1) * 2]).mean()
            loss.backward()
            if hasattr(model, "finish_grad_sync"):
                model.finish_grad_sync()
            ok, norm, _ = opt.step()
            assert ok and math.isfinite(norm)
            losses[moments].append(float(loss))
        opts[moments], models[moments] = opt, model
        stored = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16,
                  torch.uint8: torch.float8_e4m3fn}[DTYPES[moments]]
        for p, st in opt.optimizer.state.items():
            assert isinstance(p, DTensor) and isinstance(st["exp_avg"], DTensor), type(st["exp_avg"])
            assert st["exp_avg"].to_local().dtype == stored and st["exp_avg"].shape == p.shape
    for m in ("bf16", "fp8"):
        assert all(abs(a - b) <= 0.02 * a for a, b in zip(losses["fp32"], losses[m])), losses
    # bf16 moments saved (fp32 values), loaded into the fp32-moment optimizer of another model copy: equal values
    sd = models["bf16"].sharded_state_dict()
    dist_checkpointing.save({"model": sd, "optimizer": opts["bf16"].sharded_state_dict(sd)}, ckpt)
    target, topt = models["fp32"], opts["fp32"]
    tsd = target.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": tsd, "optimizer": topt.sharded_state_dict(tsd, is_loading=True)}, ckpt)
    target.load_state_dict(loaded["model"])
    topt.load_state_dict(loaded["optimizer"])
    src = dict(zip([opts["bf16"].param_to_name[p] for p in opts["bf16"].model_params], opts["bf16"].get_parameters()))
    for p, name in zip(topt.get_parameters(), [topt.param_to_name[q] for q in topt.model_params]):
        for k in ("exp_avg", "exp_avg_sq"):
            want = opts["bf16"].optimizer.get_unscaled_state(src[name], k).to_local()
            got = topt.optimizer.state[p][k].to_local()
            assert got.dtype == torch.float32 and torch.equal(got, want), (name, k)


def test_megatron_fsdp_reduced_moments_train_and_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_fsdp_body, 2, ckpt)


# ---- through pretrain: save with bf16 moments and bf16 main grads, resume with fp32 moments ------------------------
def _pretrain_body(rank, ws, root):
    from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

    args = TINY + NO_DROPOUT + ["--bf16", "--use-distributed-optimizer", "--train-iters", 2, "--log-interval", 1]
    aware = ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
             "--exp-avg-sq-dtype", "bf16"]
    saved = _run(args + aware + ["--save", root, "--save-interval", 2])
    opt = saved.optimizer
    assert isinstance(opt.optimizer, PrecisionAwareAdamW)
    assert {m.grad.dtype for m in opt.main_params if m.grad is not None} == {torch.bfloat16}
    # --bf16: the fp32 mains kept as 16-bit remainders (store_param_remainders, upstream's default, no flag)
    assert opt.param_remainders and {m.dtype for m in opt.main_params} == {torch.bfloat16}
    want = {(s.model_param, s.start): {k: opt.optimizer.get_unscaled_state(m, k).clone()
                                       for k in ("exp_avg", "exp_avg_sq", "master_param")}
            for s, m in zip(opt.slices, opt.main_params)}
    want = {(opt.param_to_name[p], start): v for (p, start), v in want.items()}
    # every rank's slices: the resumed run (fp32 grad accumulation: DDP's buckets) may cut the index spaces
    # differently from the saving run (bf16 main grads), so slices are compared where they overlap
    import torch.distributed as dist

    gathered = [None] * ws
    dist.all_gather_object(gathered, want)
    want = {key: v for part in gathered for key, v in part.items()}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("megatron.core.optimizer.precision_aware")
    log.addHandler(handler)
    try:
        loaded = _run(args + ["--load", root, "--ckpt-step", 2])  # fp32 moments (no flag): converted on load
    finally:
        log.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    if rank == 0:
        assert len(lines) == 1 and "exp_avg bf16 -> fp32, exp_avg_sq bf16 -> fp32" in lines[0], lines
    else:
        assert lines == []
    lopt = loaded.optimizer
    assert type(lopt.optimizer) is torch.optim.AdamW
    compared = 0
    for s, m in zip(lopt.slices, lopt.main_params):
        name = lopt.param_to_name[s.model_param]
        for (wname, wstart), state in want.items():
            lo, hi = max(s.start, wstart), min(s.stop, wstart + state["exp_avg"].numel())
            if wname != name or lo >= hi:
                continue
            for k, v in state.items():
                got = m.detach() if k == "master_param" else lopt.optimizer.state[m][k]  # the fp32 mains: rebuilt
                got, v = got[lo - s.start : hi - s.start], v[lo - wstart : hi - wstart]
                assert got.dtype == torch.float32 and torch.equal(got, v), (k, (got - v).abs().max())
            compared += hi - lo
    assert compared == sum(s.stop - s.start for s in lopt.slices) > 0


def test_pretrain_resume_from_bf16_moments_into_fp32_moments(tmp_path):
    run_distributed(_pretrain_body, 2, str(tmp_path / "ckpt"))
