"""Upstream's ``megatron.training.initialize._set_random_seed`` and ``model_parallel_cuda_manual_seed``'s keywords
(``tp_rank`` / ``ep_rank`` / ``etp_rank``, ``use_cudagraphable_rng`` accepted): the pipeline rank offsets the seed by
100, ``data_parallel_random_init`` the data-parallel rank by 10, ranks may come from given groups, and a seed that is
not positive is refused with upstream's message."""
import random

import pytest
import torch

from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.training.initialize import _set_random_seed


class _Group:
    def __init__(self, rank, size=8):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _draws():
    return random.random(), torch.rand(3)


def _tracker_draw():
    with get_cuda_rng_tracker().fork():
        return torch.rand(2)


def test_seed_offsets_by_pipeline_and_data_parallel_rank():
    _set_random_seed(1234)
    base = _draws()
    _set_random_seed(1134, pp_group=_Group(1))  # 1134 + 100 * 1 == 1234
    again = _draws()
    assert again[0] == base[0] and torch.equal(again[1], base[1])
    _set_random_seed(1204, data_parallel_random_init=True, dp_group=_Group(3))  # 1204 + 10 * 3
    dp = _draws()
    assert dp[0] == base[0] and torch.equal(dp[1], base[1])
    _set_random_seed(1204, dp_group=_Group(3))  # without data_parallel_random_init the dp rank is not used
    assert _draws()[0] != base[0]


def test_tracker_seed_from_given_ranks():
    model_parallel_cuda_manual_seed(7, tp_rank=1)
    tp1 = _tracker_draw()
    model_parallel_cuda_manual_seed(7)  # parallel_state not initialised: tp rank 0
    tp0 = _tracker_draw()
    model_parallel_cuda_manual_seed(7, tp_rank=1, force_reset_rng=True)
    assert torch.equal(_tracker_draw(), tp1) and not torch.equal(tp0, tp1)


def test_refusals():
    for bad in (0, -3, None):
        with pytest.raises(ValueError, match=r"Seed \(.*\) should be a positive integer"):
            _set_random_seed(bad)



def test_cudagraphable_rng_is_accepted_and_draws_the_same():
    """Upstream's loop passes use_cudagraphable_rng=True under --cuda-graph-impl: accepted, the same streams."""
    model_parallel_cuda_manual_seed(5)
    plain = _tracker_draw()
    model_parallel_cuda_manual_seed(5, use_cudagraphable_rng=True)
    assert torch.equal(_tracker_draw(), plain)
