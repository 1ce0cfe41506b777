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
