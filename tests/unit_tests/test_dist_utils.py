import faulthandler
import os
import signal

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fails_on_rank_one(rank, world_size):
    assert rank != 1, "planted failure"


@pytest.mark.parametrize("world_size", [2, 4])
def test_allreduce_runs_on_gloo_ranks(world_size):
    run_distributed(_allreduce, world_size)


def test_failure_on_one_rank_is_reported():
    with pytest.raises(AssertionError, match="planted failure"):
        run_distributed(_fails_on_rank_one, 2)


def _segfaults_once(rank, world_size, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        faulthandler.disable()  # a planted crash: no stack dump in the test log
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def _always_segfaults(rank, world_size):
    if rank == 1:
        faulthandler.disable()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def _exits_silently(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the retry applies to fork (CPU machines)")
def test_a_rank_killed_once_by_a_signal_is_run_again(tmp_path, monkeypatch):
    monkeypatch.delenv("MCORE_TEST_START_METHOD", raising=False)
    with pytest.warns(UserWarning, match=r"(?s)killed by a signal; running the test once more.*rank 1.*SIGSEGV"):
        run_distributed(_segfaults_once, 2, str(tmp_path / "crashed"))
    assert (tmp_path / "crashed").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the retry applies to fork (CPU machines)")
def test_a_rank_that_always_crashes_fails_fast_naming_the_signal(monkeypatch):
    import time

    monkeypatch.delenv("MCORE_TEST_START_METHOD", raising=False)
    start = time.monotonic()
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match=r"rank 1 ---\nkilled by SIGSEGV"):
        run_distributed(_always_segfaults, 2, timeout=120)
    assert time.monotonic() - start < 60  # not the 120 s timeout: the dead rank is noticed


def test_a_rank_that_exits_without_reporting_fails_without_a_retry(recwarn):
    with pytest.raises(AssertionError, match=r"rank 0 ---\nexited with code 3 without reporting"):
        run_distributed(_exits_silently, 2, timeout=120)
    assert not [w for w in recwarn if "running the test once more" in str(w.message)]
