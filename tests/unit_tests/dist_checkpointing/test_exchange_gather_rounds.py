"""exchange_algo='gather_rounds' (upstream's exchange_loaded_tensors_gather_rounds): per dtype, round k exchanges
every rank's k-th shard needed elsewhere; same result as the broadcast exchange (3 gloo ranks, shards of several
shapes and dtypes, rounds with and without a common shape, a shard only its loader needs)."""
import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor
from megatron.core.dist_checkpointing import exchange_utils
from tests.unit_tests.dist_utils import run_distributed


def _value(key, shape, dtype):
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=g).to(dtype)


SPECS = {  # replicated on every rank: each is loaded by one rank and needed by all
    "a": ((2, 3), torch.float32), "b": ((4,), torch.float32), "c": ((2, 3), torch.float32),
    "d": ((3,), torch.bfloat16), "e": ((5, 2), torch.float32), "f": ((2, 3), torch.float32),
    "g": ((0,), torch.float32), "h": ((2, 3), torch.float32), "i": ((2, 3), torch.float32),
    "j": ((2, 3), torch.float32), "k": ((2, 3), torch.float32), "l": ((2, 3), torch.float32),
}


def _body(rank, world):
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(shape, dtype=dtype), replica_id=rank)
          for k, (shape, dtype) in SPECS.items()}
    # sharded, not replicated: each rank needs only its own shard (no exchange)
    sd["own"] = ShardedTensor.from_rank_offsets("own", torch.zeros(2), (0, rank, world))
    dist_ = exchange_utils.determine_main_replica_uniform_distribution(sd, None, True)
    main = dist_.main_rank_for_shard
    assert sorted({main[sid] for sid in main if sid[0] in SPECS}) == list(range(world))  # spread over ranks
    results = {}
    for algo in ("broadcast", "gather_rounds"):
        loaded, unloaded = {}, {}
        for sh in sd.values():
            sid = (sh.key, tuple(sh.global_offset), tuple(sh.local_shape), ())
            sid = next(s for s in main if s[:2] == sid[:2])
            if main[sid] == rank:
                loaded[sid] = _value(sh.key, *SPECS[sh.key]) if sh.key in SPECS else torch.full((2,), 1.0 + rank)
            else:
                unloaded[sid] = ShardedTensor.from_rank_offsets(sh.key, torch.zeros_like(sh.data),
                                                                replica_id=sh.replica_id)
        got = exchange_utils.exchange_by_distribution(loaded, unloaded, dist_, None, algo)
        for key, (shape, dtype) in SPECS.items():
            sid = next(s for s in got if s[0] == key)
            assert got[sid].dtype == dtype and tuple(got[sid].shape) == shape, (algo, key, got[sid])
            assert torch.equal(got[sid], _value(key, shape, dtype)), (algo, key)
        own = next(s for s in got if s[0] == "own")
        assert torch.equal(got[own], torch.full((2,), 1.0 + rank))
        results[algo] = got
    assert results["broadcast"].keys() == results["gather_rounds"].keys()
    # on_received: each received shard handed over, none kept
    seen = {}
    loaded = {sid: _value(sid[0], *SPECS[sid[0]]) for sid in main if sid[0] in SPECS and main[sid] == rank}
    unloaded = {sid: None for sid in main if sid[0] in SPECS and main[sid] != rank}
    unloaded = {sid: ShardedTensor.from_rank_offsets(sid[0], torch.zeros(SPECS[sid[0]][0], dtype=SPECS[sid[0]][1]),
                                                     replica_id=rank) for sid in unloaded}
    kept = exchange_utils.exchange_loaded_tensors_gather_rounds(loaded, unloaded, dist_, None,
                                                                on_received=lambda s, t: seen.update({s: t.clone()}))
    assert set(kept) == set(loaded) and set(seen) == set(unloaded)
    for sid, t in seen.items():
        assert torch.equal(t, _value(sid[0], *SPECS[sid[0]]))
    with pytest.raises(CheckpointingException, match="'all_to_all' is not supported"):
        exchange_utils.exchange_by_distribution(loaded, {}, dist_, None, "all_to_all")


def test_gather_rounds_equals_broadcast():
    run_distributed(_body, 3)
