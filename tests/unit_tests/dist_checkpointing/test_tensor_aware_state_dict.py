"""MCoreTensorAwareStateDict (upstream's tensor_aware_state_dict module): from_state_dict / pop / insert / init /
CPU copies / to_state_dict, on 1 and 2 gloo ranks (fully parallel: each rank keeps only the shards it saves)."""
import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
from tests.unit_tests.dist_utils import run_distributed


def _sharded(rank, world_size, scale=1.0):
    """A row-sharded 'w', a fully replicated 'b', an object, a common value and a nonpersistent one."""
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3) * scale
    rows = 8 // world_size
    return {
        "w": ShardedTensor.from_rank_offsets("w", full[rank * rows:(rank + 1) * rows].clone(), (0, rank, world_size)),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((4,), 7.0 * scale), replica_id=rank),
        "obj": ShardedObject("obj", {"step": int(10 * scale)}, (1,), (0,), replica_id=rank),
        "iteration": 5,
        "rng": LocalNonpersistentObject("local"),
    }


def _body(rank, world_size, algo):
    tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(_sharded(rank, world_size), algo=algo)
    assert tasd.common_state_dict == {"iteration": 5}
    held = [t.clone() for t in tasd.tensors]
    if algo == "fully_parallel" and world_size == 2:
        assert distribution is not None
        # 'w' has one shard per rank; the replicated 'b' is kept by exactly one rank
        assert len(held) in (1, 2)
        counts = [torch.tensor(len(held))]
        torch.distributed.all_reduce(counts[0])
        assert counts[0].item() == 3
    else:
        assert len(held) == 2

    popped = tasd.pop_tensors()
    assert tasd.is_hollow and all(torch.equal(a, b) for a, b in zip(popped, held))
    with pytest.raises(CheckpointingException, match="hollow"):
        list(tasd.tensors)
    tasd.insert_tensors(popped)
    assert not tasd.is_hollow

    tasd.copy_tensors_to_cpu()
    assert all(torch.equal(a, b) for a, b in zip(tasd.tensors, held))
    tasd.restore_tensor_device()

    # a fresh model state dict (different values) gets the saved ones back
    state, missing, unexpected = tasd.to_state_dict(_sharded(rank, world_size, scale=0.0), algo=algo,
                                                    return_mismatch_keys=True)
    expect = _sharded(rank, world_size)
    assert not missing and not unexpected
    assert torch.equal(state["w"], expect["w"].data) and torch.equal(state["b"], expect["b"].data)
    assert state["obj"] == {"step": 10} and state["iteration"] == 5 and state["rng"] == "local"


@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_round_trip_one_rank(tmp_path, algo):
    run_distributed(_body, 1, algo)


def test_round_trip_fully_parallel_two_ranks(tmp_path):
    run_distributed(_body, 2, "fully_parallel")


def _init_body(rank, world_size):
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_sharded(rank, world_size), algo="atomic")
    tasd.pop_tensors()
    tasd.init_tensors()
    shapes = sorted(tuple(t.shape) for t in tasd.tensors)
    assert shapes == [(4,), (8, 3)] and all(t.dtype == torch.float32 for t in tasd.tensors)
    with pytest.raises(CheckpointingException, match="not hollow"):
        tasd.insert_tensors([])
    with pytest.raises(NotImplementedError, match="'atomic' and 'fully_parallel'"):
        MCoreTensorAwareStateDict.from_state_dict(_sharded(rank, world_size), algo="bogus")


def test_init_tensors_and_bad_input(tmp_path):
    run_distributed(_init_body, 1)


def _cached_body(rank, world_size):
    _, distribution = MCoreTensorAwareStateDict.from_state_dict(_sharded(rank, world_size))
    tasd, again = MCoreTensorAwareStateDict.from_state_dict(_sharded(rank, world_size), cached_metadata=distribution)
    assert again is distribution
    first = [t.clone() for t in MCoreTensorAwareStateDict.from_state_dict(_sharded(rank, world_size))[0].tensors]
    assert all(torch.equal(a, b) for a, b in zip(tasd.tensors, first))


def test_cached_distribution_is_reused(tmp_path):
    run_distributed(_cached_body, 2)
