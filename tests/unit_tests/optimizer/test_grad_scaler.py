"""fp16 loss scaling: the scalers' rules (upstream's), the optimizer skipping a step on inf/nan (on any DP rank, also
with the distributed optimizer), and the scaler state in the optimizer's (sharded) state dict."""
import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config


def _dyn(**kw):
    args = dict(initial_scale=2.0**10, min_scale=4.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                hysteresis=1, device="cpu")
    args.update(kw)
    return DynamicGradScaler(**args)


def test_dynamic_scaler_backoff_growth_min_and_hysteresis():
    s = _dyn()
    s.update(True)
    assert float(s.scale) == 2.0**9  # an overflow halves the scale (hysteresis 1)
    for _ in range(2):
        s.update(False)
    assert float(s.scale) == 2.0**9  # not yet a whole window
    s.update(False)
    assert float(s.scale) == 2.0**10  # grows after loss_scale_window clean iterations
    s.update(False)
    s.update(True)  # an overflow resets the growth window
    s.update(False)
    s.update(False)
    assert float(s.scale) == 2.0**9
    for _ in range(20):
        s.update(True)
    assert float(s.scale) == 4.0  # never below min_scale
    assert float(s.inv_scale) == 0.25
    h = _dyn(hysteresis=2)
    h.update(True)
    assert float(h.scale) == 2.0**10  # the first overflow is tolerated
    h.update(True)
    assert float(h.scale) == 2.0**9
    h.update(True)
    assert float(h.scale) == 2.0**8  # the tracker is only reset by a growth


def test_scaler_state_round_trip_and_bad_state():
    s = _dyn()
    s.update(True)
    s.update(False)
    sd = s.state_dict()
    assert set(sd) == {"scale", "growth_tracker", "hysteresis_tracker"}  # upstream's keys
    t = _dyn()
    t.load_state_dict(sd)
    assert float(t.scale) == 2.0**9 and t._growth_tracker == 1 and t._hysteresis_tracker == 0
    t.update(False)
    t.update(False)
    assert float(t.scale) == 2.0**10  # the restored tracker completes the window
    with pytest.raises(KeyError, match="growth_tracker"):
        t.load_state_dict({"scale": torch.tensor([2.0])})
    with pytest.raises(ValueError, match="positive finite"):
        t.load_state_dict({"scale": torch.tensor([float("inf")]), "growth_tracker": 0, "hysteresis_tracker": 1})
    with pytest.raises(ValueError, match="--min-loss-scale"):
        _dyn(min_scale=2.0**11)
    with pytest.raises(ValueError, match="--hysteresis"):
        _dyn(hysteresis=0)


def test_constant_scaler_never_changes():
    c = ConstantGradScaler(128.0, device="cpu")
    for found in (True, True, False, True):
        c.update(found)
    assert float(c.scale) == 128.0 and c.state_dict() == {}
    assert isinstance(build_grad_scaler(OptimizerConfig(lr=1.0, fp16=True, loss_scale=8.0)), ConstantGradScaler)
    dyn = build_grad_scaler(OptimizerConfig(lr=1.0, fp16=True))
    assert isinstance(dyn, DynamicGradScaler) and float(dyn.scale) == 2.0**32 and dyn.hysteresis == 2
    assert dyn.growth_interval == 1000 and float(dyn.min_scale) == 1.0  # upstream's defaults
    assert build_grad_scaler(OptimizerConfig(lr=1.0, bf16=True)) is None


def _fp16_model(seed=0):
    cfg = tiny_config(moe=False, fp16=True, params_dtype=torch.float16, add_bias_linear=False)
    return build_gpt(cfg, seed)


def _backward(model, opt, seed=0):
    tok, lab = batches(1, 2, seed=seed)[0]
    loss = model(tok, position_ids(2), labels=lab).float().mean()
    (loss * opt.get_loss_scale().reshape(())).backward()
    return loss


def test_fp16_overflow_skips_step_and_halves_scale():
    model = _fp16_model()
    cfg = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=2.0**8, hysteresis=1, loss_scale_window=2)
    opt = get_megatron_optimizer(cfg, model)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _backward(model, opt)
    model.output_layer.weight.grad[0, 0] = float("inf")  # a forced overflow
    assert opt.step() == (False, None, None)
    assert float(opt.get_loss_scale()) == 2.0**7
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert len(opt.state) == 0  # the inner optimizer never stepped
    for i in range(2):
        opt.zero_grad()
        _backward(model, opt, seed=i + 1)
        ok, norm, _ = opt.step()
        assert ok and math.isfinite(norm)
    assert float(opt.get_loss_scale()) == 2.0**8  # grew after the window of 2 clean steps
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    # the unscaled main grads: the same as an fp32 reference would see (up to fp16 rounding)
    sd = opt.state_dict()
    assert float(sd["grad_scaler"]["scale"]) == 2.0**8 and sd["grad_scaler"]["growth_tracker"] == 0


def test_fp16_grads_are_unscaled():
    model = _fp16_model(3)
    ref = _fp16_model(3)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.0, fp16=True, loss_scale=1024.0, clip_grad=0.0), model)
    _backward(model, opt)
    tok, lab = batches(1, 2, seed=0)[0]
    ref(tok, position_ids(2), labels=lab).float().mean().backward()
    ok, _, _ = opt.step()
    assert ok and float(opt.get_loss_scale()) == 1024.0
    w = model.output_layer.weight
    main = opt.main_params[[id(p) for p in opt.model_params].index(id(w))]
    expected = ref.output_layer.weight.grad.float()
    assert torch.allclose(main.grad, expected, rtol=1e-2, atol=1e-5)  # 1/1024 applied
    assert main.grad.abs().max() > 1e-4


# ---- found_inf over the data-parallel group, with the distributed optimizer; scaler through dist_checkpointing --
def _dp_overflow_body(rank, ws, ckpt, distributed):
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = tiny_config(moe=False, fp16=True, params_dtype=torch.float16, add_bias_linear=False)

    def build(seed, initial):
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), build_gpt(cfg, seed))
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=initial, hysteresis=1,
                                                     loss_scale_window=3, use_distributed_optimizer=distributed),
                                     [ddp])
        return ddp, opt

    ddp, opt = build(0, 2.0**12)
    before = [p.detach().clone() for p in ddp.module.parameters()]
    opt.zero_grad()
    ddp.zero_grad_buffer()
    _backward(ddp, opt, seed=rank)
    if rank == 1:  # only one rank overflows: every rank must skip
        # fp16 parameters with grad_reduce_in_fp32: the gradient accumulates in main_grad (fp32), as upstream
        next(ddp.module.parameters()).main_grad.view(-1)[0] = float("nan")
    ddp.finish_grad_sync()
    assert opt.step() == (False, None, None)
    assert float(opt.get_loss_scale()) == 2.0**11
    assert all(torch.equal(p, b) for p, b in zip(ddp.module.parameters(), before))
    opt.zero_grad()
    ddp.zero_grad_buffer()
    _backward(ddp, opt, seed=rank + 10)
    ddp.finish_grad_sync()
    assert opt.step()[0]
    sd = ddp.sharded_state_dict()
    osd = opt.sharded_state_dict(sd)
    assert float(osd["grad_scaler"]["scale"]) == 2.0**11 and osd["grad_scaler"]["growth_tracker"] == 1
    dist_checkpointing.save({"model": sd, "optimizer": osd}, ckpt)
    ddp2, opt2 = build(5, 2.0**20)
    sd2 = ddp2.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": sd2, "optimizer": opt2.sharded_state_dict(sd2, is_loading=True)}, ckpt)
    ddp2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    assert float(opt2.get_loss_scale()) == 2.0**11  # restored, not the new run's --initial-loss-scale
    assert opt2.grad_scaler._growth_tracker == 1 and opt2.grad_scaler._hysteresis_tracker == 0


@pytest.mark.parametrize("distributed", [False, True])
def test_fp16_overflow_on_one_rank_skips_everywhere_and_scaler_is_checkpointed(tmp_path, distributed):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_distributed(_dp_overflow_body, 2, str(ckpt), distributed)
