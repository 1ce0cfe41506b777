"""``OptimizerConfig.grad_norm_skip_threshold`` (upstream's field, default inf): a step whose global grad norm (before
clipping) exceeds it leaves parameters and optimizer state unchanged and reports ``update_successful=False``; below
it the step runs as usual."""
import math

import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config


def _step(threshold):
    model = build_gpt(tiny_config(moe=False), 0)
    cfg = OptimizerConfig(lr=1e-2, clip_grad=1.0, grad_norm_skip_threshold=threshold)
    opt = get_megatron_optimizer(cfg, model)
    before = [p.detach().clone() for p in model.parameters()]
    tok, lab = batches(1, 2)[0]
    model(tok, position_ids(2), labels=lab).float().mean().backward()
    ok, norm, _ = opt.step()
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return ok, norm, changed, opt


def test_default_is_inf_as_upstream():
    assert OptimizerConfig().grad_norm_skip_threshold == float("inf")


def test_step_skipped_above_threshold_and_taken_below():
    ok, norm, changed, opt = _step(float("inf"))
    assert ok and changed and math.isfinite(norm) and norm > 0
    ok, norm_skip, changed, opt = _step(norm / 2)  # same model, same batch: same norm, now above the threshold
    assert norm_skip == norm
    assert not ok and not changed
    assert all(len(opt.optimizer.state[p]) == 0 for p in opt.get_parameters())  # no Adam state created
