"""Upstream's tensor-parallel attribute helpers under their names (upstream's tensor_parallel/test_tp_attrs_without_init.py
imports them): ``copy_tensor_model_parallel_attributes`` (qkv split shapes included),
``set_defaults_if_not_set_tensor_model_parallel_attributes``, and ``param_is_not_tensor_parallel_duplicate`` with
explicit ``tp_group`` / ``expert_tp_group``."""
import torch

from megatron.core.tensor_parallel import (
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)


class _Group:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


def test_copy_attributes_keeps_qkv_split_shapes():
    src, dst = torch.empty(4, 4), torch.empty(4, 4)
    src.is_qkv, src.qkv_split_shapes = True, [256, 64, 64]
    set_tensor_model_parallel_attributes(src, True, 0, 1)
    src.unrelated = "x"
    copy_tensor_model_parallel_attributes(dst, src)
    assert dst.is_qkv is True and dst.qkv_split_shapes == [256, 64, 64]
    assert (dst.tensor_model_parallel, dst.partition_dim, dst.partition_stride) == (True, 0, 1)
    assert not hasattr(dst, "unrelated") and not hasattr(dst, "expert_tp")


def test_set_defaults_only_where_missing():
    t = torch.empty(2)
    t.partition_dim = 1
    set_defaults_if_not_set_tensor_model_parallel_attributes(t)
    assert t.partition_dim == 1 and t.tensor_model_parallel is False and t.partition_stride == 1
    assert t.is_qkv is False and t.qkv_split_shapes is None and t.expert_tp is False


def test_duplicate_filter_with_explicit_groups():
    p = torch.empty(1)
    assert not param_is_not_tensor_parallel_duplicate(p, _Group(1))
    assert param_is_not_tensor_parallel_duplicate(p, _Group(0))
    p.allreduce = False  # reduced over expert data parallel: the expert TP group decides
    assert param_is_not_tensor_parallel_duplicate(p, tp_group=_Group(1), expert_tp_group=_Group(0))
    assert not param_is_not_tensor_parallel_duplicate(p, tp_group=_Group(0), expert_tp_group=_Group(1))
    split = torch.empty(1)
    set_tensor_model_parallel_attributes(split, True, 0)
    assert param_is_not_tensor_parallel_duplicate(split, _Group(3))
    assert param_is_not_tensor_parallel_duplicate(torch.empty(1))  # one process: rank 0
