"""N-D flattened tensors (the distributed optimizer's state) keep their original global shape in the DCP metadata's
``mcore_data`` (set by the save planner), and a checkpoint whose ``.metadata`` lacks it (written by this fork under
torch 2.11) still loads: the shape ``grid + (n,)`` is recognised as the reformulation of the requested shape."""
import math
import os
import pickle

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from tests.unit_tests.dist_utils import run_distributed

FULL = torch.arange(48.0).reshape(8, 6)


def _flat(value, lo, hi, key="opt.w"):
    """Elements [lo, hi) of ``value`` flattened, as the distributed optimizer describes its main-param slices."""
    return ShardedTensor.from_rank_offsets_flat(key, value.reshape(-1)[lo:hi].clone(), value.shape,
                                                flattened_range=slice(lo, hi))


def _save(rank, world, d):
    n = FULL.numel() // world
    dist_checkpointing.save({"w": _flat(FULL, rank * n, (rank + 1) * n)}, d)


def _strip_mcore_data(d):
    path = os.path.join(d, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # the test's own file, just written
    md.__dict__.pop("mcore_data", None)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _load(rank, world, d, requested_shape):
    n = math.prod(requested_shape) // world
    lo, hi = rank * n, (rank + 1) * n
    value = torch.zeros(requested_shape)
    out = dist_checkpointing.load({"w": _flat(value, lo, hi)}, d)
    assert torch.equal(out["w"], FULL.reshape(-1)[lo:hi])


_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(_TORCH < (2, 13), reason="under torch 2.11 (H200, 2026-12-04) the attribute does not reach the "
                    "file; those checkpoints load through the layout recognition below")
def test_planner_records_the_original_shape(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    d = str(tmp_path / "ck")
    os.makedirs(d)
    run_distributed(_save, 2, d)
    md = FileSystemReader(d).read_metadata()
    assert tuple(md.state_dict_metadata["opt.w"].size) == (1, 1, 48)
    assert md.mcore_data["opt.w"]["nd_reformulated_orig_global_shape"] == (8, 6)


def test_checkpoint_without_mcore_data_still_loads(tmp_path):
    d = str(tmp_path / "ck")
    os.makedirs(d)
    run_distributed(_save, 2, d)
    _strip_mcore_data(d)
    run_distributed(_load, 2, d, (8, 6))  # the same layout
    run_distributed(_load, 1, d, (8, 6))  # another DP size


def test_without_mcore_data_a_different_size_is_still_refused(tmp_path):
    d = str(tmp_path / "ck")
    os.makedirs(d)
    run_distributed(_save, 1, d)
    _strip_mcore_data(d)
    with pytest.raises(AssertionError, match="CheckpointingException: global shape mismatch for key 'opt.w'.*"
                                             "requested \\(10, 6\\), checkpoint has \\(1, 1, 48\\)"):
        run_distributed(_load, 1, d, (10, 6))
