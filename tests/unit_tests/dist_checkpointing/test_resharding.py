"""Save with one sharding, load with another: rank counts, axes, uneven (torch.chunk / FSDP-style) shards including
empty ones, prepended axes, flattened ranges (N-D flattened reformulation) in every direction."""
import os

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from tests.unit_tests.dist_utils import run_distributed


def _full(key, shape=(8, 12), dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _ckpt_dir(tmp_path, name):
    d = os.path.join(str(tmp_path), name)
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    return d


def _chunk_offsets(n, parts):
    """torch.chunk-style rows: ceil(n/parts) per part, the last ones fewer or zero."""
    size = -(-n // parts)
    out = []
    for r in range(parts):
        start = min(r * size, n)
        stop = min(start + size, n)
        out.append((start, stop))
    return out


def _uneven(key, full, rank, world, axis=0):
    start, stop = _chunk_offsets(full.shape[axis], world)[rank]
    local = full.narrow(axis, start, stop - start).clone()
    offset = [0] * full.ndim
    offset[axis] = start
    return ShardedTensor.from_global_offsets(key, local, tuple(full.shape), tuple(offset))


def _flat(key, full, rank, world, tp_axis, tp, dp):
    """Rank = tp_rank * dp + dp_rank: TP shard along tp_axis (regular grid), of which this DP rank holds a
    contiguous flat slice (uneven: torch.chunk of the flat shard)."""
    tp_rank, dp_rank = divmod(rank, dp)
    shard = full.chunk(tp, tp_axis)[tp_rank]
    flat = shard.reshape(-1)
    start, stop = _chunk_offsets(flat.numel(), dp)[dp_rank]
    return ShardedTensor.from_rank_offsets_flat(
        key, flat[start:stop].clone(), tuple(shard.shape), (tp_axis, tp_rank, tp), flattened_range=slice(start, stop)
    )


# ---- bodies ----------------------------------------------------------------------------------------------------
def _save_4(rank, world, tmp_path):
    d = _ckpt_dir(tmp_path, "ck4")
    sd = {
        "a": ShardedTensor.from_rank_offsets("a", _full("a").chunk(4, 0)[rank].clone(), (0, rank, 4)),
        # 2x2 grid
        "b": ShardedTensor.from_rank_offsets(
            "b", _full("b").chunk(2, 0)[rank // 2].chunk(2, 1)[rank % 2].clone(), (0, rank // 2, 2), (1, rank % 2, 2)
        ),
        # 10 rows over 4 ranks, torch.chunk: 3, 3, 3, 1
        "u": _uneven("u", _full("u", (10, 3)), rank, 4),
        # 5 rows over 4 ranks: 2, 2, 1, 0 (an empty shard)
        "e": _uneven("e", _full("e", (5, 4), torch.bfloat16), rank, 4),
        # prepended axis (a layer stack of 4): rank r holds layer r
        "p": ShardedTensor.from_rank_offsets("p", _full("p", (4, 6))[rank].clone(), (0, rank, 4), prepend_axis_num=1),
        # int64 replicated
        "i": ShardedTensor.from_rank_offsets("i", torch.arange(7, dtype=torch.int64) * 3, replica_id=rank),
    }
    dist_checkpointing.save(sd, d)


def _load_from_4(rank, world, tmp_path):
    d = os.path.join(str(tmp_path), "ck4")
    a_full, b_full = _full("a"), _full("b")
    u_full, e_full, p_full = _full("u", (10, 3)), _full("e", (5, 4), torch.bfloat16), _full("p", (4, 6))
    sd = {
        # along the other axis
        "a": ShardedTensor.from_rank_offsets("a", torch.zeros(8, 12 // world), (1, rank, world)),
        # 1-D grid on axis 0 instead of 2x2
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(8 // world, 12), (0, rank, world)),
        # uneven -> uneven with another count, along axis 0
        "u": _uneven("u", torch.zeros(10, 3), rank, world),
        "e": _uneven("e", torch.zeros(5, 4, dtype=torch.bfloat16), rank, world),
        # each rank loads the whole layer stack as its own layers (prepend -> replicated full rows)
        "p": [
            ShardedTensor.from_rank_offsets("p", torch.zeros(6), (0, layer, 4), prepend_axis_num=1, replica_id=rank)
            for layer in range(4)
        ],
        "i": ShardedTensor.from_rank_offsets("i", torch.zeros(7, dtype=torch.int64), replica_id=rank),
    }
    out = dist_checkpointing.load(sd, d)
    assert torch.equal(out["a"], a_full.chunk(world, 1)[rank])
    assert torch.equal(out["b"], b_full.chunk(world, 0)[rank])
    s, e = _chunk_offsets(10, world)[rank]
    assert torch.equal(out["u"], u_full[s:e])
    s, e = _chunk_offsets(5, world)[rank]
    assert out["e"].dtype == torch.bfloat16 and torch.equal(out["e"], e_full[s:e])
    assert isinstance(out["p"], list) and len(out["p"]) == 4
    for layer in range(4):
        assert torch.equal(out["p"][layer], p_full[layer]), layer
    assert torch.equal(out["i"], torch.arange(7, dtype=torch.int64) * 3)
    # in place: the returned tensors are the destinations
    assert out["a"].data_ptr() == sd["a"].data.data_ptr()


def test_save_4_load_2_and_1(tmp_path):
    run_distributed(_save_4, 4, tmp_path)
    run_distributed(_load_from_4, 2, tmp_path)
    run_distributed(_load_from_4, 1, tmp_path)


def _save_uneven_2_load_4(rank, world, tmp_path):
    # save on the first 2 ranks' sharding (ranks 2, 3 hold empty shards), load on 4 uneven along axis 1
    d = _ckpt_dir(tmp_path, "ck_un")
    full = _full("x", (3, 7))
    start, stop = [(0, 2), (2, 3), (3, 3), (3, 3)][rank]
    sd = {"x": ShardedTensor.from_global_offsets("x", full[start:stop].clone(), (3, 7), (start, 0))}
    dist_checkpointing.save(sd, d)
    s, e = _chunk_offsets(7, world)[rank]
    dst = torch.full((3, e - s), -1.0)
    out = dist_checkpointing.load({"x": ShardedTensor.from_global_offsets("x", dst, (3, 7), (0, s))}, d)
    assert torch.equal(out["x"], full[:, s:e])
    md = dist_checkpointing.load_tensors_metadata(d)
    assert md["x"].global_shape == (3, 7)


def test_uneven_empty_shards_4_ranks(tmp_path):
    run_distributed(_save_uneven_2_load_4, 4, tmp_path)


def _flat_save(rank, world, tmp_path, tp, dp, name):
    d = _ckpt_dir(tmp_path, name)
    sd = {
        "m": _flat("m", _full("m", (8, 6)), rank, world, 0, tp, dp),
        "v": _flat("v", _full("v", (6, 4), torch.bfloat16), rank, world, 1, tp, dp),
        # 1-D flattened: an ordinary 1-D shard on disk
        "o": ShardedTensor.from_rank_offsets_flat(
            "o", torch.arange(24.0)[rank * 24 // world : (rank + 1) * 24 // world].clone(), (24,),
            flattened_range=slice(rank * 24 // world, (rank + 1) * 24 // world),
        ),
    }
    dist_checkpointing.save(sd, d)


def _flat_load(rank, world, tmp_path, tp, dp, name):
    d = os.path.join(str(tmp_path), name)
    m_full, v_full = _full("m", (8, 6)), _full("v", (6, 4), torch.bfloat16)
    ref_m = _flat("m", m_full, rank, world, 0, tp, dp)
    ref_v = _flat("v", v_full, rank, world, 1, tp, dp)
    sd = {
        "m": _flat("m", torch.zeros(8, 6), rank, world, 0, tp, dp),
        "v": _flat("v", torch.zeros(6, 4, dtype=torch.bfloat16), rank, world, 1, tp, dp),
    }
    out = dist_checkpointing.load({"m": sd["m"], "v": sd["v"]}, d)
    assert torch.equal(out["m"], ref_m.data), (out["m"], ref_m.data)
    assert torch.equal(out["v"], ref_v.data)
    # the plain full tensor read back from the flattened checkpoint
    plain = dist_checkpointing.load(
        {"m": ShardedTensor.from_rank_offsets("m", torch.zeros(8, 6), replica_id=rank)}, d
    )
    assert torch.equal(plain["m"], m_full)
    o_full = dist_checkpointing.load(
        {"o": ShardedTensor.from_rank_offsets("o", torch.zeros(24), replica_id=rank)}, d
    )
    assert torch.equal(o_full["o"], torch.arange(24.0))
    md = dist_checkpointing.load_tensors_metadata(d)
    assert md["m"].global_shape == (8, 6) and md["v"].global_shape == (6, 4) and md["v"].dtype == torch.bfloat16


def _flat_save_2x2(rank, world, tmp_path):
    _flat_save(rank, world, tmp_path, 2, 2, "flat22")


def _flat_load_1x2(rank, world, tmp_path):
    _flat_load(rank, world, tmp_path, 1, 2, "flat22")


def _flat_load_4x1(rank, world, tmp_path):
    _flat_load(rank, world, tmp_path, 4 if world == 4 else 2, 1, "flat22")


def _flat_load_same(rank, world, tmp_path):
    _flat_load(rank, world, tmp_path, 2, 2, "flat22")


def _flat_load_2x1(rank, world, tmp_path):
    _flat_load(rank, world, tmp_path, 2, 1, "flat22")


def test_flattened_resharding(tmp_path):
    run_distributed(_flat_save_2x2, 4, tmp_path)
    run_distributed(_flat_load_same, 4, tmp_path)  # same grid, direct reads
    run_distributed(_flat_load_2x1, 2, tmp_path)  # same grid, other flat ranges (direct reads)
    run_distributed(_flat_load_1x2, 2, tmp_path)  # other grid and flattening, 2 ranks
    run_distributed(_flat_load_4x1, 4, tmp_path)  # finer grid along the TP axis


def _plain_save_flat_load(rank, world, tmp_path):
    d = _ckpt_dir(tmp_path, "plain")
    full = _full("m", (8, 6))
    dist_checkpointing.save({"m": ShardedTensor.from_rank_offsets("m", full.chunk(world, 0)[rank].clone(), (0, rank, world))}, d)
    # load as TP=2 on axis 0 x DP=world/2 flattened slices
    dst = _flat("m", torch.zeros(8, 6), rank, world, 0, 2, world // 2)
    ref = _flat("m", full, rank, world, 0, 2, world // 2)
    out = dist_checkpointing.load({"m": dst}, d)
    assert torch.equal(out["m"], ref.data)


def test_plain_checkpoint_into_flattened(tmp_path):
    run_distributed(_plain_save_flat_load, 4, tmp_path)


def _shape_mismatch_allowed(rank, world, tmp_path):
    d = _ckpt_dir(tmp_path, "mismatch")
    full = _full("emb", (4, 2))
    dist_checkpointing.save({"e": ShardedTensor.from_rank_offsets("e", full.clone(), replica_id=rank)}, d)
    # a padded (6, 2) destination: the checkpoint's 4 rows land, the padding is zero (as upstream's load)
    dst = torch.full((6, 2), -5.0)
    out = dist_checkpointing.load(
        {"e": ShardedTensor.from_rank_offsets("e", dst, replica_id=rank, allow_shape_mismatch=True)}, d
    )
    assert torch.equal(out["e"][:4], full) and torch.equal(out["e"][4:], torch.zeros(2, 2))


def test_allow_shape_mismatch(tmp_path):
    run_distributed(_shape_mismatch_allowed, 2, tmp_path)
