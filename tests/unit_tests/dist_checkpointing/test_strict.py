"""Strict key handling at load (upstream naming: "unexpected" = requested but not in the checkpoint, "missing" = in
the checkpoint but requested by no rank)."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag
from tests.unit_tests.dist_utils import run_distributed


def test_parse_strict_flag():
    assert parse_strict_flag("raise_all") is StrictHandling.RAISE_ALL
    assert parse_strict_flag(StrictHandling.LOG_UNEXPECTED) is StrictHandling.LOG_UNEXPECTED
    assert parse_strict_flag(True) is StrictHandling.RAISE_ALL
    assert parse_strict_flag(False) is StrictHandling.ASSUME_OK_UNEXPECTED
    assert [s.value for s in StrictHandling] == [
        "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
        "return_unexpected", "return_all", "ignore_all",
    ]
    with pytest.raises(ValueError, match="bogus"):
        parse_strict_flag("bogus")


def _body(rank, world, tmp_path):
    d = os.path.join(str(tmp_path), "ck")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    dist_checkpointing.save(
        {
            "a": ShardedTensor.from_rank_offsets("a", torch.full((2,), float(rank)), (0, rank, world)),
            "b": ShardedTensor.from_rank_offsets("b", torch.ones(3), replica_id=rank),
            "o": ShardedObject("obj", {"x": 1}, (1,), (0,), replica_id=rank),
        },
        d,
    )

    def request():
        # 'a' requested, 'b' and 'obj' not (missing); 'new' is not in the checkpoint (unexpected)
        return {
            "a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), (0, rank, world)),
            "new": ShardedTensor.from_rank_offsets("new", torch.full((1,), 7.0), (0, rank, world)),
        }

    # default: a requested key absent from the checkpoint is an error naming it
    with pytest.raises(CheckpointingException, match="'new'"):
        dist_checkpointing.load(request(), d)
    with pytest.raises(CheckpointingException, match=r"unexpected.*'new'"):
        dist_checkpointing.load(request(), d, strict=StrictHandling.RAISE_UNEXPECTED)
    with pytest.raises(CheckpointingException, match=r"missing.*'b'.*'obj'"):
        dist_checkpointing.load(request(), d, strict="raise_all")

    out, missing, unexpected = dist_checkpointing.load(request(), d, strict=StrictHandling.RETURN_ALL)
    assert missing == {"b", "obj"} and unexpected == {"new"}
    assert torch.equal(out["a"], torch.full((2,), float(rank))) and "new" not in out
    out, missing, unexpected = dist_checkpointing.load(request(), d, strict="return_unexpected")
    assert missing == set() and unexpected == {"new"}
    for mode in ("log_unexpected", "log_all", "ignore_all"):
        out = dist_checkpointing.load(request(), d, strict=mode)
        assert torch.equal(out["a"], torch.full((2,), float(rank))) and "new" not in out, mode

    # everything requested somewhere: nothing missing (rank 0 requests b, rank 1 requests the object)
    req = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), (0, rank, world))}
    if rank == 0:
        req["b"] = ShardedTensor.from_rank_offsets("b", torch.zeros(3))
    else:
        req["o"] = ShardedObject("obj", None, (1,), (0,))
    out, missing, unexpected = dist_checkpointing.load(req, d, strict=StrictHandling.RETURN_ALL)
    assert missing == set() and unexpected == set()
    assert (torch.equal(out["b"], torch.ones(3)) if rank == 0 else out["o"] == {"x": 1})


def test_strict_modes(tmp_path):
    run_distributed(_body, 2, tmp_path)
