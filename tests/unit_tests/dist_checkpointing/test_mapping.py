"""ShardedTensor / ShardedObject / factory metadata, dict helpers and the sharding integrity check (no processes)."""
import itertools

import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import diff, extract_matching_values, merge, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from megatron.core.dist_checkpointing.validation import flat_range_boxes, sharding_integrity_errors


def test_from_rank_offsets():
    sh = ShardedTensor.from_rank_offsets("k", torch.zeros(3, 4), (0, 2, 5), (2, 1, 3), prepend_axis_num=1)
    # axis 0 is the prepended singleton axis, axes 1, 2 are the data's
    assert sh.global_shape == (5, 3, 12) and sh.global_offset == (2, 0, 4)
    assert sh.local_shape == (3, 4) and sh.axis_fragmentations == (5, 1, 3)
    assert sh.global_slice() == (2, slice(0, 3), slice(4, 8))
    assert sh.local_chunk_offset_in_global() == (2, 0, 1)
    assert sh.max_allowed_chunks() == (1, 3, 4)
    wd = sh.without_data()
    assert wd.data is None and wd.global_shape == sh.global_shape
    with pytest.raises(CheckpointingException, match="duplicated axis"):
        ShardedTensor.from_rank_offsets("k", torch.zeros(2), (0, 0, 2), (0, 1, 2))
    with pytest.raises(CheckpointingException, match="rank offset"):
        ShardedTensor.from_rank_offsets("k", torch.zeros(2), (0, 2, 2))


def test_flat_and_explicit():
    sh = ShardedTensor.from_rank_offsets_flat(
        "k", torch.zeros(5), (3, 4), (0, 1, 2), flattened_range=slice(3, 8), replica_id=(0, 1)
    )
    assert sh.global_shape == (6, 4) and sh.global_offset == (3, 0) and sh.numel() == 5
    assert not is_main_replica(sh.replica_id) and is_main_replica((0, 0)) and is_main_replica(0)
    with pytest.raises(CheckpointingException, match="data shape"):
        ShardedTensor.from_rank_offsets_flat("k", torch.zeros(4), (3, 4), flattened_range=slice(3, 8))
    with pytest.raises(CheckpointingException, match="flattened_range"):
        ShardedTensor.from_rank_offsets_flat("k", torch.zeros(5), (2, 2), flattened_range=slice(0, 5))
    # uneven and empty explicit shards
    e = ShardedTensor.from_global_offsets("k", torch.zeros(0, 3), (5, 3), (5, 0))
    assert e.numel() == 0 and e.axis_fragmentations is None
    with pytest.raises(CheckpointingException, match="exceeds global shape"):
        ShardedTensor.from_global_offsets("k", torch.zeros(2, 3), (5, 3), (4, 0))


def test_sharded_object_keys():
    o = ShardedObject("optimizer", {"a": 1}, (1, 2), (0, 1))
    assert o.unique_key == "optimizer/shard_0.1_1.2"
    p = ShardedObject.empty_from_unique_key("a/b/shard_0.0_1.2")
    assert p.key == "a/b" and p.global_offset == (0, 0) and p.global_shape == (1, 2) and p.data is None
    with pytest.raises(CheckpointingException, match="offset"):
        ShardedObject("x", None, (2,), (2,))


def test_factories():
    def build(key, data, replica_id, flattened_range):
        return {"h": ShardedTensor.from_rank_offsets(key + ".h", data * 2, replica_id=replica_id)}

    sd = {"a": [ShardedTensorFactory("f", torch.ones(2), build, lambda sub: sub["h"] + 1)], "b": 3}
    orig = {"a": list(sd["a"]), "b": 3}
    apply_factories(sd)
    assert isinstance(sd["a"][0]["h"], ShardedTensor) and sd["a"][0]["h"].key == "f.h"
    loaded = {"a": [{"h": torch.full((2,), 4.0)}], "b": 3}
    merged = apply_factory_merges(loaded, orig)
    assert torch.equal(merged["a"][0], torch.full((2,), 5.0))


def test_dict_utils():
    x = {"a": 1, "b": [2, "s", {"c": 3}], "d": {"e": "t"}}
    m, n = extract_matching_values(x, lambda v: isinstance(v, int))
    assert m == {"a": 1, "b": [2, {"c": 3}]} and n == {"b": ["s"], "d": {"e": "t"}}
    m, _ = extract_matching_values(x, lambda v: isinstance(v, int), return_lists_as_dicts=True)
    assert m == {"a": 1, "b": {0: 2, 2: {"c": 3}}}
    assert sorted(map(str, nested_values(x))) == ["1", "2", "3", "s", "t"]
    assert merge({"a": {"b": 1}}, {"a": {"c": 2}, "d": 3}) == {"a": {"b": 1, "c": 2}, "d": 3}
    assert merge({"l": [1, {"a": 1}]}, {"l": {1: {"b": 2}}}) == {"l": [1, {"a": 1, "b": 2}]}
    with pytest.raises(ValueError, match="a"):
        merge({"a": 1}, {"a": 2})
    only_l, only_r, mism = diff({"a": torch.ones(2), "b": 1}, {"a": torch.zeros(2), "c": 1})
    assert only_l == [("b",)] and only_r == [("c",)] and [m[0] for m in mism] == [("a",)]


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5)])
def test_flat_range_boxes_cover_exactly(shape):
    numel = 1
    for s in shape:
        numel *= s
    idx = torch.arange(numel).reshape(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, start, stop)
        got = []
        for off, bshape in boxes:
            got.extend(idx[tuple(slice(o, o + b) for o, b in zip(off, bshape))].reshape(-1).tolist())
        # row-major order, contiguous, exactly the range
        assert got == list(range(start, stop)), (shape, start, stop, boxes)
        assert len(boxes) <= 2 * len(shape) - 1


def _st(key, shape, offset, gshape, replica=0, dtype=torch.float32):
    return ShardedTensor(key, None, dtype, shape, gshape, offset, None, replica)


def test_sharding_integrity():
    ok = [[_st("k", (3, 2), (0, 0), (5, 2))], [_st("k", (2, 2), (3, 0), (5, 2))], [_st("k", (0, 2), (5, 0), (5, 2))]]
    assert sharding_integrity_errors(ok) == []
    # non-main replicas may overlap anything
    assert sharding_integrity_errors(ok + [[_st("k", (5, 2), (0, 0), (5, 2), replica=1)]]) == []
    overlap = [[_st("k", (3, 2), (0, 0), (5, 2))], [_st("k", (3, 2), (2, 0), (5, 2))]]
    (err,) = sharding_integrity_errors(overlap)
    assert "overlapping" in err and "'k'" in err
    gap = [[_st("k", (2, 2), (0, 0), (5, 2))], [_st("k", (2, 2), (3, 0), (5, 2))]]
    (err,) = sharding_integrity_errors(gap)
    assert "incomplete" in err and "8 of 10" in err
    dtypes = [[_st("k", (5, 2), (0, 0), (5, 2))], [_st("k", (5, 2), (0, 0), (5, 2), 1, torch.bfloat16)]]
    assert "inconsistent dtypes" in sharding_integrity_errors(dtypes)[0]
    # flattened ranges of a (4, 3) shard cover it exactly ...
    flat = [
        [ShardedTensor.from_rank_offsets_flat("f", torch.zeros(b - a), (4, 3), flattened_range=slice(a, b))]
        for a, b in [(0, 5), (5, 6), (6, 12)]
    ]
    assert sharding_integrity_errors([[s.without_data() for s in r] for r in flat]) == []
    # ... and overlapping flat ranges are caught
    flat.append([ShardedTensor.from_rank_offsets_flat("f", torch.zeros(2), (4, 3), flattened_range=slice(4, 6))])
    assert "overlapping" in sharding_integrity_errors([[s.without_data() for s in r] for r in flat])[0]
    # objects: duplicate main replica, incomplete grid
    objs = [[ShardedObject("o", None, (2,), (0,))], [ShardedObject("o", None, (2,), (0,))]]
    assert "more than one main replica" in sharding_integrity_errors(objs)[0]
    assert "incomplete" in sharding_integrity_errors([[ShardedObject("o", None, (2,), (0,))]])[0]


def test_default_strategies_and_config(tmp_path):
    import json

    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    save_s = get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)
    assert isinstance(save_s, TorchDistSaveShardedStrategy) and (save_s.backend, save_s.version) == ("torch_dist", 1)
    assert save_s.keep_only_main_replica and save_s.thread_count == 1
    load_s = get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)
    load_s.stream_ckpt_dequant = True  # a copy: the default stays off
    assert get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1).stream_ckpt_dequant is False
    with pytest.raises(CheckpointingException, match="zarr"):
        get_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1)
    with pytest.raises(CheckpointingException, match="zarr"):
        TorchDistLoadShardedStrategy().check_backend_compatibility("zarr")
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    with pytest.raises(CheckpointingException, match=r"metadata\.json.*zarr"):
        get_default_load_sharded_strategy(tmp_path)
    (tmp_path / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointingException, match=r"metadata\.json"):
        get_default_load_sharded_strategy(tmp_path)
