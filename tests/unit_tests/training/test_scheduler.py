"""OptimizerParamScheduler: warmup, constant / linear / cosine decay to min-lr, weight decay, state dict."""
import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _opt():
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([{"params": [p1], "weight_decay": 0.1}, {"params": [p2], "weight_decay": 0.0}], lr=1.0)


def _sched(opt, style, warmup=2, decay=10, wd_style="constant", start_wd=0.1, end_wd=0.1):
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=warmup,
                                   lr_decay_steps=decay, lr_decay_style=style, start_wd=start_wd, end_wd=end_wd,
                                   wd_incr_steps=10, wd_incr_style=wd_style)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_curve(style):
    opt = _opt()
    s = _sched(opt, style)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(12):
        s.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.5) and lrs[2] == pytest.approx(1.0)
    for n in range(3, 13):
        ratio = (n - 2) / 8
        expect = {"constant": 1.0, "linear": 0.1 + 0.9 * (1 - ratio),
                  "cosine": 0.1 + 0.9 * 0.5 * (math.cos(math.pi * ratio) + 1)}[style]
        if n > 10 and style != "constant":
            expect = 0.1
        assert lrs[n] == pytest.approx(expect), (style, n)
    assert opt.param_groups[1]["lr"] == opt.param_groups[0]["lr"]


def test_weight_decay_and_no_decay_group():
    opt = _opt()
    s = _sched(opt, "linear", wd_style="linear", start_wd=0.0, end_wd=0.2)
    s.step(5)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    s.step(10)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.2)
    opt = _opt()
    _sched(opt, "linear").step(3)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    assert opt.param_groups[1]["weight_decay"] == 0.0  # the no-decay group stays at 0


def test_state_dict_roundtrip():
    opt = _opt()
    s = _sched(opt, "cosine")
    s.step(7)
    sd = s.state_dict()
    assert sd["num_steps"] == 7
    opt2 = _opt()
    s2 = _sched(opt2, "cosine")
    s2.load_state_dict(sd)
    assert s2.num_steps == 7 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    s.step(1), s2.step(1)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_bad_style():
    with pytest.raises(ValueError, match="--lr-decay-style"):
        _sched(_opt(), "bogus")


def _lr_groups_opt(lr):
    """Two groups as get_megatron_optimizer builds them: each with its own max_lr / min_lr (decoupled lr)."""
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([{"params": [p1], "max_lr": lr, "min_lr": lr / 10},
                              {"params": [p2], "max_lr": 2 * lr, "min_lr": lr / 5}], lr=lr)


def _constant_sched(opt, lr, **kwargs):
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=0,
                                   lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=10, wd_incr_style="constant", **kwargs)


def test_override_scheduler_takes_the_arguments_lr_over_the_loaded_optimizer_groups():
    """--override-opt_param-scheduler --lr 2e-3 on a resume: the optimizer's loaded param groups carry the saving
    run's max_lr (3e-3); the new lr must win in every group (before: the checkpoint's lr stayed)."""
    saved_opt = _lr_groups_opt(3e-3)
    saved = _constant_sched(saved_opt, 3e-3, use_checkpoint_opt_param_scheduler=False)
    saved.step(4)
    opt = _lr_groups_opt(2e-3)
    sched = _constant_sched(opt, 2e-3, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    opt.load_state_dict(saved_opt.state_dict())
    assert opt.param_groups[0]["max_lr"] == 3e-3  # what torch's load brings back
    sched.load_state_dict(saved.state_dict())
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(2e-3), pytest.approx(4e-3)]
    assert [g["max_lr"] for g in opt.param_groups] == [2e-3, 4e-3] and sched.num_steps == 4

    # without the override the checkpoint's values stay when asked for ...
    opt = _lr_groups_opt(2e-3)
    sched = _constant_sched(opt, 2e-3, use_checkpoint_opt_param_scheduler=True)
    opt.load_state_dict(saved_opt.state_dict())
    sched.load_state_dict(saved.state_dict())
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(3e-3), pytest.approx(6e-3)]
    # ... and a mismatch is refused naming the flag
    sched = _constant_sched(_lr_groups_opt(2e-3), 2e-3, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match=r"learning rate \(--lr\) is 0.002 in the arguments but 0.003"):
        sched.load_state_dict(saved.state_dict())
