"""``pretrain_gpt.py --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --num-experts 4``
on 4 CPU gloo ranks (TP=2 x DP=2, EP=2 x expert-DP=1) trains, saves, and resumes at TP=1, EP=1 (DP=4) with the loss
continuing as the uninterrupted run (the aux loss and the expert-bias update on). COMMON pads the mock vocabulary
to 128 at TP 1 and 2."""
import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tensor_parallel.test_tp_pretrain import COMMON
from tests.unit_tests.training.test_training import _run

MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-token-dispatcher-type", "alltoall",
       "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", 0.01]
TP_SP_EP = ["--tensor-model-parallel-size", 2, "--sequence-parallel", "--expert-model-parallel-size", 2]


def _body(rank, world_size, ckpt):
    from megatron.core import parallel_state

    full = _run(COMMON + MOE + TP_SP_EP + ["--save", ckpt, "--save-interval", 4])
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    curve = [full.losses[i] for i in range(1, 9)]
    assert curve[-1] < curve[0]  # it trains
    resumed = _run(COMMON + MOE + ["--load", ckpt, "--ckpt-step", 4])  # TP=1, EP=1, DP=4
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    again = [resumed.losses[i] for i in range(5, 9)]
    assert again == pytest.approx(curve[4:], rel=1e-5), (again, curve[4:])


def test_pretrain_tp2_sp_ep2_resume_at_tp1_ep1(tmp_path):
    run_distributed(_body, 4, str(tmp_path / "ckpt"), timeout=600)
