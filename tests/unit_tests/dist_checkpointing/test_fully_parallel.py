"""Fully-parallel save/load wrappers, for real on 2 and 4 gloo ranks.

Checked: the wrappers give bit-exactly the values of the plain torch_dist strategies (replicated, sharded, partly
replicated, 2-D sharded tensors; fp32/bf16/int64; sharded objects); each shard is read from disk exactly once across
the group (counted in DCP's FileSystemReader.read_data and in what the wrapped strategy is asked to load); the save
writes each replicated shard once with the bytes spread over the ranks; ``stream_ckpt_dequant`` reaches the planner.
"""
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import fully_parallel as fp
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_shards_to_ranks,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from tests.unit_tests.dist_utils import run_distributed

REPL_ROWS = 64  # rows of each replicated tensor


def _values(rank, world, seed):
    """Local tensors of this rank (deterministic); replicated ones are equal on all ranks."""
    g = torch.Generator().manual_seed(seed)
    full = {
        "sharded": torch.randn(8 * world, 16, generator=g),
        "sharded_bf16": torch.randn(4 * world, 8, generator=g).to(torch.bfloat16),
        "repl0": torch.randn(REPL_ROWS, 32, generator=g),
        "repl1": torch.randn(REPL_ROWS, 32, generator=g),
        "repl2": torch.randn(REPL_ROWS, 32, generator=g),
        "repl3": torch.randn(REPL_ROWS, 32, generator=g),
        "repl_int": torch.randint(0, 1000, (10,), generator=g),
        "half": torch.randn(6, 4, generator=g),
        "grid": torch.randn(4, 6, generator=g),
    }
    half_rank, half_n = (rank % 2, 2) if world >= 2 else (0, 1)
    local = {
        "sharded": full["sharded"].chunk(world)[rank].clone(),
        "sharded_bf16": full["sharded_bf16"].chunk(world)[rank].clone(),
        "half": full["half"].chunk(half_n)[half_rank].clone(),
    }
    for k in ("repl0", "repl1", "repl2", "repl3", "repl_int"):
        local[k] = full[k].clone()
    if world == 4:
        local["grid"] = full["grid"].chunk(2, 0)[rank // 2].chunk(2, 1)[rank % 2].clone()
    else:
        local["grid"] = full["grid"].chunk(world, 1)[rank].clone()
    return local


def _ssd(local, rank, world, obj=None):
    """Sharded state dict over ``local`` tensors (the tensors are the destinations/sources)."""
    half_rank, half_n = (rank % 2, 2)
    sd = {
        "sharded": ShardedTensor.from_rank_offsets("sharded", local["sharded"], (0, rank, world)),
        "nested": {
            "sharded_bf16": ShardedTensor.from_rank_offsets("sharded_bf16", local["sharded_bf16"], (0, rank, world)),
            "list": [
                ShardedTensor.from_rank_offsets(k, local[k], replica_id=rank)
                for k in ("repl0", "repl1", "repl2", "repl3")
            ],
        },
        "repl_int": ShardedTensor.from_rank_offsets("repl_int", local["repl_int"], replica_id=rank),
        "half": ShardedTensor.from_rank_offsets(
            "half", local["half"], (0, half_rank, half_n), replica_id=rank // half_n
        ),
    }
    if world == 4:
        sd["grid"] = ShardedTensor.from_rank_offsets("grid", local["grid"], (0, rank // 2, 2), (1, rank % 2, 2))
    else:
        sd["grid"] = ShardedTensor.from_rank_offsets("grid", local["grid"], (1, rank, world))
    if obj is not None:
        sd["obj"] = ShardedObject("obj", obj, (1,), (0,), replica_id=rank)
    return sd


def _zeros_like(local):
    return {k: torch.zeros_like(v) for k, v in local.items()}


def _assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k)
        assert torch.equal(a[k], b[k]), (what, k)


def _fp_save(group=None, cache=False):
    return FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1), group, cache)


def _fp_load(group=None, cache=False, base=None):
    return FullyParallelLoadStrategyWrapper(base or TorchDistLoadShardedStrategy(), group, cache)


def _shared_dir(tmp_path, name):
    d = os.path.join(str(tmp_path), name)
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    return d


def _rank_file_bytes(ckpt_dir):
    """Bytes of .distcp data files per writing rank (file names ``__<rank>_<i>.distcp``)."""
    per_rank = Counter()
    for f in os.listdir(ckpt_dir):
        if f.endswith(".distcp"):
            per_rank[int(f.split("_")[2])] += os.path.getsize(os.path.join(ckpt_dir, f))
    return per_rank


# ---- read counting -------------------------------------------------------------------------------------------
class _ReadCounter:
    """Patch the torch_dist reader's read_data in this process: records (fqn, offsets, lengths) of what it reads."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.filesystem import ChecksummedFileSystemReader as FileSystemReader

        self.cls = FileSystemReader
        self.orig = FileSystemReader.read_data
        self.items = []
        counter = self

        def read_data(reader, plan, planner):
            for it in plan.items:
                counter.items.append((it.storage_index.fqn, tuple(it.storage_offsets), tuple(it.lengths)))
            return counter.orig(reader, plan, planner)

        FileSystemReader.read_data = read_data

    def restore(self):
        self.cls.read_data = self.orig


def _all_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _CountingLoad(TorchDistLoadShardedStrategy):
    """Records the shard ids (and destination identities) the wrapped strategy is asked to load."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked = []

    def load(self, sharded_state_dict, checkpoint_dir):
        for v in nested_values(sharded_state_dict):
            if isinstance(v, ShardedTensor):
                self.asked.append((fp._shard_id(v), id(v.data)))
        return super().load(sharded_state_dict, checkpoint_dir)


def _elements(items):
    n = 0
    for _, _, lengths in items:
        k = 1
        for x in lengths:
            k *= x
        n += k
    return n


# ---- bodies ----------------------------------------------------------------------------------------------------
def _roundtrip_body(rank, world, tmp_path):
    src = _values(rank, world, seed=7)
    plain_dir = _shared_dir(tmp_path, "plain")
    fp_dir = _shared_dir(tmp_path, "fp")
    dist_checkpointing.save(_ssd(src, rank, world, obj={"step": 3}), plain_dir)
    dist_checkpointing.save(
        _ssd(src, rank, world, obj={"step": 3}), fp_dir, sharded_strategy=_fp_save()
    )

    # Save: each replicated shard written once, bytes spread over ranks (plain puts all replicas on rank 0).
    plain_bytes, fp_bytes = _rank_file_bytes(plain_dir), _rank_file_bytes(fp_dir)
    repl_bytes = 4 * REPL_ROWS * 32 * 4
    assert plain_bytes[0] - max(plain_bytes[r] for r in range(1, world)) >= repl_bytes * 0.9, plain_bytes
    assert max(fp_bytes.values()) - min(fp_bytes.values()) <= REPL_ROWS * 32 * 4, fp_bytes
    total_plain, total_fp = sum(plain_bytes.values()), sum(fp_bytes.values())
    assert abs(total_plain - total_fp) <= 4096 * world, (total_plain, total_fp)  # nothing saved twice
    md = TorchDistLoadShardedStrategy().load_tensors_metadata(fp_dir)
    assert tuple(md["repl0"].global_shape) == (REPL_ROWS, 32)

    results = {}
    for tag, d in (("plain_dir", plain_dir), ("fp_dir", fp_dir)):
        for how in ("plain", "fp"):
            dst = _zeros_like(src)
            counter = _ReadCounter()
            base = _CountingLoad()
            try:
                strategy = _fp_load(base=base) if how == "fp" else base
                loaded = dist_checkpointing.load(_ssd(dst, rank, world, obj={}), d, sharded_strategy=strategy)
            finally:
                counter.restore()
            # values land in the caller's destination tensors and equal the saved ones
            _assert_same(dst, src, (tag, how))
            assert loaded["obj"] == {"step": 3}
            assert torch.equal(loaded["sharded"], src["sharded"])
            assert torch.equal(loaded["nested"]["list"][2], src["repl2"])
            results[(tag, how)] = dst
            all_items = _all_gather(counter.items)
            all_asked = _all_gather(base.asked)
            read_elems = sum(_elements(i) for i in all_items)
            if how == "fp":
                # every distinct shard was handed to the wrapped strategy by exactly one rank ...
                asked = Counter(sid for per_rank in all_asked for sid, _ in per_rank)
                requested = {fp._shard_id(v) for v in nested_values(_ssd(src, rank, world))
                             if isinstance(v, ShardedTensor)}
                all_requested = set().union(*_all_gather(requested))
                assert set(asked) == all_requested and set(asked.values()) == {1}, asked
                # ... and every element of the checkpoint's tensors was read from disk once in total
                total_elems = sum(_numel_md(m) for m in md.values())
                assert read_elems == total_elems, (read_elems, total_elems)
                per_rank_read = [_elements(i) for i in all_items]
                assert min(per_rank_read) > 0, per_rank_read  # the reads are spread
            else:
                assert read_elems > sum(_numel_md(m) for m in md.values())  # plain: every rank reads replicas
    for k in results:
        _assert_same(results[k], results[("plain_dir", "plain")], k)


def _numel_md(m):
    n = 1
    for s in m.global_shape:
        n *= s
    return n


def _cache_and_errors_body(rank, world, tmp_path):
    src = _values(rank, world, seed=11)
    d = _shared_dir(tmp_path, "c1")
    save = _fp_save(cache=True)
    dist_checkpointing.save(_ssd(src, rank, world), d, sharded_strategy=save)
    first = save.cached_distribution
    assert first is not None and sum(save.last_saved_bytes_per_rank) > 0
    d2 = _shared_dir(tmp_path, "c2")
    src2 = {k: v + 1 if v.is_floating_point() else v + 1 for k, v in src.items()}
    dist_checkpointing.save(_ssd(src2, rank, world), d2, sharded_strategy=save)
    assert save.cached_distribution is first  # same structure: reused

    load = _fp_load(cache=True)
    for directory, expected in ((d, src), (d2, src2), (d, src)):
        dst = _zeros_like(src)
        dist_checkpointing.load(_ssd(dst, rank, world), directory, sharded_strategy=load)
        _assert_same(dst, expected, directory)
    cached = load.cached_distribution
    # A changed structure on one rank only is detected on all ranks (no hang) and recomputed.
    dst = _zeros_like(src)
    sd = _ssd(dst, rank, world)
    if rank == 1:
        del sd["repl_int"]
    dist_checkpointing.load(sd, d, sharded_strategy=load)
    assert load.cached_distribution is not cached
    assert torch.equal(dst["repl0"], src["repl0"])
    if rank == 1:
        assert torch.equal(dst["repl_int"], torch.zeros_like(src["repl_int"]))
    else:
        assert torch.equal(dst["repl_int"], src["repl_int"])

    # A key missing from the checkpoint, requested by one rank only: every rank raises, naming the key.
    dst = _zeros_like(src)
    sd = _ssd(dst, rank, world)
    if rank == world - 1:
        sd["missing"] = ShardedTensor.from_rank_offsets("no_such_key", torch.zeros(3))
    with pytest.raises(CheckpointingException, match="no_such_key"):
        dist_checkpointing.load(sd, d, sharded_strategy=_fp_load())


def _stream_flag_body(rank, world, tmp_path):
    src = _values(rank, world, seed=5)
    d = _shared_dir(tmp_path, "s")
    dist_checkpointing.save(_ssd(src, rank, world), d, sharded_strategy=_fp_save())
    for flag in (True, False):
        wrapper = _fp_load(base=TorchDistLoadShardedStrategy(stream_ckpt_dequant=flag))
        assert wrapper.stream_ckpt_dequant is flag
        dst = _zeros_like(src)
        dist_checkpointing.load(_ssd(dst, rank, world), d, sharded_strategy=wrapper)
        _assert_same(dst, src, flag)
        stats = wrapper.last_load_stats
        assert stats.seconds > 0 and stats.streamed is flag, (flag, stats)  # the planner the flag chose was used


def _quantized_body(rank, world, tmp_path):
    """Quantized destinations (the tests' FakeQuantizedTensor, current/tensorwise scaling): the reader of a shard
    that other ranks need too reads it into a high-precision buffer (not its destination) and every rank quantizes
    the same values with dest.copy_(buf); unshared shards go through the wrapped strategy into the destination.
    Result: bit-identical to the plain strategy's load, for stream_ckpt_dequant on and off."""
    from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor, quantized_like

    g = torch.Generator().manual_seed(17)
    full_w = (torch.randn(4 * world, 8, generator=g) * torch.arange(1, 4 * world + 1).unsqueeze(1)).bfloat16()
    repl = [(torch.randn(16, 8, generator=g) * (i + 1)).bfloat16() for i in range(3)]
    d = _shared_dir(tmp_path, "q")

    def ssd(w, rs):
        sd = {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world))}
        for i, r in enumerate(rs):
            sd[f"r{i}"] = ShardedTensor.from_rank_offsets(f"r{i}", r, replica_id=rank)
        return sd

    dist_checkpointing.save(ssd(full_w.chunk(world)[rank].clone(), [r.clone() for r in repl]), d)
    results = {}
    for stream in (True, False):
        for how in ("plain", "fp"):
            w = quantized_like(torch.zeros(4, 8, dtype=torch.bfloat16), "tensorwise")
            rs = [quantized_like(torch.zeros(16, 8, dtype=torch.bfloat16), "tensorwise") for _ in repl]
            base = _CountingLoad(stream_ckpt_dequant=stream)
            strategy = _fp_load(base=base) if how == "fp" else base
            dist_checkpointing.load(ssd(w, rs), d, sharded_strategy=strategy)
            refs = [FakeQuantizedTensor.quantize(full_w.chunk(world)[rank], "tensorwise")]
            refs += [FakeQuantizedTensor.quantize(r, "tensorwise") for r in repl]
            for name, got, ref in zip(["w", "r0", "r1", "r2"], [w] + rs, refs):
                assert got.scale_inv == ref.scale_inv, (stream, how, name)
                assert torch.equal(got._data.float(), ref._data.float()), (stream, how, name)
            results[(stream, how)] = [t._data.clone() for t in [w] + rs]
            if how == "fp":
                dest_ids = {id(t) for t in [w] + rs}
                for sid, data_id in base.asked:
                    shared = sid[0] != "w"
                    assert (data_id in dest_ids) != shared, (sid, shared)
                assert len(base.asked) >= 1  # the sharded w is read by its own rank
    for k, v in results.items():
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(v, results[(False, "plain")])), k


def _subgroup_body(rank, world, tmp_path):
    """4 ranks as tp=2 x dp=2; the wrappers parallelize over the dp group only (tp-sharded, dp-replicated
    tensors, and a tensor replicated everywhere with a tuple replica_id (tp, dp))."""
    tp, dp = rank % 2, rank // 2
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_group = groups[tp]
    g = torch.Generator().manual_seed(21)
    full = torch.randn(8, 12, generator=g)
    norm = torch.randn(40, generator=g)
    emb = torch.randn(16, 4, generator=g)

    def ssd(t):
        return {
            "w": ShardedTensor.from_rank_offsets("w", t["w"], (0, tp, 2), replica_id=dp),
            "norm": ShardedTensor.from_rank_offsets("norm", t["norm"], replica_id=(tp, dp)),
            "emb": ShardedTensor.from_rank_offsets("emb", t["emb"], (0, tp, 2), replica_id=dp),
        }

    src = {"w": full.chunk(2)[tp].clone(), "norm": norm.clone(), "emb": emb.chunk(2)[tp].clone()}
    d = _shared_dir(tmp_path, "sub")
    save = _fp_save(group=dp_group)
    dist_checkpointing.save(ssd(src), d, sharded_strategy=save)
    # tp=0 group saves its w/emb shards and norm; tp=1 group its w/emb shards only
    assert sum(save.last_saved_bytes_per_rank) == (48 + 32) * 4 + (40 * 4 if tp == 0 else 0)
    assert min(save.last_saved_bytes_per_rank) > 0
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    counter = _ReadCounter()
    try:
        dist_checkpointing.load(ssd(dst), d, sharded_strategy=_fp_load(group=dp_group))
    finally:
        counter.restore()
    _assert_same(dst, src, "subgroup")
    per_rank = _all_gather(_elements(counter.items))
    assert sum(per_rank) == 2 * (40 + 48 + 32), per_rank  # each dp group reads its shards and norm once
    plain = {k: torch.zeros_like(v) for k, v in src.items()}
    dist_checkpointing.load(ssd(plain), d)
    _assert_same(plain, src, "subgroup plain")


def _flattened_body(rank, world, tmp_path):
    """Flattened-range shards (distributed-optimizer style): replicated flat slices and per-rank flat slices."""
    g = torch.Generator().manual_seed(4)
    full_r = torch.randn(4, 6, generator=g)
    full_s = torch.randn(2 * world, 5, generator=g)

    def ssd(r_parts, s_part):
        sd = {
            f"r{i}": ShardedTensor.from_rank_offsets_flat(
                "flat_r", r_parts[i], (4, 6), flattened_range=slice(12 * i, 12 * i + 12), replica_id=rank
            )
            for i in range(2)
        }
        for i, (a, b) in enumerate(((0, 4), (4, 10))):
            sd[f"s{i}"] = ShardedTensor.from_rank_offsets_flat(
                "flat_s", s_part[i], (2, 5), (0, rank, world), flattened_range=slice(a, b)
            )
        return sd

    r_parts = [full_r.flatten()[:12].clone(), full_r.flatten()[12:].clone()]
    local_s = full_s.chunk(world)[rank].flatten()
    s_part = [local_s[:4].clone(), local_s[4:].clone()]
    d = _shared_dir(tmp_path, "flat")
    dist_checkpointing.save(ssd(r_parts, s_part), d, sharded_strategy=_fp_save())
    dst_r, dst_s = [torch.zeros(12), torch.zeros(12)], [torch.zeros(4), torch.zeros(6)]
    counter = _ReadCounter()
    try:
        dist_checkpointing.load(ssd(dst_r, dst_s), d, sharded_strategy=_fp_load())
    finally:
        counter.restore()
    assert torch.equal(dst_r[0], r_parts[0]) and torch.equal(dst_r[1], r_parts[1])
    assert torch.equal(dst_s[0], s_part[0]) and torch.equal(dst_s[1], s_part[1])
    assert sum(_all_gather(_elements(counter.items))) == 24 + 10 * world  # replicated slices read once

    # One replicated tensor only: one rank reads nothing (its wrapped load still runs, with an empty request).
    d2 = _shared_dir(tmp_path, "one")
    one = torch.arange(16.0)
    dist_checkpointing.save({"o": ShardedTensor.from_rank_offsets("o", one, replica_id=rank)}, d2,
                            sharded_strategy=_fp_save())
    written = _rank_file_bytes(d2)
    per_rank = [written.get(r, 0) for r in range(world)]
    assert min(per_rank) < 16 * 4 <= max(per_rank), per_rank  # written by one rank only
    base = _CountingLoad()
    got = torch.zeros(16)
    dist_checkpointing.load({"o": ShardedTensor.from_rank_offsets("o", got, replica_id=rank)}, d2,
                            sharded_strategy=_fp_load(base=base))
    assert torch.equal(got, one)
    assert sorted(len(a) for a in _all_gather(base.asked)) == [0] * (world - 1) + [1]


def test_fully_parallel_flattened_ranges(tmp_path):
    run_distributed(_flattened_body, 2, tmp_path)


def test_fully_parallel_dp_subgroup(tmp_path):
    run_distributed(_subgroup_body, 4, tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_fully_parallel_roundtrip_matches_plain(tmp_path, world):
    run_distributed(_roundtrip_body, world, tmp_path)


def test_fully_parallel_cache_and_error_sync(tmp_path):
    run_distributed(_cache_and_errors_body, 2, tmp_path)


def test_stream_ckpt_dequant_forwarded(tmp_path):
    assert FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(stream_ckpt_dequant=True)).stream_ckpt_dequant
    assert not FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()).stream_ckpt_dequant
    run_distributed(_stream_flag_body, 2, tmp_path)


def test_quantized_destinations_get_high_precision_buffers(tmp_path):
    run_distributed(_quantized_body, 2, tmp_path)


def test_distribute_shards_balances_deterministically():
    shards = {("a", (0,), (4,), ()): [0, 1], ("b", (0,), (4,), ()): [0, 1], ("c", (0,), (2,), ()): [0, 1],
              ("d", (0,), (2,), ()): [0, 1], ("e", (0,), (1,), ()): [1]}
    sizes = {"a": 40, "b": 40, "c": 20, "d": 20, "e": 10}
    sizes = {s: sizes[s[0]] for s in shards}
    out = distribute_shards_to_ranks(shards, sizes, 2, set())
    assert out == distribute_shards_to_ranks(dict(reversed(list(shards.items()))), sizes, 2, set())
    per_rank = Counter()
    for s, r in out.items():
        assert r in shards[s]
        per_rank[r] += sizes[s]
    assert per_rank == {0: 60, 1: 70}
    assert out[("e", (0,), (1,), ())] == 1


def test_unknown_exchange_algo():
    with pytest.raises(CheckpointingException, match="exchange_algo"):
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo="carrier_pigeon")


def _parameter_destinations_body(rank, world, ckpt):
    """Replicated parameters (leaves that require grad) as destinations, loaded outside torch.no_grad: the exchange
    writes into them without autograd complaining, and every rank ends with the saved values."""
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(REPL_ROWS, 8, generator=g) for _ in range(4)]

    def sd(tensors):
        return {f"p{i}": ShardedTensor.from_rank_offsets(f"p{i}", t, replica_id=rank) for i, t in enumerate(tensors)}

    dist_checkpointing.save(sd([t.clone() for t in full]), ckpt)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in full]
    strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    dist_checkpointing.load(sd(params), ckpt, sharded_strategy=strategy)
    for p, t in zip(params, full):
        assert torch.equal(p.detach(), t)
    assert all(p.requires_grad for p in params)


def test_fully_parallel_load_into_parameters(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_parameter_destinations_body, 2, ckpt)
