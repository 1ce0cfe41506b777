"""On 2+ GPUs (NCCL): ``benchmarks/overlap_grad_reduce.py`` run small, fp32, every mode; the overlapped rows' losses
equal the non-overlapped ones' within fp32 rounding (NCCL sums in an order of its own per buffer size), their
buckets exist, and ``--ddp-average-in-collective`` (NCCL's AVG, experts pre-scaled) gives the same curve. Skipped
without 2 CUDA devices."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _table(extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "overlap_grad_reduce.py"), "--layers", "2", "--hidden", "256",
           "--heads", "4", "--seq", "128", "--vocab", "1024", "--mbs", "2", "--micro-batches", "2", "--iters", "4",
           "--warmup", "1", "--fp32", "--bucket-size", "100000"] + extra
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\| (\S+) \| (\d+) \| [\d.]+ \| [\d,]+ \| \S+ \| (\S+) \|", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), float(m.group(3)))
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("extra", [[], ["--average-in-collective"], ["--moe", "--experts", "4", "--ep", "2"]])
def test_overlap_equals_no_overlap_on_nccl(extra):
    rows = _table(extra)
    assert set(rows) == {"ddp", "ddp+ov", "distopt", "distopt+ov", "distopt+ov+pg"}, rows
    for mode, (buckets, diff) in rows.items():
        assert (buckets > 1) == ("+ov" in mode), (mode, buckets)
        assert diff <= 1e-4, (mode, diff)
