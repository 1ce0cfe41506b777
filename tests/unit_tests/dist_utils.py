"""Run a test body for real in several processes, each a rank of a gloo process group on CPU.

Usage inside a test::

    def _body(rank, world_size, tmp_path):   # module-level, so it can be pickled
        ...asserts...

    def test_x(tmp_path):
        run_distributed(_body, 4, tmp_path)

Each rank calls ``fn(rank, world_size, *args)`` with ``torch.distributed`` initialised (gloo, a FileStore, so no
port races between pytest-xdist workers). A failure or exception on any rank fails the test with that rank's
traceback; a rank that dies without reporting (a crash) fails it at once, naming the signal (see
:func:`run_distributed` for the one retry under fork); a hang fails it after ``timeout`` seconds.
"""
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
import warnings

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


def _died(procs, results):
    """``[(rank, exit code)]`` of the ranks that exited without reporting (a crash: negative code = signal)."""
    return [(r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode is not None]


def _describe(code) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without reporting"


def _run_once(fn, world_size, args, timeout, method):
    """``(errors, crashed)``: the failure texts, and whether a rank died by a signal without reporting."""
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="gloo_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    errors, results, crashed = [], {}, False

    def record(report):
        rank, err = report
        results[rank] = err
        if err:
            errors.append(f"--- rank {rank} ---\n{err}")

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                record(queue.get(timeout=1.0))
            except queue_mod.Empty:
                dead = _died(procs, results)
                while dead:  # an exited rank's report is in the pipe by now (its queue is flushed at exit)
                    try:
                        record(queue.get(timeout=0.5))
                    except queue_mod.Empty:
                        break
                    dead = _died(procs, results)
                if dead:  # a rank is gone without a word: the others may wait for it forever
                    crashed = any(code is not None and code < 0 for _, code in dead)
                    errors += [f"--- rank {r} ---\n{_describe(code)}" for r, code in dead]
                    break
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks "
                                  f"{sorted(set(range(world_size)) - set(results))}")
                    break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
        if os.path.exists(store_path):
            os.unlink(store_path)
    return errors, crashed


def run_distributed(fn, world_size, *args, timeout=300):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise if any rank fails. A rank that dies
    without reporting fails the run at once, naming its signal. Under fork only, a run in which a rank was killed
    by a signal (never an assertion or exception of the body) is started once more, with a warning: forked children
    of a multi-threaded pytest worker have crashed inside gloo (SIGSEGV, once in about a thousand CI runs), which
    the body cannot cause and the second run shows; a body that crashes does so again and fails."""
    # fork is fast (CPU machines); with a GPU the ranks start fresh: a forked child of a process whose CUDA state
    # was touched (TE imported, an earlier test, pinned host memory) fails on its first CUDA call, and
    # torch.cuda.is_initialized() in the parent did not tell (seen on the H200)
    method = os.environ.get("MCORE_TEST_START_METHOD") or ("spawn" if torch.cuda.is_available() else "fork")
    errors, crashed = _run_once(fn, world_size, args, timeout, method)
    if errors and crashed and method == "fork":
        warnings.warn("run_distributed: a forked rank was killed by a signal; running the test once more:\n"
                      + "\n".join(errors))
        errors, _ = _run_once(fn, world_size, args, timeout, method)
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
