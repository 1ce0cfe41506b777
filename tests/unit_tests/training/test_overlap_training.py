"""pretrain_gpt with --overlap-grad-reduce / --overlap-param-gather on 4 CPU gloo ranks: the training loop and the
pipeline schedules (per-chunk ``no_sync`` / ``grad_sync_func`` / ``param_sync_func``) give the losses of the same run
without overlap (fp32; the tied embedding's gradient is summed over the pipeline stages after, not before, the
data-parallel reduction, so within rounding):

- PP=2 x DP=2 interleaved (two chunks of one layer per rank), distributed optimizer, both flags, small buckets
  (``align_param_gather``: every chunk's gathers start at the beginning of the step);
- PP=1 x DP=4 DDP with 2 micro-batches per iteration (the training loop's ``no_sync``), ``--ddp-num-buckets``."""
import numpy as np

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run, _same_on_all_ranks

BASE = TINY + NO_DROPOUT + ["--num-layers", 4, "--train-iters", 3, "--log-interval", 1]
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", 600]


def _curve(result):
    got = [result.losses[i] for i in range(1, 4)]
    _same_on_all_ranks(got)
    return got


def _body(rank, world_size):
    pp = BASE + ["--use-distributed-optimizer", "--pipeline-model-parallel-size", 2,
                 "--num-layers-per-virtual-pipeline-stage", 1]
    ref = _curve(_run(pp))
    seen = []
    ov = _run(pp + OVERLAP + ["--overlap-param-gather"],
              on_iteration_end=lambda it, model, loss: seen.append([len(m.buckets) for m in model]))
    # as upstream: only the first chunk of the first stage is cut into buckets (a tied embedding copy under PP has
    # a bucket of its own: the last stage's output layer)
    assert seen[0] == ([6, 1] if rank // 2 == 0 else [1, 2]), seen
    assert ov.model[0].ddp_config.align_param_gather
    np.testing.assert_allclose(_curve(ov), ref, rtol=1e-5, atol=0)
    assert ref[-1] < ref[0], ref
    ddp = BASE + ["--global-batch-size", 16]  # 2 micro-batches per DP rank
    counts = []
    ov = _run(ddp + ["--overlap-grad-reduce", "--ddp-num-buckets", 5],
              on_iteration_end=lambda it, model, loss: counts.append(len(model[0].buckets)))
    assert 4 <= counts[0] <= 6, counts  # about the parameters / 5 per bucket (a parameter is never split)
    np.testing.assert_allclose(_curve(ov), _curve(_run(ddp)), rtol=1e-6, atol=0)


def test_pretrain_gpt_overlap_equals_no_overlap():
    run_distributed(_body, 4, timeout=600)
