"""Asynchronous save (issue 13): ``save(..., async_sharded_save=True)`` + ``AsyncCallsQueue`` on real gloo ranks.

Checks: the async checkpoint has the same content as a sync one (load result, byte-identical tensors, same objects),
weights changed right after scheduling do not leak into it, metadata.json appears only at finalization, a write
error is raised on every rank without finalizing, an async save killed before finalize leaves nothing loadable and
the next save works; upstream's API names (get_async_strategy, AsyncRequest fields, frozen requests).
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megatron.core import dist_utils
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.core import CONFIG_FNAME
from megatron.core.dist_checkpointing.strategies import async_utils
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    get_async_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _state(rank, world):
    a = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 100 * rank
    b = torch.full((3, 5), float(rank), dtype=torch.bfloat16)  # replicated: one writer
    return {
        "a": ShardedTensor.from_rank_offsets("a", a, (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", b, replica_id=rank),
        "obj": ShardedObject("obj", {"rank": rank, "l": [1, 2]}, (world,), (rank,)),
        "step": 5,
    }


def _dir(base, name, rank):
    d = os.path.join(base, name)
    if rank == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    return d


def _files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if n.endswith(".distcp")}


def _equivalence_body(rank, world, base, kind, persistent, fully_parallel):
    os.environ["MCORE_ASYNC_CKPT_CHECKPOINTER"] = kind
    sd = _state(rank, world)
    sync_dir, async_dir = _dir(base, "sync", rank), _dir(base, "async", rank)
    dist_checkpointing.save(sd, sync_dir)

    strategy = TorchDistSaveShardedStrategy()
    strategy.async_checkpointer_type = kind
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy)
    queue = AsyncCallsQueue(persistent=persistent)
    request = dist_checkpointing.save(sd, async_dir, strategy, async_sharded_save=True)
    assert isinstance(request, AsyncRequest) and request.preload_fn is not None
    finalized = []
    request.add_finalize_fn(lambda: finalized.append(True))
    assert not os.path.exists(os.path.join(async_dir, CONFIG_FNAME))  # nothing written before scheduling
    idx = queue.schedule_async_request(request)
    assert idx == 0 and queue.get_num_unfinalized_calls() == 1
    # the training step changes the weights right after scheduling: not in the checkpoint
    sd["a"].data.add_(1000.0)
    sd["b"].data.fill_(-7.0)
    assert not finalized and not os.path.exists(os.path.join(async_dir, CONFIG_FNAME))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert finalized == [True] and queue.get_num_unfinalized_calls() == 0
    assert os.path.isfile(os.path.join(async_dir, CONFIG_FNAME))
    base_strategy = strategy.base_strategy if fully_parallel else strategy
    assert base_strategy.last_staged_bytes >= (24 * 4 if not fully_parallel else 0)
    queue.close()

    def zeros():
        fresh = _state(rank, world)
        fresh["a"].data.zero_()
        fresh["b"].data.fill_(9.0)
        return fresh

    loaded_sync = dist_checkpointing.load(zeros(), sync_dir)
    loaded_async = dist_checkpointing.load(zeros(), async_dir)
    expected = _state(rank, world)
    assert torch.equal(loaded_async["a"], expected["a"].data)
    assert torch.equal(loaded_async["b"], torch.zeros(3, 5, dtype=torch.bfloat16))  # rank 0's copy of b
    assert torch.equal(loaded_async["a"], loaded_sync["a"]) and torch.equal(loaded_async["b"], loaded_sync["b"])
    assert loaded_async["obj"] == {"rank": rank, "l": [1, 2]} and loaded_async["step"] == 5
    full_sync = dist_checkpointing.load_plain_tensors(sync_dir)
    full_async = dist_checkpointing.load_plain_tensors(async_dir)
    assert set(full_sync) == set(full_async) == {"a", "b", "step"} and full_async["step"] == 5
    for k in ("a", "b"):  # byte-identical tensors
        assert full_sync[k].dtype == full_async[k].dtype
        assert full_sync[k].view(torch.uint8).equal(full_async[k].view(torch.uint8)), k
    if not fully_parallel:  # same writers, same items: the data files are byte-identical too
        assert _files(sync_dir) == _files(async_dir)


@pytest.mark.parametrize(
    "kind,persistent,fully_parallel", [("thread", False, False), ("process", True, True)], ids=["thread", "process"]
)
def test_async_equals_sync_and_copy_taken_at_schedule(tmp_path, kind, persistent, fully_parallel):
    run_distributed(_equivalence_body, 2, str(tmp_path), kind, persistent, fully_parallel, timeout=90)


def _error_body(rank, world, base):
    d = _dir(base, "err", rank)
    if rank == 1:  # the disk fills up under rank 1's writer (in its DCP write thread): DCP reports it to every rank
        from megatron.core.dist_checkpointing.strategies import filesystem

        def full(self, b):
            raise OSError(28, f"No space left on device: {self.name}")

        filesystem._ChecksummingStream.write = full
    # two writer threads: torch's extra thread dies silently, its items have no result (the one-thread default
    # raises the OSError itself)
    strategy = TorchDistSaveShardedStrategy(thread_count=2)
    strategy.async_checkpointer_type = "thread"
    request = dist_checkpointing.save(_state(rank, world), d, strategy, async_sharded_save=True)
    finalized = []
    request.add_finalize_fn(lambda: finalized.append(True))
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    with pytest.raises(CheckpointingException, match=r"asynchronous checkpoint save 0 failed.*2 item\(s\) were not written"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert not finalized and not os.path.exists(os.path.join(d, CONFIG_FNAME))
    assert queue.get_num_unfinalized_calls() == 0


def test_async_write_error_raised_on_every_rank_without_finalize(tmp_path):
    run_distributed(_error_body, 2, str(tmp_path), timeout=60)


_KILLED = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    import megatron.core.dist_checkpointing.strategies.async_utils as au
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
    base = sys.argv[1]
    w = torch.arange(1 << 16, dtype=torch.float32)
    queue = AsyncCallsQueue()

    def save(it, finalize=True):
        d = os.path.join(base, f"iter_{it}")
        os.makedirs(d, exist_ok=True)
        req = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w)}, d, async_sharded_save=True)
        req.add_finalize_fn(lambda: open(os.path.join(base, "tracker"), "w").write(str(it)))
        queue.schedule_async_request(req)
        if finalize:
            queue.maybe_finalize_async_calls(blocking=True)

    if sys.argv[3] == "kill":
        save(1)
        orig = au.dcp_async_write
        def slow(*a, **k):
            print("WRITING", flush=True)
            time.sleep(60)
        au.dcp_async_write = slow
        w.add_(1)
        save(2, finalize=False)
        time.sleep(60)  # killed here, before finalize
    else:
        w.add_(2)
        save(2)
        queue.close()
        dist.destroy_process_group()  # (left to interpreter exit, gloo's threads sometimes aborted it: exit -6)
        print("SAVED", flush=True)
    """
)


def test_async_save_killed_before_finalize_keeps_previous_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MCORE_ASYNC_CKPT_CHECKPOINTER="thread")
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    base = tmp_path / "ckpt"
    base.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(base), str(tmp_path / "store1"), "kill"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "WRITING" in line:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert (base / "tracker").read_text() == "1"
    assert (base / "iter_1" / CONFIG_FNAME).is_file() and not (base / "iter_2" / CONFIG_FNAME).exists()
    with pytest.raises(CheckpointingException, match=CONFIG_FNAME):
        dist_checkpointing.load_plain_tensors(base / "iter_2")
    # the next save (into the same unfinished directory) works and advances the tracker at finalize
    out = subprocess.run([sys.executable, str(script), str(base), str(tmp_path / "store2"), "again"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "SAVED" in out.stdout, out.stdout + out.stderr
    assert (base / "tracker").read_text() == "2"
    w = dist_checkpointing.load_plain_tensors(base / "iter_2")["w"]
    assert torch.equal(w, torch.arange(1 << 16, dtype=torch.float32) + 2)
    assert torch.equal(dist_checkpointing.load_plain_tensors(base / "iter_1")["w"],
                       torch.arange(1 << 16, dtype=torch.float32))


# ---- API (no communication) ----------------------------------------------------------------------------------------
def test_async_request_api_and_strategy_selection(caplog):
    assert AsyncRequest._fields == (
        "async_fn", "async_fn_args", "finalize_fns", "async_fn_kwargs", "preload_fn", "is_frozen", "call_idx",
    )
    calls = []
    req = AsyncRequest(lambda x, y: calls.append((x, y)), ("a", "b"), [lambda: calls.append("fin")],
                       preload_fn=lambda: "staged")
    req.execute_sync()
    assert calls == [("a", "staged"), "fin"]
    with pytest.raises(RuntimeError, match="frozen"):
        req.freeze().add_finalize_fn(lambda: None)
    # a queue without torch.distributed: runs in the background, finalizes in order
    queue = AsyncCallsQueue(persistent=True)
    out = []
    for i in range(3):
        queue.schedule_async_request(AsyncRequest(out.append, (i,), [lambda i=i: out.append(f"fin{i}")]))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1, 2]
    assert out == [0, 1, 2, "fin0", "fin1", "fin2"]
    queue.close()
    with pytest.raises(CheckpointingException, match="expected an AsyncRequest"):
        AsyncCallsQueue().schedule_async_request(("not", "a", "request"))

    strategy, modules = get_async_strategy("mcore")
    assert strategy == "mcore" and modules["AsyncCallsQueue"] is AsyncCallsQueue
    assert get_async_strategy("mcore", module="TemporalAsyncCaller")[1] is TemporalAsyncCaller
    assert get_async_strategy("mcore", module="PersistentAsyncCaller")[1] is PersistentAsyncCaller
    with pytest.raises(TypeError, match=r"^async_strategy fast is not supported. Available strategies: nvrx, mcore.$"):
        get_async_strategy("fast")
    try:
        import nvidia_resiliency_ext  # noqa: F401
    except ImportError:
        with pytest.raises(ModuleNotFoundError):
            get_async_strategy("nvrx")
    dist_utils._said_once.clear()
    with caplog.at_level("WARNING", logger=async_utils.__name__):
        assert async_utils.resolve_async_strategy("nvrx") == "mcore"
        assert async_utils.resolve_async_strategy("nvrx") == "mcore"
    said = [r.getMessage() for r in caplog.records if "built-in caller" in r.getMessage()]
    assert len(said) == 1, said  # said once
    with pytest.raises(CheckpointingException, match="checkpointer type 'fork'"):
        async_utils.check_checkpointer_type("fork")
