"""Context parallelism: the load-balanced layout and the torch ring attention (forward and backward equal to unsplit
causal attention), for real over gloo on 2 and 4 CPU ranks."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer.context_parallel import cp_rank_positions, ring_attention, split_for_cp_rank
from tests.unit_tests.dist_utils import run_distributed


def test_layout_is_load_balanced_and_covers_the_sequence():
    # cp 2, s 8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    t = torch.arange(16).view(1, 16)
    parts = [split_for_cp_rank(t, 1, 4, r) for r in range(4)]
    assert sorted(torch.cat(parts, 1).view(-1).tolist()) == list(range(16))
    for r in range(4):
        assert parts[r].view(-1).tolist() == cp_rank_positions(16, 4, r).tolist()
        # causal work (keys visible to the rank's queries) is the same on every rank
        assert int(cp_rank_positions(16, 4, r).sum()) == int(cp_rank_positions(16, 4, 0).sum())
    with pytest.raises(ValueError, match="multiple of 2 x --context-parallel-size"):
        split_for_cp_rank(torch.zeros(1, 6), 1, 2, 0)


def _ring_body(rank, world_size, comm_type):
    torch.manual_seed(0)
    b, n, s, d = 2, 3, 16, 8
    q, k, v, dout = (torch.randn(b, n, s, d, dtype=torch.float32) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.backward(dout)
    local = [split_for_cp_rank(t, 2, world_size, rank).clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, dist.group.WORLD, comm_type)
    out.backward(split_for_cp_rank(dout, 2, world_size, rank))
    torch.testing.assert_close(out, split_for_cp_rank(ref, 2, world_size, rank), rtol=1e-5, atol=1e-5)
    for mine, full in zip(local, ref_in):
        torch.testing.assert_close(mine.grad, split_for_cp_rank(full.grad, 2, world_size, rank), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("world_size,comm_type", [(2, "p2p"), (4, "p2p"), (2, "allgather")])
def test_ring_attention_equals_unsplit_attention(tmp_path, world_size, comm_type):
    run_distributed(_ring_body, world_size, comm_type)


def test_refusals_name_the_flag():
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, context_parallel_size=2)
    TransformerConfig(**base)  # accepted
    with pytest.raises(ValueError, match="--attention-dropout"):
        TransformerConfig(**base, attention_dropout=0.1)
    with pytest.raises(ValueError, match="hierarchical-context-parallel-sizes"):
        TransformerConfig(**base, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="--cp-comm-type a2a needs --transformer-impl transformer_engine"):
        TransformerConfig(**base, cp_comm_type="a2a")
    with pytest.raises(ValueError, match="one per layer"):
        TransformerConfig(**base, cp_comm_type=["p2p", "p2p", "p2p"])
    with pytest.raises(ValueError, match="--context-parallel-size"):
        TransformerConfig(**{**base, "context_parallel_size": 0})
    with pytest.raises(ValueError, match="--num-experts"):
        TransformerConfig(**base, num_moe_experts=2)


def _groups_body(rank, world_size):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        ranks = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
        # upstream's order tp-cp-ep-dp-pp: CP varies fastest (TP 1), then DP
        assert ps.get_context_parallel_global_ranks() == ranks(ps.get_context_parallel_group()) == \
            [rank // 2 * 2, rank // 2 * 2 + 1]
        assert ps.get_context_parallel_world_size() == 2 and ps.get_context_parallel_rank() == rank % 2
        assert ranks(ps.get_data_parallel_group()) == [rank % 2, rank % 2 + 2]
        assert ranks(ps.get_data_parallel_group(with_context_parallel=True)) == [0, 1, 2, 3]
        assert ps.get_data_parallel_world_size() == 2 and ps.get_data_parallel_world_size(with_context_parallel=True) == 4
        assert ps.get_data_parallel_rank(with_context_parallel=True) == rank
        assert ranks(ps.get_tensor_and_context_parallel_group()) == ranks(ps.get_context_parallel_group())
    finally:
        ps.destroy_model_parallel()


def test_context_parallel_groups_in_upstream_order(tmp_path):
    run_distributed(_groups_body, 4)
