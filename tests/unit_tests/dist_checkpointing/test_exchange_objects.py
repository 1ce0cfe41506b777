"""exchange_utils.exchange_loaded_objects_gather_object (upstream's): every rank's loaded objects merged over WORLD;
duplicate shard ids refused; the tensor gather_object exchange refuses duplicates the same way (2 gloo ranks)."""
import pytest
import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.exchange_utils import (
    exchange_loaded_objects_gather_object,
    exchange_loaded_tensors_gather_object,
)
from tests.unit_tests.dist_utils import run_distributed


def _body(rank, world):
    merged = exchange_loaded_objects_gather_object({f"obj{rank}": {"rank": rank}})
    assert merged == {"obj0": {"rank": 0}, "obj1": {"rank": 1}}
    with pytest.raises(CheckpointingException, match=r"^Duplicate shard ids loaded by different ranks: shard same"):
        exchange_loaded_objects_gather_object({"same": rank})
    with pytest.raises(CheckpointingException, match="Duplicate shard ids loaded by different ranks"):
        exchange_loaded_tensors_gather_object({"t": torch.ones(1)}, {}, None)


def test_exchange_loaded_objects_two_ranks():
    run_distributed(_body, 2)
