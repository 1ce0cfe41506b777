"""pretrain_gpt --async-save on CPU (gloo, 2 ranks): training continues while a checkpoint is written, the tracker
advances only when the save is finalized, pending saves are finalized before the next save and at exit, and a
resume from the asynchronous checkpoint gives the same losses as the uninterrupted run (bitwise). The host staging
buffers are allocated before training (warm-up, nothing written): the saves allocate none."""
import os
import threading

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import TINY, _run, _tracker


def _body(rank, world_size, ckpt):
    from megatron.core.dist_checkpointing.strategies import async_utils, host_staging
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from megatron.training import checkpointing

    # DCP's THREAD checkpointer here (no checkpoint-process start-up: test time); PROCESS: test_async_save.py
    torch_strategy.DEFAULT_ASYNC_CHECKPOINTER_TYPE = "thread"

    total = 8
    args = TINY + ["--train-iters", total]
    full = _run(args)

    # Hold the background write of the save at iteration 3 until iteration 5 ended, to see training go on.
    release = threading.Event()
    real_write = async_utils.dcp_async_write
    writes = []

    def held_write(*a, **k):
        writes.append(str(a[0]))
        if len(writes) == 1:
            assert release.wait(60), "never released"
        return real_write(*a, **k)

    seen = {}

    stager = host_staging.get_host_stager(shared=False)  # the THREAD checkpointer's buffers
    allocated = {}

    def on_iteration_end(iteration, model, loss):
        allocated[iteration] = stager.allocated_bytes
        queue = checkpointing._async_queue
        pending = queue.get_num_unfinalized_calls() if queue is not None else 0
        tracker = _tracker(ckpt) if os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) else None
        seen[iteration] = (pending, tracker)
        if iteration == 5:
            release.set()

    async_utils.dcp_async_write = held_write
    try:
        first = _run(args + ["--save", ckpt, "--save-interval", 3, "--exit-interval", 6, "--async-save",
                             "--ckpt-fully-parallel-save", "--use-persistent-ckpt-worker"],
                     on_iteration_end=on_iteration_end)
    finally:
        async_utils.dcp_async_write = real_write
    # iterations 4 and 5 ran while the save of iteration 3 was in flight, and the tracker did not move
    assert seen[4] == (1, None) and seen[5] == (1, None), seen
    assert [os.path.basename(w) for w in writes] == ["iter_0000003.partial", "iter_0000006.partial"]  # renamed at finalize
    assert _tracker(ckpt) == "6" and checkpointing._async_queue is None  # finalized at exit
    assert allocated[1] > 0 and allocated[6] == allocated[1], allocated  # warmed up before iteration 1; reused
    assert not os.path.exists(os.path.join(ckpt, ".async_save_warm_up"))  # the warm-up wrote nothing
    for it in (3, 6):
        assert os.path.isfile(os.path.join(ckpt, f"iter_{it:07d}", "metadata.json"))

    second = _run(args + ["--load", ckpt])  # synchronous resume from the asynchronous checkpoint
    resumed = [first.losses[i] for i in range(1, 7)] + [second.losses[i] for i in range(7, total + 1)]
    assert resumed == [full.losses[i] for i in range(1, total + 1)]


def test_async_save_training_continues_and_resumes_bitwise(tmp_path):
    run_distributed(_body, 2, str(tmp_path / "ckpt"), timeout=240)
