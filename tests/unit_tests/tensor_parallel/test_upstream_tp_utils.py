"""Upstream's public helpers of ``megatron.core.tensor_parallel.utils`` and ``megatron.core.utils`` under their
upstream names (upstream's tests/unit_tests/tensor_parallel/test_tensor_parallel_utils.py imports them): last-dim
split, 1-D split / gather over the tensor-parallel group (2 gloo ranks), ``VocabUtility``,
``get_tensor_model_parallel_group_if_none``."""
import pytest
import torch

import megatron.core.tensor_parallel.utils as tp_utils
from megatron.core import parallel_state
from megatron.core.utils import get_tensor_model_parallel_group_if_none
from tests.unit_tests.dist_utils import run_distributed


def test_split_tensor_along_last_dim():
    t = torch.arange(24.0).view(2, 3, 4)
    a, b = tp_utils.split_tensor_along_last_dim(t, 2)
    assert torch.equal(a, t[..., :2]) and torch.equal(b, t[..., 2:])
    assert not a.is_contiguous()
    c, d = tp_utils.split_tensor_along_last_dim(t, 2, contiguous_split_chunks=True)
    assert c.is_contiguous() and torch.equal(d, t[..., 2:])
    with pytest.raises(ValueError, match="not divisible by 3"):
        tp_utils.split_tensor_along_last_dim(t, 3)


def test_vocab_utility():
    vu = tp_utils.VocabUtility
    assert vu.vocab_range_from_per_partition_vocab_size(400, 2, 4) == (800, 1200)
    assert vu.vocab_range_from_global_vocab_size(1600, 3, 4) == (1200, 1600)
    with pytest.raises(ValueError, match="not divisible"):
        vu.vocab_range_from_global_vocab_size(1601, 0, 4)


def test_group_if_none_without_distributed():
    assert get_tensor_model_parallel_group_if_none(None) is None


def _split_gather_body(rank, ws):
    assert get_tensor_model_parallel_group_if_none("given") == "given"  # no parallel_state groups yet: passed through
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        group = get_tensor_model_parallel_group_if_none(None)
        assert group is parallel_state.get_tensor_model_parallel_group()
        t = torch.arange(12.0).view(3, 4)
        piece = tp_utils.split_tensor_into_1d_equal_chunks(t)
        assert torch.equal(piece, t.flatten()[rank * 6:(rank + 1) * 6])
        assert piece.data_ptr() == t.view(-1)[rank * 6:].data_ptr()  # a view
        copy = tp_utils.split_tensor_into_1d_equal_chunks(t, new_buffer=True)
        assert torch.equal(copy, piece) and copy.data_ptr() != piece.data_ptr()
        gathered = tp_utils.gather_split_1d_tensor(torch.full((2, 2), float(rank)))
        assert torch.equal(gathered, torch.tensor([0.0] * 4 + [1.0] * 4))
        assert torch.equal(tp_utils.gather_split_1d_tensor(piece), t.flatten())
    finally:
        parallel_state.destroy_model_parallel()


def test_split_and_gather_1d_over_two_ranks():
    run_distributed(_split_gather_body, 2)
