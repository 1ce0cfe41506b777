"""Bad input to dist_checkpointing save/load, on 2 gloo ranks.

Each case must raise a CheckpointingException (on every rank, no hang) whose message names the key or the file,
and must not change any file of the existing checkpoint (every file is hashed before and after). Loads are tried
with the plain torch_dist strategy and through FullyParallelLoadStrategyWrapper.
"""
import hashlib
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from tests.unit_tests.dist_utils import run_distributed

WORLD = 2


def _tensors(rank, world):
    g = torch.Generator().manual_seed(0)
    full_w = torch.randn(4 * world, 6, generator=g)
    return {
        "w": full_w.chunk(world)[rank].clone(),
        "b": torch.randn(5, generator=g),
        "h": torch.randn(3, 2, generator=g).to(torch.bfloat16),
    }


def _ssd(t, rank, world):
    return {
        "w": ShardedTensor.from_rank_offsets("decoder.w", t["w"], (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("decoder.b", t["b"], replica_id=rank),
        "h": ShardedTensor.from_rank_offsets("decoder.h", t["h"], replica_id=rank),
    }


def _hashes(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _fresh_ckpt(tmp_path, name, rank, world):
    d = os.path.join(str(tmp_path), name)
    if rank == 0:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    dist.barrier()
    dist_checkpointing.save(_ssd(_tensors(rank, world), rank, world), d)
    dist.barrier()
    return d


def _strategies():
    return [
        ("plain", lambda: TorchDistLoadShardedStrategy()),
        ("fully_parallel", lambda: FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())),
    ]


def _expect_load_error(ckpt_dir, sharded_state_dict_fn, match, tree=None):
    """Every rank must raise CheckpointingException matching ``match``; files under ``tree`` must not change."""
    tree = tree or ckpt_dir
    for name, make in _strategies():
        dist.barrier()
        before = _hashes(tree)
        with pytest.raises(CheckpointingException, match=match):
            dist_checkpointing.load(sharded_state_dict_fn(), ckpt_dir, sharded_strategy=make())
        dist.barrier()
        assert _hashes(tree) == before, name


def _zeros_ssd(rank, world):
    return _ssd({k: torch.zeros_like(v) for k, v in _tensors(rank, world).items()}, rank, world)


def _data_files(d):
    """.distcp files that hold data, largest first (a writer thread with nothing to write leaves an empty file)."""
    files = [f for f in os.listdir(d) if f.endswith(".distcp") and os.path.getsize(os.path.join(d, f)) > 0]
    return sorted(files, key=lambda f: (-os.path.getsize(os.path.join(d, f)), f))


# ---- load cases --------------------------------------------------------------------------------------------------
def _not_a_checkpoint_body(rank, world, tmp_path):
    d = os.path.join(str(tmp_path), "not_ckpt")
    if rank == 0:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "notes.txt"), "w") as f:
            f.write("hello")
    dist.barrier()
    _expect_load_error(d, lambda: _zeros_ssd(rank, world), "not_ckpt")


def _missing_metadata_json_body(rank, world, tmp_path):
    d = _fresh_ckpt(tmp_path, "no_md", rank, world)
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(d, "metadata.json"))
    dist.barrier()
    _expect_load_error(d, lambda: _zeros_ssd(rank, world), "metadata.json")


def _missing_distcp_body(rank, world, tmp_path):
    d = _fresh_ckpt(tmp_path, "no_distcp", rank, world)
    victim = _data_files(d)[0]
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(d, victim))
    dist.barrier()
    _expect_load_error(d, lambda: _zeros_ssd(rank, world), victim.replace(".", r"\."))


def _truncated_distcp_body(rank, world, tmp_path):
    d = _fresh_ckpt(tmp_path, "trunc", rank, world)
    victim = _data_files(d)[0]
    dist.barrier()
    if rank == 0:
        p = os.path.join(d, victim)
        size = os.path.getsize(p)
        with open(p, "r+b") as f:
            f.truncate(size // 2)
    dist.barrier()
    _expect_load_error(d, lambda: _zeros_ssd(rank, world), victim.replace(".", r"\."))


def _absent_key_body(rank, world, tmp_path):
    d = _fresh_ckpt(tmp_path, "absent", rank, world)

    def ssd():
        sd = _zeros_ssd(rank, world)
        sd["extra"] = ShardedTensor.from_rank_offsets("decoder.not_there", torch.zeros(4), replica_id=rank)
        return sd

    _expect_load_error(d, ssd, "decoder.not_there")


def _shape_mismatch_body(rank, world, tmp_path):
    d = _fresh_ckpt(tmp_path, "shape", rank, world)

    def ssd():
        sd = _zeros_ssd(rank, world)
        sd["b"] = ShardedTensor.from_rank_offsets("decoder.b", torch.zeros(7), replica_id=rank)
        return sd

    _expect_load_error(d, ssd, "decoder.b")


def _dtype_mismatch_body(rank, world, tmp_path):
    d = _fresh_ckpt(tmp_path, "dtype", rank, world)

    def ssd():
        sd = _zeros_ssd(rank, world)
        sd["h"] = ShardedTensor.from_rank_offsets("decoder.h", torch.zeros(3, 2, dtype=torch.int32), replica_id=rank)
        return sd

    _expect_load_error(d, ssd, "decoder.h")


# ---- save cases --------------------------------------------------------------------------------------------------
def _expect_save_error(target, ssd, match, tree):
    for name, make in (
        ("plain", lambda: TorchDistSaveShardedStrategy("torch_dist", 1)),
        ("fully_parallel", lambda: FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1))),
    ):
        dist.barrier()
        before = _hashes(tree)
        with pytest.raises(CheckpointingException, match=match):
            dist_checkpointing.save(ssd(), target, sharded_strategy=make())
        dist.barrier()
        assert _hashes(tree) == before, name


def _empty_target(tmp_path, name, rank):
    d = os.path.join(str(tmp_path), name)
    if rank == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    return d


def _overlap_body(rank, world, tmp_path):
    d = _empty_target(tmp_path, "overlap", rank)

    def ssd():
        # both ranks claim rows 0..3 of a 8-row tensor as their main replica
        t = torch.ones(4, 6)
        return {"w": ShardedTensor("decoder.overlap", t, t.dtype, (4, 6), (8, 6), (0, 0), (2, 1), replica_id=0)}

    _expect_save_error(d, ssd, "decoder.overlap", tmp_path)
    assert os.listdir(d) == []


def _incomplete_body(rank, world, tmp_path):
    d = _empty_target(tmp_path, "incomplete", rank)

    def ssd():
        # a 3-row global tensor of which only rows 0..1 are saved (rank 0 row 0, rank 1 row 1)
        t = torch.ones(1, 6)
        return {"w": ShardedTensor("decoder.hole", t, t.dtype, (1, 6), (3, 6), (rank, 0), (3, 1), replica_id=0)}

    _expect_save_error(d, ssd, "decoder.hole", tmp_path)
    assert os.listdir(d) == []


def _existing_ckpt_body(rank, world, tmp_path):
    d = _fresh_ckpt(tmp_path, "existing", rank, world)
    other = {k: v + 1 for k, v in _tensors(rank, world).items()}
    _expect_save_error(d, lambda: _ssd(other, rank, world), "existing", d)
    # the original values are still there
    dst = {k: torch.zeros_like(v) for k, v in _tensors(rank, world).items()}
    dist_checkpointing.load(_ssd(dst, rank, world), d)
    for k, v in _tensors(rank, world).items():
        assert torch.equal(dst[k], v), k


CASES = {
    "not_a_checkpoint": _not_a_checkpoint_body,
    "missing_metadata_json": _missing_metadata_json_body,
    "missing_distcp": _missing_distcp_body,
    "truncated_distcp": _truncated_distcp_body,
    "absent_key": _absent_key_body,
    "global_shape_mismatch": _shape_mismatch_body,
    "dtype_mismatch": _dtype_mismatch_body,
    "overlapping_sharding_at_save": _overlap_body,
    "incomplete_sharding_at_save": _incomplete_body,
    "save_into_existing_checkpoint": _existing_ckpt_body,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(tmp_path, case):
    run_distributed(CASES[case], WORLD, tmp_path, timeout=90)
