"""Format parity with upstream megatron-core 0.19.2, against checkpoints upstream really wrote
(``shared/fixtures/upstream-mcore-0.19.2``): common state inside DCP, objects as ``torch.save([obj])``, the metadata
calls, upstream's ``integrity.json`` manifest; plus the legacy ``common.pt`` layout."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.integrity import INTEGRITY_FNAME
from tests.unit_tests.dist_utils import run_distributed

from tests.unit_tests.fixtures import UPSTREAM_FIXTURES as FIXTURES

FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.linear_fc2.weight"


def _copy(name, tmp_path) -> str:
    dst = os.path.join(str(tmp_path), name)
    shutil.copytree(FIXTURES / name / "ckpt", dst)
    return dst


def _stacked_request(rank, world, fc1, fc2):
    """Upstream's own request pattern for api_stacked: fc1 layers over a prepended axis, fc2 (layer, expert) over
    two; this rank takes every world-th piece (so 1, 2 and 4 ranks read different subsets)."""
    sd = {}
    for i in range(3):
        if i % world == rank:
            sd[f"fc1.{i}"] = ShardedTensor.from_rank_offsets(FC1, fc1[i], (0, i, 3), prepend_axis_num=1)
    for l in range(2):
        for e in range(4):
            if (l * 4 + e) % world == rank:
                sd[f"fc2.{l}.{e}"] = ShardedTensor.from_rank_offsets(
                    FC2, fc2[l][e], (0, l, 2), (1, e, 4), prepend_axis_num=2
                )
    sd["obj"] = ShardedObject("misc.obj", None, (1,), (0,))
    return sd


def _load_api_stacked(rank, world, ckpt):
    expected = torch.load(FIXTURES / "api_stacked" / "expected.pt", weights_only=True)
    fc1 = [torch.zeros(64, 64, dtype=torch.bfloat16) for _ in range(3)]
    fc2 = [[torch.zeros(16, 16) for _ in range(4)] for _ in range(2)]
    out = dist_checkpointing.load(_stacked_request(rank, world, fc1, fc2), ckpt, validate_access_integrity=False)
    n = 0
    for i in range(3):
        if f"fc1.{i}" in out:
            assert torch.equal(out[f"fc1.{i}"], expected[FC1][i]), i
            n += 1
    for l in range(2):
        for e in range(4):
            if f"fc2.{l}.{e}" in out:
                assert torch.equal(out[f"fc2.{l}.{e}"], expected[FC2][l, e]), (l, e)
                n += 1
    assert n == sum(1 for k in out if k.startswith("fc"))
    assert out["obj"] == expected["misc.obj/shard_0_1"][0] == {"iteration": 7}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_upstream_api_stacked_loads(tmp_path, world):
    run_distributed(_load_api_stacked, world, _copy("api_stacked", tmp_path))


def test_upstream_metadata_calls(tmp_path):
    ckpt = _copy("api_stacked", tmp_path)
    expected = torch.load(FIXTURES / "api_stacked" / "expected.pt", weights_only=True)
    assert dist_checkpointing.load_common_state_dict(ckpt) == expected["common_state/shard_0_1"][0] == {}
    assert dist_checkpointing.load_content_metadata(ckpt) is None
    md = dist_checkpointing.load_tensors_metadata(ckpt)
    assert {k: (v.global_shape, v.dtype) for k, v in md.items()} == {
        FC1: ((3, 64, 64), torch.bfloat16),
        FC2: ((2, 4, 16, 16), torch.float32),
    }
    smd = dist_checkpointing.load_sharded_metadata(ckpt)
    # as upstream's: every object of the checkpoint, the common state's included
    assert set(smd) == {FC1, FC2, "misc.obj/shard_0_1", "common_state/shard_0_1"}
    assert smd["common_state/shard_0_1"].key == "common_state" and smd["common_state/shard_0_1"].data is None
    assert isinstance(smd["misc.obj/shard_0_1"], ShardedObject) and smd["misc.obj/shard_0_1"].global_shape == (1,)
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    assert set(plain) == {FC1, FC2}
    assert torch.equal(plain[FC1], expected[FC1]) and torch.equal(plain[FC2], expected[FC2])
    for name in ("gpt_dense", "gpt_moe"):
        assert dist_checkpointing.load_common_state_dict(_copy(name, tmp_path)) == {}


def _save_like_upstream(rank, world, d, expected):
    """Our save of api_stacked's content, from ``world`` ranks."""
    fc1 = [expected[FC1][i].clone() for i in range(3)]
    fc2 = [[expected[FC2][l, e].clone() for e in range(4)] for l in range(2)]
    sd = _stacked_request(rank, world, fc1, fc2)
    sd["obj"] = ShardedObject("misc.obj", {"iteration": 7}, (1,), (0,), replica_id=rank)
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    dist_checkpointing.save(sd, d)


@pytest.mark.parametrize("world", [1, 2])
def test_our_save_has_upstreams_layout(tmp_path, world):
    """Same content, same DCP metadata (keys, global shapes, dtypes, chunks, object items) and metadata.json as the
    checkpoint upstream wrote; torch's own reader gives the same values."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    expected = torch.load(FIXTURES / "api_stacked" / "expected.pt", weights_only=True)
    ours = os.path.join(str(tmp_path), "ours")
    run_distributed(_save_like_upstream, world, ours, expected)

    def layout(d):
        out = {}
        for k, v in FileSystemReader(d).read_metadata().state_dict_metadata.items():
            if isinstance(v, TensorStorageMetadata):
                chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)
                out[k] = (tuple(v.size), v.properties.dtype, chunks)
            else:
                out[k] = type(v).__name__
        return out

    assert layout(ours) == layout(str(FIXTURES / "api_stacked" / "ckpt"))
    with open(os.path.join(ours, "metadata.json")) as f, open(FIXTURES / "api_stacked" / "ckpt" / "metadata.json") as g:
        assert json.load(f) == json.load(g)
    dcp_to_torch_save(ours, os.path.join(str(tmp_path), "ours.pt"))
    plain = torch.load(os.path.join(str(tmp_path), "ours.pt"), weights_only=True)
    assert set(plain) == set(expected)
    for k, v in expected.items():
        assert torch.equal(plain[k], v) if isinstance(v, torch.Tensor) else plain[k] == v, k


def _legacy_common_pt(rank, world, d):
    """The legacy layout (explicit common strategy): common.pt, metadata.json naming it, objects unwrapped."""
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((2,), float(rank)), (0, rank, world)),
          "o": ShardedObject("o", {"r": rank}, (world,), (rank,)), "step": 3}
    dist_checkpointing.save(sd, d, common_strategy=("torch", 1))
    if rank == 0:
        assert sorted(f for f in os.listdir(d) if not f.endswith(".distcp")) == [".metadata", "common.pt", "metadata.json"]
        with open(os.path.join(d, "metadata.json")) as f:
            assert json.load(f)["common_backend"] == "torch"
    out = dist_checkpointing.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world)),
         "o": ShardedObject("o", None, (world,), (rank,))}, d)
    assert torch.equal(out["w"], torch.full((2,), float(rank))) and out["o"] == {"r": rank} and out["step"] == 3
    assert dist_checkpointing.load_common_state_dict(d) == {"step": 3}


def test_legacy_common_pt_layout_still_loads(tmp_path):
    run_distributed(_legacy_common_pt, 2, os.path.join(str(tmp_path), "legacy"))


def test_integrity_manifest_like_upstream(tmp_path):
    import hashlib

    d = os.path.join(str(tmp_path), "ck")
    os.makedirs(d)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, d, verify_integrity=True)
    with open(os.path.join(d, INTEGRITY_FNAME)) as f:
        manifest = json.load(f)
    files = sorted(f for f in os.listdir(d) if f != INTEGRITY_FNAME)
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == files
    for name in files:
        with open(os.path.join(d, name), "rb") as f:
            assert manifest["files"][name] == hashlib.sha256(f.read()).hexdigest(), name
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, d, verify_integrity=True)
    assert torch.equal(out["w"], torch.arange(6.0))

    distcp = next(f for f in files if f.endswith(".distcp") and os.path.getsize(os.path.join(d, f)) > 0)
    with open(os.path.join(d, distcp), "r+b") as f:
        f.seek(8)
        byte = f.read(1)
        f.seek(8)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointingException, match=f"{distcp}: SHA-256 differs"):
        dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, d, verify_integrity=True)
    os.remove(os.path.join(d, INTEGRITY_FNAME))
    with pytest.raises(CheckpointingException, match="integrity.json is missing"):
        dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, d, verify_integrity=True)


def test_object_not_wrapped_like_upstream_is_an_error(tmp_path):
    """An object item of a 0.19-layout checkpoint that is not a one-element list: an error naming the key."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    d = os.path.join(str(tmp_path), "ck")
    os.makedirs(d)
    dist_checkpointing.save({"o": ShardedObject("o", 1, (1,), (0,))}, d)
    # rewrite the object item as a bare value through the strategy (legacy writer): layout says 0.19, item does not
    shutil.rmtree(d)
    os.makedirs(d)
    torch_strategy.TorchDistSaveShardedStrategy().save({"o": ShardedObject("o", 5, (1,), (0,)),
                                                        "c": ShardedObject("common_state", [{}], (1,), (0,))}, d)
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with pytest.raises(CheckpointingException, match="'o/shard_0_1'.*one-element list"):
        dist_checkpointing.load({"o": ShardedObject("o", None, (1,), (0,))}, d)
