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


def _mla_ring_body(rank, world_size):
    """Multi-latent attention's shapes: a value head size (5) other than the query/key one (8), its own scale."""
    torch.manual_seed(1)
    b, n, s, d, dv, scale = 2, 3, 16, 8, 5, 0.21
    q, k = (torch.randn(b, n, s, d) for _ in range(2))
    v, dout = (torch.randn(b, n, s, dv) for _ in range(2))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, scale=scale)
    ref.backward(dout)
    for comm_type in ("p2p", "allgather"):
        local = [split_for_cp_rank(t, 2, world_size, rank).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, dist.group.WORLD, comm_type, scale=scale)
        assert out.shape == (b, n, s // world_size, dv)
        out.backward(split_for_cp_rank(dout, 2, world_size, rank))
        torch.testing.assert_close(out, split_for_cp_rank(ref, 2, world_size, rank), rtol=1e-5, atol=1e-5)
        for mine, full in zip(local, ref_in):
            torch.testing.assert_close(mine.grad, split_for_cp_rank(full.grad, 2, world_size, rank), rtol=1e-5,
                                       atol=1e-5)


def test_ring_attention_with_another_value_head_size_and_scale():
    run_distributed(_mla_ring_body, 2)


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
    TransformerConfig(**base, num_moe_experts=2, moe_ffn_hidden_size=16, mtp_num_layers=1)  # compose with CP
    TransformerConfig(**base, window_size=(4, 0), softmax_type="learnable")
    with pytest.raises(ValueError, match="--cp-comm-type a2a with sliding windows"):
        TransformerConfig(**base, window_size=(4, 0), cp_comm_type="a2a", transformer_impl="transformer_engine")
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    MLATransformerConfig(**base, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=4)
    with pytest.raises(ValueError, match="--cp-comm-type a2a with multi-latent attention"):
        MLATransformerConfig(**base, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=2,
                             v_head_dim=4, cp_comm_type="a2a", transformer_impl="transformer_engine")


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
    # with expert parallelism, as upstream: the expert layout has no CP axis (cp=1), so EP x expert-DP spans the
    # dense layout's CP x DP ranks; here EP takes the CP ranks and the expert-data-parallel group the DP ones
    ps.initialize_model_parallel(context_parallel_size=2, expert_model_parallel_size=2)
    try:
        assert ranks(ps.get_expert_model_parallel_group()) == ranks(ps.get_context_parallel_group())
        assert ranks(ps.get_expert_data_parallel_group()) == [rank % 2, rank % 2 + 2]
        assert ps.get_expert_data_parallel_world_size() == 2
    finally:
        ps.destroy_model_parallel()


def test_context_parallel_groups_in_upstream_order(tmp_path):
    run_distributed(_groups_body, 4)


def _roll_body(rank, world_size):
    """Multi-token prediction's roll of this CP rank's chunks is the roll of the whole sequence, split."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    full = torch.arange(1, 2 * 16 + 1).view(2, 16)  # [b, s], no zeros
    want, _ = roll_tensor(full)
    assert want[:, -1].tolist() == [0, 0] and want[0, :3].tolist() == [2, 3, 4]
    mine = split_for_cp_rank(full, 1, world_size, rank)
    got, total = roll_tensor(mine, cp_group=dist.group.WORLD)
    assert torch.equal(got, split_for_cp_rank(want, 1, world_size, rank)), (got, want)
    assert int(total) == int(got.sum())
    mask = torch.ones(2, 16)  # the loss mask: only the sequence's last position (rank 0's second chunk) drops
    rolled, count = roll_tensor(split_for_cp_rank(mask, 1, world_size, rank), cp_group=dist.group.WORLD)
    assert float(count) == 2 * (16 // world_size) - (2 if rank == 0 else 0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mtp_roll_across_cp_chunks_equals_the_whole_sequence_roll(world_size):
    run_distributed(_roll_body, world_size)


def _window_sink_body(rank, world_size):
    """gpt-oss's attention: a causal sliding window (from global positions: whole key blocks fall outside it on some
    ranks and are skipped) and learnable sinks, forward and backward (the sink's gradient: this rank's queries'
    share, summed over the ranks) equal to the unsplit core attention's."""
    from megatron.core.transformer.core_attention import attention, sliding_window_mask

    torch.manual_seed(2)
    b, n, s, d = 2, 3, 16, 8
    q, k, v, dout = (torch.randn(b, n, s, d) for _ in range(4))
    for window, with_sink, comm_type in (((3, 0), True, "p2p"), ((3, 0), False, "allgather"), (None, True, "p2p"),
                                         ((5, 0), True, "allgather")):
        sink = torch.randn(n, requires_grad=True) if with_sink else None
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = sliding_window_mask(s, s, window, q.device) if window is not None else None
        ref = attention(*ref_in, mask, sink)
        ref.backward(dout)
        want_dsink = None if sink is None else sink.grad.clone()
        if sink is not None:
            sink.grad = None
        local = [split_for_cp_rank(t, 2, world_size, rank).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, dist.group.WORLD, comm_type, window=window, sink=sink)
        out.backward(split_for_cp_rank(dout, 2, world_size, rank))
        what = f"window={window} sink={with_sink} {comm_type}"
        torch.testing.assert_close(out, split_for_cp_rank(ref, 2, world_size, rank), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what}: {m}")
        for mine, full in zip(local, ref_in):
            torch.testing.assert_close(mine.grad, split_for_cp_rank(full.grad, 2, world_size, rank), rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"{what}: {m}")
        if sink is not None:
            dist.all_reduce(sink.grad)
            torch.testing.assert_close(sink.grad, want_dsink, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_with_sliding_window_and_sinks_equals_unsplit_attention(world_size):
    run_distributed(_window_sink_body, world_size)
