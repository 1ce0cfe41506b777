"""RankGenerator / rank layout, checked against hand-computed lists for upstream's order semantics (the leftmost kind
varies fastest across global ranks; default order tp-cp-ep-dp-pp). No process groups needed."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator, generate_masked_orthogonal_rank_groups


def test_masked_groups_upstream_docstring_example():
    # sizes [tp, dp, pp] = [2, 3, 4], mask = dp only
    assert generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False]) == [
        [0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11], [12, 14, 16], [13, 15, 17], [18, 20, 22], [19, 21, 23]]
    assert generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, False, True]) == [
        [0, 6, 12, 18], [1, 7, 13, 19], [2, 8, 14, 20], [3, 9, 15, 21], [4, 10, 16, 22], [5, 11, 17, 23]]
    assert generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [True, True, True]) == [list(range(24))]


def test_world8_tp2_ep2_default_order():
    dense = RankGenerator(tp=2, ep=1, dp=4, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert dense.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dense.get_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dense.get_ranks("dp-cp") == dense.get_ranks("dp")
    assert dense.get_ranks("tp-pp") == dense.get_ranks("tp")
    assert dense.get_ranks("pp") == [[r] for r in range(8)]
    assert dense.get_ranks("tp-dp") == [list(range(8))]
    expert = RankGenerator(tp=2, ep=2, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    assert expert.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert.get_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expert.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert expert.get_ranks("tp-ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert expert.get_ranks("ep-tp") == expert.get_ranks("tp-ep")  # the token's own order does not matter


def test_order_changes_layout_and_missing_kinds_are_appended():
    g = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp")  # upstream's docstring example
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.order == "tp-pp-dp-ep-cp-gtp_remat"
    assert RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="dp-tp").get_ranks("tp") == [[0, 2], [1, 3]]


def test_rank_offset_shifts_every_rank():
    g = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-cp-ep-dp-pp", rank_offset=4)
    assert g.get_ranks("tp") == [[4, 5], [6, 7]]
    assert g.get_ranks("dp") == [[4, 6], [5, 7]]


def test_bad_orders_and_sizes_are_refused():
    with pytest.raises(RuntimeError, match=r"The size of \(ep\) is \(2\), but you haven't specified the order"):
        RankGenerator(tp=1, ep=2, dp=2, pp=1, cp=1, order="tp-dp-pp")
    with pytest.raises(ValueError, match="unknown parallelism 'xp'"):
        RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=1, order="tp-xp-dp")
    with pytest.raises(ValueError, match="twice"):
        RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=1, order="tp-dp-tp")
    with pytest.raises(ValueError, match="ep .2. and cp .2. cannot both be > 1"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    with pytest.raises(ValueError, match="unknown parallelism 'zz'"):
        RankGenerator(tp=1, ep=1, dp=2, pp=1, cp=1, order="tp-dp").get_ranks("zz")


def test_default_embedding_ranks():
    assert ps.default_embedding_ranks([3]) == [3]
    assert ps.default_embedding_ranks([1, 5, 9]) == [1, 9]
    assert ps.default_position_embedding_ranks([1, 5, 9]) == [1]


def test_global_memory_buffer_reuses_and_grows():
    buf = ps.GlobalMemoryBuffer()
    a = buf.get_tensor((2, 3), torch.float32, "x")
    assert a.shape == (2, 3)
    b = buf.get_tensor((4,), torch.float32, "x")  # smaller: same storage
    assert b.data_ptr() == a.data_ptr()
    c = buf.get_tensor((10,), torch.float32, "x")  # larger: regrown
    assert c.numel() == 10 and buf.buffer[("x", torch.float32)].numel() == 10
    d = buf.get_tensor((2,), torch.int64, "x")  # dtype is part of the key
    assert d.dtype == torch.int64 and len(buf.buffer) == 2


def test_without_torch_distributed_single_process_answers():
    import torch.distributed as dist
    assert not dist.is_initialized()
    ps.destroy_model_parallel()
    assert ps.get_data_parallel_group() is None
    assert ps.get_data_parallel_world_size() == 1 and ps.get_data_parallel_rank() == 0
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_expert_model_parallel_world_size() == 1 and ps.get_expert_tensor_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert not ps.is_initialized() and not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        ps.initialize_model_parallel()
