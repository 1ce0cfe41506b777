"""``tensor_parallel.broadcast_data`` (upstream's name and signature) on 4 gloo ranks, TP=2: each TP group gets its
first rank's tensors (shapes of different rank, int64 tokens), other ranks' ``data`` is not read; a dtype mismatch
on the source is refused naming the key; one rank returns the tensors as they are."""
import pytest
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import broadcast_data
from tests.unit_tests.dist_utils import run_distributed


def _body(rank, ws):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        src = rank - tp_rank  # the group's first global rank
        if tp_rank == 0:
            data = {"tokens": torch.arange(12).view(2, 6) + 100 * src, "mask": torch.ones(3, dtype=torch.int64),
                    "labels": torch.full((1, 2, 3), src, dtype=torch.int64)}
        else:
            data = {}  # upstream's other ranks pass None/empty: never read
        out = broadcast_data(["tokens", "labels", "mask"], data, torch.int64)
        assert list(out) == ["tokens", "labels", "mask"]
        assert torch.equal(out["tokens"], torch.arange(12).view(2, 6) + 100 * src)
        assert torch.equal(out["labels"], torch.full((1, 2, 3), src, dtype=torch.int64))
        assert torch.equal(out["mask"], torch.ones(3, dtype=torch.int64))
    finally:
        parallel_state.destroy_model_parallel()


def test_broadcast_within_each_tp_group():
    run_distributed(_body, 4)


def test_one_rank_and_dtype_refusal():
    data = {"a": torch.ones(2, 2), "b": torch.zeros(3, dtype=torch.int64)}
    out = broadcast_data(["a"], data, torch.float32)
    assert torch.equal(out["a"], data["a"]) and list(out) == ["a"]
    with pytest.raises(TypeError, match="key 'b' has data type torch.int64"):
        broadcast_data(["a", "b"], data, torch.float32)
