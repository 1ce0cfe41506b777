"""--profile --use-pytorch-profiler in the training loop: the trace lands in --tensorboard-dir, the top-ops table is
printed on the profiled rank only, and bad step ranges are refused naming the flags."""
import glob
import os

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import TINY, _run


def _body(rank, world_size, tb_dir, out_file):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = _run(TINY + ["--train-iters", 4, "--profile", "--use-pytorch-profiler", "--profile-step-start", 1,
                              "--profile-step-end", 3, "--profile-ranks", 1, "--tensorboard-dir", tb_dir])
    assert sorted(result.losses) == [1, 2, 3, 4]
    text = buf.getvalue()
    if rank == 1:
        assert "torch.profiler (rank 1), iterations [1, 3)" in text, text[-2000:]
        assert "Self CPU" in text and "aten::mm" in text
        traces = glob.glob(os.path.join(tb_dir, "rank1*.pt.trace.json*"))
        assert len(traces) == 1, os.listdir(tb_dir)
        assert os.path.getsize(traces[0]) > 1000
    else:
        assert "torch.profiler" not in text


def test_pytorch_profiler_trace_and_table(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "tb"), str(tmp_path / "out"))
    assert not glob.glob(str(tmp_path / "tb" / "rank0*"))


def test_profile_step_range_is_checked():
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(args=[str(a) for a in TINY + ["--train-iters", 4, "--profile", "--profile-step-start", 5,
                                                     "--profile-step-end", 5]])
    with pytest.raises(SystemExit, match="--profile-step-start .5. and --profile-step-end .5."):
        validate_args(args)
