"""``pretrain_gpt.py --use-distributed-optimizer`` and ``--fp16`` (dynamic and static loss scale): train, save,
resume (2 gloo ranks, CPU). A resume continues exactly like the uninterrupted run (losses and loss scales), the
distributed optimizer's curve equals the replicated optimizer's within rounding, and the fp16 scaler's state comes
back from the checkpoint."""
import os

import numpy as np

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import TINY, _run, _same_on_all_ranks, _tracker

ITERS, HALF = 6, 3


def _curve(*results, key="losses"):
    out = {}
    for r in results:
        out.update(getattr(r, key))
    return [out[i] for i in sorted(out)]


def _train_and_resume(extra, ckpt):
    args = TINY + ["--train-iters", ITERS] + extra
    full = _run(args)
    first = _run(args + ["--save", ckpt, "--save-interval", HALF, "--exit-interval", HALF])
    assert _tracker(ckpt) == str(HALF)
    second = _run(args + ["--save", ckpt, "--load", ckpt, "--save-interval", 100])
    assert sorted(second.losses) == list(range(HALF + 1, ITERS + 1))
    assert _tracker(ckpt) == str(ITERS)
    return full, first, second


def _distopt_body(rank, world_size, ckpt):
    from megatron.core.optimizer import DistributedOptimizer

    full, first, second = _train_and_resume(["--use-distributed-optimizer"], ckpt)
    assert isinstance(full.optimizer, DistributedOptimizer)
    whole = sum(p.numel() for p in full.model[0].module.parameters())
    owned = sum(m.numel() for m in full.optimizer.main_params)
    assert whole / world_size - world_size <= owned <= -(-whole // world_size)  # 1/DP of the main params
    curve = _curve(full)
    assert _curve(first, second) == curve  # the resume is exact (fp32 main params and Adam state restored)
    assert _curve(first, second, key="grad_norms") == _curve(full, key="grad_norms")
    assert curve[-1] < curve[0]
    # --no-load-optim: the fp32 slices come from the loaded model (not the new run's random init)
    fresh = _run(TINY + ["--train-iters", HALF + 2, "--use-distributed-optimizer", "--load", ckpt, "--ckpt-step",
                         HALF, "--no-load-optim"])
    assert fresh.losses[HALF + 1] == full.losses[HALF + 1]
    assert abs(fresh.losses[HALF + 2] - full.losses[HALF + 2]) < abs(fresh.losses[HALF + 2] - full.losses[1])
    replicated = _run(TINY + ["--train-iters", ITERS])
    np.testing.assert_allclose(curve, _curve(replicated), rtol=1e-5, atol=0)
    _same_on_all_ranks(curve)


def test_cli_distributed_optimizer_trains_and_resumes(tmp_path):
    run_distributed(_distopt_body, 2, str(tmp_path / "ckpt"))


FP16 = ["--fp16", "--initial-loss-scale", 2**20, "--hysteresis", 1, "--loss-scale-window", 2]


def _fp16_body(rank, world_size, ckpt, static_ckpt):
    full, first, second = _train_and_resume(FP16, ckpt)
    scales = _curve(full, key="loss_scales")
    assert scales[0] == 2.0**20
    assert full.skipped_iterations >= 1  # 2**20 overflows fp16 gradients: skipped and halved
    for a, b in zip(scales, scales[1:]):
        assert b in (a / 2, a, a * 2), scales
    assert all(np.isfinite(_curve(full)))
    assert _curve(first, second) == _curve(full)
    # the resumed run started from the saved scale and trackers, not from --initial-loss-scale
    assert _curve(first, second, key="loss_scales") == scales
    assert second.loss_scales[HALF + 1] != 2.0**20
    assert first.skipped_iterations + second.skipped_iterations == full.skipped_iterations
    assert all(p.dtype.is_floating_point and str(p.dtype) == "torch.float16" for p in full.model[0].parameters())
    # static scale: never changes, survives a resume
    static = FP16[:1] + ["--loss-scale", 1024]
    s_full, s_first, s_second = _train_and_resume(static, static_ckpt)
    assert set(_curve(s_full, key="loss_scales")) == {1024.0}
    assert _curve(s_first, s_second, key="loss_scales") == [1024.0] * ITERS
    assert _curve(s_first, s_second) == _curve(s_full)
    assert _curve(s_full)[-1] < _curve(s_full)[0]


def test_cli_fp16_dynamic_and_static_loss_scale_train_and_resume(tmp_path):
    run_distributed(_fp16_body, 2, str(tmp_path / "ckpt"), str(tmp_path / "static"))
