"""Which rank saves / reads each shard under the fully-parallel wrappers: upstream 0.19's order (cross-group loads
last, then fewer holders, then larger, then shard id), checked against hand-computed assignments, against the real
upstream function (subprocess with upstream first on PYTHONPATH), and the save wrapper's in-place replica_id rewrite
on 2 gloo ranks."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.exchange_utils import (
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
)
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.interop.upstream_env import EAGER_COMPILE

REPO = Path(__file__).resolve().parents[3]


def test_order_cross_group_then_coverage_then_size_then_id():
    # C: one holder -> first, to rank 1. A, B (equal size, two holders): A (lower id) to the least loaded rank 0,
    # then B to rank 1. X is the largest but loaded for another group: last, to the least loaded rank 0.
    shards = {"A": [0, 1], "B": [0, 1], "C": [1], "X": [0, 1]}
    sizes = {"A": 100, "B": 100, "C": 10, "X": 500}
    assert distribute_shards_to_ranks(shards, sizes, 2, {"X"}) == {"C": 1, "A": 0, "B": 1, "X": 0}
    # without the cross-group mark X is placed before A and B (largest among two-holder shards)
    assert distribute_shards_to_ranks(shards, sizes, 2, set()) == {"C": 1, "X": 0, "A": 1, "B": 1}
    # ties of load go to the lowest rank among the holders, whatever their listed order
    assert distribute_shards_to_ranks({"A": [2, 1]}, {"A": 1}, 3, set()) == {"A": 1}


def _cases(world: int, seed: int):
    """Per rank, a list of (key, rows, cols, dtype, rank_offsets, replica_id) describing one rank's shards."""
    rnd = random.Random(seed)
    per_rank = [[] for _ in range(world)]
    for i in range(10):
        rows = rnd.choice([4, 8, 8, 16])  # repeated sizes exercise the tie-break by shard id
        dtype = rnd.choice(["float32", "bfloat16"])
        kind = rnd.choice(["repl", "tp", "ext", "one", "part"])
        for r in range(world):
            key = f"{kind}{i}"
            if kind == "repl":
                per_rank[r].append((key, rows, 4, dtype, [], r))
            elif kind == "tp":  # sharded over 2, replicated over world / 2
                per_rank[r].append((key, rows, 4, dtype, [[0, r % 2, 2]], r // 2))
            elif kind == "ext":  # main replica in another group
                per_rank[r].append((key, rows, 4, dtype, [], r + 1))
            elif kind == "one" and r == i % world:
                per_rank[r].append((key, rows, 4, dtype, [], 0))
            elif kind == "part" and r < 2:
                per_rank[r].append((key, rows, 4, dtype, [], r))
    return per_rank


def _build(spec):
    return [
        ShardedTensor.from_rank_offsets(key, torch.empty(rows, cols, dtype=getattr(torch, dt)),
                                        *[tuple(o) for o in offs], replica_id=rid)
        for key, rows, cols, dt, offs, rid in spec
    ]


def _ours(per_rank, ignore_groups, monkeypatch):
    built = [[t.without_data() for t in _build(spec)] for spec in per_rank]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(per_rank))

    def gather(out, obj, group=None):
        out[:] = built

    monkeypatch.setattr(dist, "all_gather_object", gather)
    d = determine_main_replica_uniform_distribution(built[0], object(), ignore_groups=ignore_groups)
    return {f"{sid[0]}@{list(sid[1])}": rank for sid, rank in d.main_rank_for_shard.items()}


_UPSTREAM_SCRIPT = r"""
import json, sys, torch
import megatron.core.utils as mu
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing import exchange_utils as eu
out = []
for per_rank, ignore_groups in json.loads(sys.stdin.read()):
    built = [[ShardedTensor.from_rank_offsets(k, torch.empty(r, c, dtype=getattr(torch, dt)),
                                              *[tuple(o) for o in offs], replica_id=rid).without_data()
              for k, r, c, dt, offs, rid in spec] for spec in per_rank]
    mu.get_pg_size = lambda group=None, n=len(per_rank): n
    def gather(out, obj, group=None, built=built):
        out[:] = built
    torch.distributed.all_gather_object = gather
    d = eu.determine_main_replica_uniform_distribution(built[0], object(), ignore_groups=ignore_groups)
    out.append({f"{sid[0]}@{list(sid[1])}": rank for sid, rank in d.main_rank_for_shard.items()})
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def upstream_site():
    from tests.unit_tests.interop.upstream_env import upstream_site_or_skip

    return upstream_site_or_skip()


def test_same_assignment_as_real_upstream(upstream_site, monkeypatch, tmp_path):
    """Save and load distributions of mixed state dicts (replicated, TP x DP, main replica elsewhere, held by one
    or two ranks; fp32/bf16; equal sizes) on 4 ranks equal the real upstream function's, key by key."""
    cases = [(_cases(4, seed), ignore) for seed in (0, 1, 2) for ignore in (False, True)]
    env = dict(os.environ, PYTHONPATH=str(upstream_site), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    script = tmp_path / "upstream_distribution.py"
    script.write_text(EAGER_COMPILE + _UPSTREAM_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], input=json.dumps(cases), env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.split("RESULT", 1)[1])
    for (per_rank, ignore), upstream in zip(cases, theirs):
        ours = _ours(per_rank, ignore, monkeypatch)
        assert ours == upstream, (ignore, ours, upstream)
    assert any("ext" in k for _, up in zip(cases, theirs) for k in up)  # cross-group loads were compared


def _save_rewrite_body(rank, world, tmp_path):
    sd = {
        "big": ShardedTensor.from_rank_offsets("big", torch.zeros(16, 4), replica_id=rank),
        "small": ShardedTensor.from_rank_offsets("small", torch.zeros(2, 4), replica_id=rank),
        "mine": ShardedTensor.from_rank_offsets("mine", torch.zeros(4, 4), (0, rank, world)),
        "ext": ShardedTensor.from_rank_offsets("ext", torch.zeros(64, 4), replica_id=(0, rank + 1)),
    }
    before = dict(sd)
    wrapper = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    assert wrapper.apply_saving_parallelization(sd) is None
    assert all(sd[k] is before[k] for k in sd)  # rewritten in place, as upstream
    # hand-computed: "mine" (one holder each) first; then two holders, larger first: big -> rank 0 (tie of load
    # 64/64, lowest rank), small -> rank 1; "ext" has its main replica in another group: 1 on both ranks.
    expected = {"big": 0 if rank == 0 else 1, "small": 0 if rank == 1 else 1, "mine": 0, "ext": 1}
    assert {k: v.replica_id for k, v in sd.items()} == expected


def test_save_wrapper_rewrites_replica_ids_in_place(tmp_path):
    run_distributed(_save_rewrite_body, 2, tmp_path)
