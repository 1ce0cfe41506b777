"""The command line at PP: ``torchrun --nproc-per-node 4 pretrain_gpt.py`` with --pipeline-model-parallel-size 2 x
--tensor-model-parallel-size 2 (4 gloo ranks, tiny model, mock data) trains 5 iterations, saving at 3; ``python
pretrain_gpt.py`` in one process (PP=1, TP=1, the same 128 padded vocabulary rows) loads the checkpoint of iteration 3 and continues with the consumed
samples, learning rates and losses (fp32, rtol 1e-5) of the PP=2 x TP=2 run's iterations 4 and 5."""
import os
import subprocess
import sys

import numpy as np

from tests.unit_tests.training.test_training import NO_DROPOUT, REPO, TINY, _cli_env


def _fields(stdout: str) -> dict:
    """iteration -> {field: value} of every 'lm loss:' log line."""
    out = {}
    for line in stdout.splitlines():
        if "lm loss:" not in line:
            continue
        it = int(line.split("iteration")[1].split("/")[0])
        out[it] = {k: float(line.split(k)[1].split("|")[0]) for k in ("lm loss:", "consumed samples:",
                                                                       "learning rate:")}
    return out


def _cli(cmd, argv):
    done = subprocess.run(cmd + [os.path.join(REPO, "pretrain_gpt.py")] + [str(a) for a in argv], env=_cli_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _fields(done.stdout)


def test_torchrun_pp2_tp2_trains_saves_and_resumes_at_pp1(tmp_path):
    ckpt = str(tmp_path / "pp2tp2")
    args = TINY + NO_DROPOUT + ["--log-interval", 1, "--train-iters", 5]
    # the padded vocabulary (65 tokens with the mock tokenizer's end of document) 128 rows at TP=2 and at TP=1, so
    # that the losses compare
    pp = _cli([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"],
              args + ["--make-vocab-size-divisible-by", 64, "--pipeline-model-parallel-size", 2, "--tensor-model-parallel-size", 2, "--save", ckpt,
                      "--save-interval", 3])
    assert sorted(pp) == [1, 2, 3, 4, 5] and os.path.isdir(os.path.join(ckpt, "iter_0000003"))
    assert [pp[i]["consumed samples:"] for i in pp] == [8, 16, 24, 32, 40]
    assert all(np.isfinite(pp[i]["lm loss:"]) and 0 < pp[i]["lm loss:"] < 10 for i in pp)
    assert pp[5]["lm loss:"] < pp[1]["lm loss:"]
    resumed = _cli([sys.executable],
                   args + ["--make-vocab-size-divisible-by", 128, "--load", ckpt, "--ckpt-step", 3])
    assert sorted(resumed) == [4, 5], resumed
    for i in (4, 5):
        assert resumed[i]["consumed samples:"] == pp[i]["consumed samples:"]
        np.testing.assert_allclose(resumed[i]["learning rate:"], pp[i]["learning rate:"], rtol=1e-6)
        np.testing.assert_allclose(resumed[i]["lm loss:"], pp[i]["lm loss:"], rtol=1e-5)
