"""End to end through ``pretrain`` (CPU gloo, 2 ranks): ``--use-megatron-fsdp --data-parallel-sharding-strategy``
optim (ZeRO-1: DDP + DistributedOptimizer) and optim_grads (ZeRO-2: FSDP2) with MoE expert bias and meta init train,
save and resume bitwise; the wrapper and optimizer are the ones the strategy names."""
import numpy as np
import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import MOE, NO_DROPOUT, TINY, _run, _same_on_all_ranks, _tracker


def _body(rank, world_size, ckpt, strategy):
    from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel
    from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer

    argv = TINY + NO_DROPOUT + MOE + ["--data-parallel-sharding-strategy", strategy]
    res = _run(argv + ["--save", ckpt, "--save-interval", 2])
    wrapper, opt = (DistributedDataParallel, DistributedOptimizer) if strategy == "optim" else (
        FullyShardedDataParallel, MegatronOptimizer)
    assert type(res.model[0]) is wrapper and type(res.optimizer) is opt
    losses = [res.losses[i] for i in range(1, 5)]
    assert all(np.isfinite(losses)) and losses[0] != losses[-1], losses
    _same_on_all_ranks(losses)
    assert _tracker(ckpt) == "4"
    res2 = _run(argv + ["--load", ckpt, "--ckpt-step", 2])
    assert [res2.losses[3], res2.losses[4]] == losses[2:], (res2.losses, losses)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_strategy_trains_saves_and_resumes(tmp_path, strategy):
    run_distributed(_body, 2, str(tmp_path / "ckpt"), strategy)
