"""Reusable host staging buffers of the asynchronous save (``strategies/host_staging.py``): one allocation per shape
set, reused by later saves, never overwritten while a write still uses them, freed on close; and two asynchronous
saves in a row on real gloo ranks (the second reuses the first's buffers, each checkpoint holds its own values)."""
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import host_staging
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.host_staging import HostStagingBuffers
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.unit_tests.dist_utils import run_distributed


def _tensors(scale=1.0):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale
    return {"w": w, "b": torch.full((5,), scale, dtype=torch.bfloat16), "t": w.t()}  # t: not contiguous


def test_buffers_reused_per_shape_set_and_values_copied():
    stager = HostStagingBuffers(pinned=False, shared=True)
    first = stager.stage(_tensors())
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    assert stager.allocated_bytes == stager.staged_bytes == 48 + 10 + 48
    assert all(v.is_shared() for v in first.values())
    for k, v in _tensors().items():
        assert v.dtype == first[k].dtype and torch.equal(v, first[k]), k
    assert first["t"].is_contiguous() and first["w"].untyped_storage().nbytes() == 48  # own storage, exact size
    stager.release()
    second = stager.stage(_tensors(2.0))  # same shape set: the same buffers, new values
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs
    assert stager.allocated_bytes == 106
    assert torch.equal(second["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2)
    stager.release()
    changed = _tensors()
    changed["w"] = torch.ones(6, 4)  # a new shape: a new buffer; the unchanged ones stay
    third = stager.stage(changed)
    assert stager.allocated_bytes == 106 + 96 and stager.held_bytes() == 96 + 10 + 48
    assert third["b"].data_ptr() == ptrs["b"] and torch.equal(third["w"], torch.ones(6, 4))
    stager.release()
    assert stager.close() and stager.held_bytes() == 0


def test_stage_waits_for_the_previous_write_to_release():
    stager = HostStagingBuffers(pinned=False, shared=False)
    held = stager.stage(_tensors())
    done = []

    def next_save():
        done.append(stager.stage(_tensors(3.0)))

    t = threading.Thread(target=next_save)
    t.start()
    time.sleep(0.3)
    assert not done  # the write still uses the buffers: not overwritten
    assert torch.equal(held["b"], torch.ones(5, dtype=torch.bfloat16))
    assert not stager.close(timeout=0)  # nor freed
    stager.release()
    t.join(10)
    assert done and torch.equal(done[0]["b"], torch.full((5,), 3.0, dtype=torch.bfloat16))
    assert stager.waited_s >= 0.25
    stager.release()


def test_convert_runs_one_tensor_at_a_time():
    """A quantized state is dequantized one tensor at a time: when ``convert`` runs, no earlier result's memory is
    alive (tracked on the storage itself, not on the Python object)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    made, seen_alive = [], []

    def convert(t):
        seen_alive.append(sum(not ref.expired() for ref in made))
        out = t.float() * 2  # stands for a dequantized copy
        made.append(StorageWeakRef(out.untyped_storage()))
        return out

    stager = HostStagingBuffers(pinned=False, shared=False)
    src = {f"k{i}": torch.full((4, 3), float(i), dtype=torch.bfloat16) for i in range(5)}
    out = stager.stage(src, convert=convert)
    assert seen_alive == [0, 0, 0, 0, 0] and all(ref.expired() for ref in made)
    for i in range(5):
        assert out[f"k{i}"].dtype == torch.float32 and torch.equal(out[f"k{i}"], torch.full((4, 3), 2.0 * i))
    assert stager.staged_bytes == 5 * 12 * 4
    stager.release()


def test_stage_refuses_meta_and_frees_on_error():
    stager = HostStagingBuffers(pinned=False, shared=False)
    with pytest.raises(Exception, match="'m' is not a tensor with data"):
        stager.stage({"m": torch.empty(3, device="meta")})
    assert stager.close(timeout=0)  # the failed stage released the buffers


def _two_saves_body(rank, world, base, kind):
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8) + 100 * rank
    sd = {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),
          "r": ShardedTensor.from_rank_offsets("r", torch.ones(4, dtype=torch.bfloat16), replica_id=rank)}
    queue = AsyncCallsQueue(persistent=True)
    stager = host_staging.get_host_stager(shared=kind == "process")
    stager.close()
    allocated = []
    for it in range(2):
        d = os.path.join(base, f"iter_{it}")
        if rank == 0:
            os.makedirs(d)
        dist.barrier()
        strategy = TorchDistSaveShardedStrategy()
        strategy.async_checkpointer_type = kind
        queue.schedule_async_request(dist_checkpointing.save(sd, d, strategy, async_sharded_save=True))
        allocated.append(stager.allocated_bytes)
        w.add_(1.0)  # training goes on: not in this checkpoint
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    per_rank = 8 * 8 * 4 + (8 if rank == 0 else 0)  # its shard of w; rank 0 also writes the replicated r
    assert allocated[1] == allocated[0] >= per_rank, allocated  # the second save allocated nothing
    assert stager.staged_bytes == per_rank
    for it in range(2):
        full = dist_checkpointing.load_plain_tensors(os.path.join(base, f"iter_{it}"))
        expected = torch.cat([torch.arange(64, dtype=torch.float32).reshape(8, 8) + 100 * r + it
                              for r in range(world)])
        assert torch.equal(full["w"], expected), (it, full["w"])
    stager.close()


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_two_async_saves_reuse_buffers_and_keep_their_values(tmp_path, kind):
    run_distributed(_two_saves_body, 2, str(tmp_path), kind, timeout=120)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA needed")
def test_pinned_staging_from_cuda():
    stager = HostStagingBuffers(pinned=True, shared=False)
    src = {k: v.cuda() for k, v in _tensors().items()}
    out = stager.stage(src)
    assert all(v.is_pinned() and v.device.type == "cpu" for v in out.values())
    for k, v in src.items():
        assert torch.equal(out[k], v.cpu()), k
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    stager.release()
    assert {k: v.data_ptr() for k, v in stager.stage(src).items()} == ptrs
    stager.release()
    assert stager.close()


def _quantized_async_body(rank, world, base):
    from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor

    torch.manual_seed(0)
    weights = [FakeQuantizedTensor.quantize(torch.randn(8, 16), "delayed") for _ in range(3)]
    expected = [w.dequantize().clone() for w in weights]
    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", w, replica_id=rank) for i, w in enumerate(weights)}
    strategy = TorchDistSaveShardedStrategy()
    strategy.async_checkpointer_type = "thread"
    queue = AsyncCallsQueue()
    before = FakeQuantizedTensor.dequantize_calls
    queue.schedule_async_request(dist_checkpointing.save(sd, base, strategy, async_sharded_save=True))
    # once per weight, while staging, on the rank that writes them (rank 0: the main replicas)
    assert FakeQuantizedTensor.dequantize_calls - before == (3 if rank == 0 else 0)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    full = dist_checkpointing.load_plain_tensors(base)
    for i, e in enumerate(expected):
        assert full[f"w{i}"].dtype == e.dtype and torch.equal(full[f"w{i}"], e), i


def test_async_save_of_quantized_weights_stages_their_values(tmp_path):
    run_distributed(_quantized_async_body, 2, str(tmp_path), timeout=90)
