"""Round trips (bit-exact fp32/bf16/int64, objects, factories, common and nonpersistent state), the upstream on-disk
layout, the legacy quantized-load hook, and the main errors."""
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests.unit_tests.dist_utils import run_distributed


def _dir(tmp_path, name):
    d = os.path.join(str(tmp_path), name)
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    return d


def _read_object_items(d, keys):
    """The objects of a checkpoint read with torch's own DCP reader (no MCore code)."""
    import io

    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = {k: io.BytesIO() for k in keys}
    dcp_load(state, storage_reader=FileSystemReader(d), planner=DefaultLoadPlanner(), no_dist=True)
    return state


def _tensors(world):
    g = torch.Generator().manual_seed(1)
    return {
        "f32": torch.randn(4 * world, 3, generator=g),
        # values that bf16 represents exactly and arbitrary bit patterns
        "bf16": torch.randn(2 * world, 5, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (world, 2), generator=g, dtype=torch.int64),
    }


def _split_factory(key, data, replica_id, flattened_range):
    # a tensor stored as two keys (its halves), merged back after load
    a, b = data.chunk(2, 0)
    return {
        "a": ShardedTensor.from_rank_offsets(f"{key}.a", a, replica_id=replica_id),
        "b": ShardedTensor.from_rank_offsets(f"{key}.b", b, replica_id=replica_id),
    }


def _merge_factory(sub):
    return torch.cat([sub["a"], sub["b"]])


def _sd(rank, world, t, zero=False):
    def loc(x):
        c = x.chunk(world, 0)[rank].clone()
        return torch.zeros_like(c) if zero else c

    fac_data = torch.zeros(4, 2) if zero else torch.arange(8.0).reshape(4, 2)
    return {
        "model": {
            "f32": ShardedTensor.from_rank_offsets("model.f32", loc(t["f32"]), (0, rank, world)),
            "bf16": ShardedTensor.from_rank_offsets("model.bf16", loc(t["bf16"]), (0, rank, world)),
            "i64": ShardedTensor.from_rank_offsets("model.i64", loc(t["i64"]), (0, rank, world)),
            "layers": [
                ShardedTensor.from_rank_offsets(f"model.layer{i}", (torch.zeros(2) if zero else torch.full((2,), i + 0.5)),
                                                replica_id=rank)
                for i in range(2)
            ],
            "fac": ShardedTensorFactory("model.fac", fac_data, _split_factory, _merge_factory, replica_id=rank),
        },
        "rng": ShardedObject("rng_state", None if zero else {"rank": rank, "seq": list(range(rank + 1))}, (world,), (rank,)),
        "shared_obj": ShardedObject("shared", None if zero else ("same", 42), (1,), (0,), replica_id=rank),
        "iteration": 123,
        "args": {"lr": 0.5, "names": ["a", "b"]},
        "local": LocalNonpersistentObject(f"rank{rank}-only"),
    }


def _roundtrip(rank, world, tmp_path):
    d = _dir(tmp_path, f"rt{world}")
    t = _tensors(world)
    dist_checkpointing.save(_sd(rank, world, t), d, content_metadata={"format": "test", "version": 3})
    dest = _sd(rank, world, t, zero=True)
    out = dist_checkpointing.load(dest, d)
    for name in ("f32", "bf16", "i64"):
        got, ref = out["model"][name], t[name].chunk(world, 0)[rank]
        assert got.dtype == ref.dtype and got.shape == ref.shape
        # bit-exact
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bfloat16 else got.view(torch.int16),
                           ref.view(torch.uint8) if ref.dtype != torch.bfloat16 else ref.view(torch.int16)), name
        assert got.data_ptr() == dest["model"][name].data.data_ptr(), "loaded in place"
    assert isinstance(out["model"]["layers"], list)
    assert [x.tolist() for x in out["model"]["layers"]] == [[0.5, 0.5], [1.5, 1.5]]
    assert torch.equal(out["model"]["fac"], torch.arange(8.0).reshape(4, 2))
    assert out["rng"] == {"rank": rank, "seq": list(range(rank + 1))}
    assert out["shared_obj"] == ("same", 42)
    assert out["iteration"] == 123 and out["args"] == {"lr": 0.5, "names": ["a", "b"]}
    assert out["local"] == f"rank{rank}-only"
    assert dist_checkpointing.load_content_metadata(d) == {"format": "test", "version": 3}
    # the caller's sharded state dict is not modified (factories stay factories)
    assert isinstance(dest["model"]["fac"], ShardedTensorFactory)
    assert isinstance(dest["local"], LocalNonpersistentObject)

    if rank == 0:
        files = sorted(os.listdir(d))
        assert {"metadata.json", ".metadata"} <= set(files) and "common.pt" not in files, files
        distcp = [f for f in files if f.endswith(".distcp")]
        assert distcp and all(f.startswith("__") and f.count("_") == 3 for f in distcp), distcp
        assert {int(f.split("_")[2]) for f in distcp} == set(range(world)), distcp
        with open(os.path.join(d, "metadata.json")) as f:
            assert json.load(f) == {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        md = FileSystemReader(d).read_metadata()
        # upstream 0.19's layout: the common state is the object common_state/shard_0_1 = torch.save([common])
        assert isinstance(md.state_dict_metadata["common_state/shard_0_1"], BytesStorageMetadata)
        objs = _read_object_items(d, ["common_state/shard_0_1", "shared/shard_0_1"])
        common = objs["common_state/shard_0_1"][0]
        assert common["iteration"] == 123 and "local" not in common and "model" not in common
        assert objs["shared/shard_0_1"] == [("same", 42)]
        f32 = md.state_dict_metadata["model.f32"]
        assert isinstance(f32, TensorStorageMetadata) and tuple(f32.size) == (4 * world, 3)
        assert f32.properties.dtype == torch.float32
        assert sorted(tuple(c.offsets) for c in f32.chunks) == [(4 * r, 0) for r in range(world)]
        assert all(tuple(c.sizes) == (4, 3) for c in f32.chunks)
        # replicated tensor: saved once (main replica only)
        assert len(md.state_dict_metadata["model.layer0"].chunks) == 1
        assert isinstance(md.state_dict_metadata[f"rng_state/shard_0_{world}"], BytesStorageMetadata)
        assert isinstance(md.state_dict_metadata["shared/shard_0_1"], BytesStorageMetadata)
        assert "model.fac.a" in md.state_dict_metadata and "model.fac" not in md.state_dict_metadata


@pytest.mark.parametrize("world", [1, 2, 4])
def test_roundtrip(tmp_path, world):
    run_distributed(_roundtrip, world, tmp_path)


def _dequant_hook(rank, world, tmp_path):
    d = _dir(tmp_path, "hook")
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2) * (rank + 1), (0, rank, world))}, d)
    calls = []
    orig = torch_strategy.dequantize_upfront

    def fake(sharded_state_dict):
        calls.append("dequantize")
        return lambda: calls.append("restore")

    torch_strategy.dequantize_upfront = fake
    try:
        for stream in (False, True):
            calls.clear()
            dst = torch.zeros(2, 2)
            strat = TorchDistLoadShardedStrategy(stream_ckpt_dequant=stream)
            assert strat.stream_ckpt_dequant is stream
            out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", dst, (0, rank, world))}, d, strat)
            assert torch.equal(out["w"], torch.ones(2, 2) * (rank + 1))
            assert calls == ([] if stream else ["dequantize", "restore"]), (stream, calls)
    finally:
        torch_strategy.dequantize_upfront = orig


def test_legacy_dequantize_hook(tmp_path):
    run_distributed(_dequant_hook, 2, tmp_path)


def test_unwrap_strips_prepended_axes_with_view():
    class ViewOnly(torch.Tensor):
        pass

    base = torch.arange(6.0).reshape(1, 1, 2, 3)
    sh = ShardedTensor.from_rank_offsets("k", torch.zeros(2, 3), prepend_axis_num=2)
    pyt = torch_strategy._make_torch_sharded_tensor(
        "k", (1, 1, 2, 3), torch.float32, [torch_strategy._Piece((0, 0, 0, 0), (1, 1, 2, 3), base, 2)], sh.without_data()
    )
    (out,) = torch_strategy._unwrap_pyt_sharded_tensor(pyt)
    assert out.shape == (2, 3) and out.data_ptr() == base.data_ptr()
    # a non-singleton prepended axis (axis 1, not axis 0) is reported with the key and the axis
    bad = torch.zeros(1, 2, 3)
    sh1 = ShardedTensor.from_rank_offsets("bad.key", torch.zeros(3), prepend_axis_num=2)
    pyt = torch_strategy._make_torch_sharded_tensor(
        "bad.key", (1, 2, 3), torch.float32, [torch_strategy._Piece((0, 0, 0), (1, 2, 3), bad, 2)], sh1.without_data()
    )
    with pytest.raises(CheckpointingException, match=r"bad\.key.*axis 1"):
        torch_strategy._unwrap_pyt_sharded_tensor(pyt)


def _errors(rank, world, tmp_path):
    ok = _dir(tmp_path, "ok")
    w = torch.arange(8.0).reshape(4, 2)

    def ssd(data=None, key="w", **kw):
        data = w.chunk(world)[rank].clone() if data is None else data
        return {"w": ShardedTensor.from_rank_offsets(key, data, (0, rank, world), **kw)}

    dist_checkpointing.save(ssd(), ok)
    before = {f: os.path.getsize(os.path.join(ok, f)) for f in os.listdir(ok)}

    # destination does not exist
    with pytest.raises(CheckpointingException, match="does not exist"):
        dist_checkpointing.save(ssd(), os.path.join(str(tmp_path), "nope"))
    # destination already holds a checkpoint: refused, nothing touched
    with pytest.raises(CheckpointingException, match="already holds a checkpoint"):
        dist_checkpointing.save(ssd(), ok)
    assert {f: os.path.getsize(os.path.join(ok, f)) for f in os.listdir(ok)} == before
    # overlapping sharding (both ranks claim rows 0..2 as main replica) -> names the key, writes nothing
    bad = _dir(tmp_path, "bad")
    with pytest.raises(CheckpointingException, match=r"overlapping.*'dec\.w'"):
        dist_checkpointing.save(
            {"w": ShardedTensor.from_global_offsets("dec.w", torch.zeros(3, 2), (4, 2), (rank, 0))}, bad
        )
    # incomplete sharding
    with pytest.raises(CheckpointingException, match=r"incomplete.*'dec\.w'"):
        dist_checkpointing.save(
            {"w": ShardedTensor.from_global_offsets("dec.w", torch.zeros(1, 2), (4, 2), (2 * rank, 0))}, bad
        )
    # inconsistent global shapes
    with pytest.raises(CheckpointingException, match=r"inconsistent global shapes.*'dec\.w'"):
        dist_checkpointing.save(
            {"w": ShardedTensor.from_global_offsets("dec.w", torch.zeros(2, 2), (2 * world + rank, 2), (2 * rank, 0))},
            bad,
        )
    dist.barrier()
    assert os.listdir(bad) == []

    # not a checkpoint
    with pytest.raises(CheckpointingException, match="metadata.json"):
        dist_checkpointing.load(ssd(torch.zeros(4 // world, 2)), bad)
    # missing key
    with pytest.raises(CheckpointingException, match="'other'"):
        dist_checkpointing.load(ssd(torch.zeros(4 // world, 2), key="other"), ok)
    # global shape mismatch
    with pytest.raises(CheckpointingException, match=r"shape mismatch.*'w'"):
        dist_checkpointing.load(ssd(torch.zeros(4 // world, 3)), ok)
    # another floating-point dtype converts on load, as upstream's DCP load does (another engine's checkpoint: DDP
    # with --bf16 writes bf16 weights, Megatron-FSDP its fp32 shards)
    got = dist_checkpointing.load(ssd(torch.zeros(4 // world, 2, dtype=torch.bfloat16)), ok)["w"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, w.chunk(world)[rank].to(torch.bfloat16))
    # a floating-point tensor for an integer destination: a dtype mismatch
    with pytest.raises(CheckpointingException, match=r"dtype mismatch.*'w'.*does not convert into an integer"):
        dist_checkpointing.load(ssd(torch.zeros(4 // world, 2, dtype=torch.int64)), ok)
    dist.barrier()
    # missing / truncated data file: the error names the file
    if rank == 0:
        distcp = sorted(f for f in os.listdir(ok) if f.endswith(".distcp") and os.path.getsize(os.path.join(ok, f)))
        victim = os.path.join(ok, distcp[0])
        data = open(victim, "rb").read()
        with open(victim, "wb") as f:
            f.write(data[: len(data) // 2])
    dist.barrier()
    dst = torch.zeros(4, 2)
    with pytest.raises(CheckpointingException, match=r"__\d+_\d+\.distcp.*truncated"):
        dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", dst, replica_id=rank)}, ok)
    dist.barrier()
    if rank == 0:
        os.remove(victim)
    dist.barrier()
    with pytest.raises(CheckpointingException, match=r"__\d+_\d+\.distcp.*missing"):
        dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", dst, replica_id=rank)}, ok)


def test_errors(tmp_path):
    run_distributed(_errors, 2, tmp_path)


def _uneven_participation(rank, world, tmp_path):
    import threading

    d = _dir(tmp_path, "uneven")
    # only rank 0 has sharded state; the other ranks still take part in save and load
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))} if rank == 0 else {"x": 1}
    dist_checkpointing.save(sd, d)
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3))} if rank == 0 else {}, d)
    assert torch.equal(out["w"], torch.ones(3)) if rank == 0 else "w" not in out
    # an unpicklable common value fails on every rank and leaves nothing behind
    d2 = _dir(tmp_path, "unpicklable")
    with pytest.raises(CheckpointingException, match="cannot save object 'common_state/shard_0_1'"):
        dist_checkpointing.save(
            {"lock": threading.Lock(), "w": ShardedTensor.from_rank_offsets("w", torch.ones(3), replica_id=rank)}, d2
        )
    dist.barrier()
    assert os.listdir(d2) == []


def test_uneven_participation(tmp_path):
    run_distributed(_uneven_participation, 2, tmp_path)


def _int_into_float_and_padding(rank, world, tmp_path):
    d = _dir(tmp_path, "int_pad")
    # an int64 tensor (8, 3) saved as two row blocks
    dist_checkpointing.save(
        {"i": ShardedTensor.from_rank_offsets("i", torch.arange(12).reshape(4, 3) + 12 * rank, (0, rank, world))}, d
    )
    # into float32 destinations of 5 rows each (10 > 8, allow_shape_mismatch): converted as upstream; the rows the
    # checkpoint does not cover are zero (upstream pads with zeros), not the destination's ones
    out = dist_checkpointing.load(
        {"i": ShardedTensor.from_rank_offsets("i", torch.ones(5, 3), (0, rank, world), allow_shape_mismatch=True)}, d
    )["i"]
    expected = torch.zeros(10, 3)
    expected[:8] = torch.arange(24.0).reshape(8, 3)
    assert out.dtype == torch.float32 and torch.equal(out, expected.chunk(world)[rank])


def test_int_into_float_and_shape_mismatch_padding(tmp_path):
    run_distributed(_int_into_float_and_padding, 2, tmp_path)


def test_factory_merge_fn_gets_what_build_fn_built(tmp_path):
    """Upstream passes merge_fn the loaded counterpart of build_fn's result: a list stays a list (e.g. SwiGLU's
    ``torch.cat(pieces)``), so a merge written for upstream (``sum(pieces)``) gives the same answer here."""

    def build(key, data, replica_id, flattened_range):
        a, b = data.chunk(2)
        return [ShardedTensor.from_rank_offsets(f"{key}.a", a), ShardedTensor.from_rank_offsets(f"{key}.b", b)]

    seen = []

    def merge(pieces):
        seen.append(type(pieces))
        return sum(pieces)

    dist_checkpointing.save({"f": ShardedTensorFactory("k", torch.arange(4.0), build, merge)}, str(tmp_path))
    out = dist_checkpointing.load({"f": ShardedTensorFactory("k", torch.zeros(4), build, merge)}, str(tmp_path))
    assert seen == [list]
    assert torch.equal(out["f"], torch.tensor([2.0, 4.0]))


def test_saved_views_are_written_without_a_clone(tmp_path):
    """A CPU view into a larger storage (stacked layers) is handed to DCP's writer as an alias with its own exact
    storage (DCP would clone it), and the checkpoint holds exactly the views' values."""
    from megatron.core.dist_checkpointing.strategies.planners import own_storage_alias

    stacked = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    layer = stacked[2]
    alias = own_storage_alias(layer)
    assert alias.data_ptr() == layer.data_ptr() and torch.equal(alias, layer) and alias.dtype == layer.dtype
    assert alias.untyped_storage().nbytes() == 6 * 5 * 4 < layer.untyped_storage().nbytes()
    bf = torch.ones(3, 8, dtype=torch.bfloat16)[1]
    assert own_storage_alias(bf).untyped_storage().nbytes() == 16 and own_storage_alias(bf).dtype == torch.bfloat16
    flat = torch.nn.Parameter(torch.arange(10.0))
    param_view = torch.nn.Parameter(flat.data[2:6])  # a parameter that is a view into a flat buffer
    alias = own_storage_alias(param_view)
    assert type(alias) is torch.Tensor and not alias.requires_grad and alias.untyped_storage().nbytes() == 16
    assert torch.equal(alias, torch.tensor([2.0, 3.0, 4.0, 5.0])) and alias.data_ptr() == param_view.data_ptr()
    assert own_storage_alias(stacked) is stacked  # its own storage already
    strided = stacked[:, 0]
    assert own_storage_alias(strided) is strided  # not contiguous: left to DCP
    sd = {f"l{i}": ShardedTensor.from_rank_offsets("w", stacked[i], (0, i, 4), prepend_axis_num=1)
          for i in range(4)}
    dist_checkpointing.save(sd, tmp_path)
    stacked.add_(1)  # the alias must not have been a copy taken earlier: the checkpoint has the saved values
    loaded = dist_checkpointing.load_plain_tensors(tmp_path)["w"]
    assert torch.equal(loaded, torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5))
    data = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert 4 * 6 * 5 * 4 <= data < 4 * 6 * 5 * 4 + 16 * 1024  # each layer's bytes once, not the whole stack 4 times
