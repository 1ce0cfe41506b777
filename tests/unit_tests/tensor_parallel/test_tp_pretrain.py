"""``pretrain_gpt.py --tensor-model-parallel-size 2 --sequence-parallel`` on 4 CPU gloo ranks (TP=2 x DP=2) trains,
saves, and resumes at TP=1 (DP=4) with the loss continuing as the uninterrupted TP=2 run, which itself equals a TP=1
run from the same initial weights; the TP flags are validated with messages naming them."""
import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_arguments import _args
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

TP_SP = ["--tensor-model-parallel-size", 2, "--sequence-parallel"]
# clipping active (grad norms of TINY are ~1-3): TP ranks must compute the same global norm as TP=1 (each value
# counted once, summed over the TP group), else they clip by different factors and the curves part
# the mock tokenizer (65 tokens) padded to a multiple of 64 x TP is 128 at TP 1 and 2 (a different padded vocab changes the softmax)
COMMON = TINY + NO_DROPOUT + ["--clip-grad", 0.5, "--train-iters", 8, "--make-vocab-size-divisible-by", 64,
                               "--use-cpu-initialization"]


def _body(rank, world_size, ckpt):
    full = _run(COMMON + TP_SP)
    curve = [full.losses[i] for i in range(1, 9)]
    assert curve[-1] < curve[0]  # it trains
    # --use-cpu-initialization gives the same initial weights at every TP size: TP=1 trains the same curve
    tp1 = _run(COMMON)
    assert [tp1.losses[i] for i in range(1, 9)] == pytest.approx(curve, rel=1e-5)
    norms = [full.grad_norms[i] for i in range(1, 9)]
    assert max(norms) > 0.5  # the clip was active
    assert [tp1.grad_norms[i] for i in range(1, 9)] == pytest.approx(norms, rel=1e-5)
    first = _run(COMMON + TP_SP + ["--save", ckpt, "--save-interval", 4, "--exit-interval", 4])
    assert [first.losses[i] for i in range(1, 5)] == curve[:4]
    second = _run(COMMON + ["--load", ckpt])  # TP=1, DP=4
    resumed = [second.losses[i] for i in range(5, 9)]
    assert resumed == pytest.approx(curve[4:], rel=1e-5), (resumed, curve[4:])


def test_pretrain_tp2_sp_resume_at_tp1(tmp_path):
    run_distributed(_body, 4, str(tmp_path / "ckpt"), timeout=600)


@pytest.mark.parametrize("extra,world,needles", [
    ([*TP_SP[:2]], 1, ["--tensor-model-parallel-size", "WORLD_SIZE"]),
    (["--sequence-parallel"], 2, ["--sequence-parallel", "--tensor-model-parallel-size=1"]),
    ([*TP_SP[:2], "--num-attention-heads", 3, "--hidden-size", 33], 2, ["--num-attention-heads=3", "--tensor-model-parallel-size=2"]),
    ([*TP_SP[:2], "--ffn-hidden-size", 33], 2, ["--ffn-hidden-size=33", "--tensor-model-parallel-size=2"]),
    ([*TP_SP[:2], "--group-query-attention", "--num-query-groups", 1], 2, ["--num-query-groups=1", "--tensor-model-parallel-size=2"]),
    ([*TP_SP, "--seq-length", 15, "--max-position-embeddings", 16], 2, ["--seq-length", "(15)"]),
    ([*TP_SP, "--num-experts", 2, "--expert-model-parallel-size", 2], 2,
     ["--tensor-model-parallel-size (2) x --expert-model-parallel-size (2) must divide the world size (2)"]),
])
def test_tp_flags_validated(extra, world, needles):
    with pytest.raises(SystemExit) as exc:
        _args(*extra, world_size=world)
    for n in needles:
        assert n in str(exc.value), (n, str(exc.value))


def test_tp_flags_accepted():
    a = _args(*TP_SP, world_size=4)
    assert a.data_parallel_size == 2 and a.tensor_model_parallel_size == 2 and a.sequence_parallel
    from megatron.training.arguments import core_transformer_config_from_args

    cfg = core_transformer_config_from_args(a)
    assert cfg.tensor_model_parallel_size == 2 and cfg.sequence_parallel


def _distopt_body(rank, world_size):
    """The distributed optimizer's grad norm under TP: its owned slices' squares, each value counted once, summed
    over DP and TP: the same norms and (clipped) curve as TP=1."""
    dopt = ["--use-distributed-optimizer"]
    tp2 = _run(COMMON + TP_SP + dopt)
    tp1 = _run(COMMON + dopt)
    assert max(tp2.grad_norms.values()) > 0.5  # the clip was active
    assert [tp1.grad_norms[i] for i in range(1, 9)] == pytest.approx([tp2.grad_norms[i] for i in range(1, 9)], rel=1e-5)
    assert [tp1.losses[i] for i in range(1, 9)] == pytest.approx([tp2.losses[i] for i in range(1, 9)], rel=1e-5)


def test_distributed_optimizer_grad_norm_under_tp():
    run_distributed(_distopt_body, 4, timeout=600)
