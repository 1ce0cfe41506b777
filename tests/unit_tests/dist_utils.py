"""Run a test body for real in several processes, each a rank of a gloo process group on CPU.

Usage inside a test::

    def _body(rank, world_size, tmp_path):   # module-level, so it can be pickled
        ...asserts...

    def test_x(tmp_path):
        run_distributed(_body, 4, tmp_path)

Each rank calls ``fn(rank, world_size, *args)`` with ``torch.distributed`` initialised (gloo, a FileStore, so no
port races between pytest-xdist workers). A failure or exception on any rank fails the test with that rank's
traceback; a hang fails it after ``timeout`` seconds.
"""
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, fn, args, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
        queue.put((rank, None))
    except BaseException:  # report everything, including assertion failures
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size, *args, timeout=300):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank fails."""
    # fork is fast (CPU machines); with a GPU the ranks start fresh: a forked child of a process whose CUDA state
    # was touched (TE imported, an earlier test, pinned host memory) fails on its first CUDA call, and
    # torch.cuda.is_initialized() in the parent did not tell (seen on the H200)
    method = os.environ.get("MCORE_TEST_START_METHOD") or ("spawn" if torch.cuda.is_available() else "fork")
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="gloo_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    errors, results = [], {}
    try:
        for _ in range(world_size):
            try:
                rank, err = queue.get(timeout=timeout)
            except Exception:
                errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(results))}")
                break
            results[rank] = err
            if err:
                errors.append(f"--- rank {rank} ---\n{err}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
        if os.path.exists(store_path):
            os.unlink(store_path)
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
