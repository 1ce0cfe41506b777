"""strategies/staged_read.py: tensor items read without torch.load, by I/O threads into a fixed staging pool.

Checked: the CRC combine equals the libraries' checksum of the joined bytes; the archive parser finds the bytes of
contiguous, transposed, offset-storage, 0-d, empty and float8 (``_rebuild_tensor_v3``) tensors and sends parameters
and multi-storage archives to the fallback; the reader loads exactly what torch's ``FileSystemReader`` loads (many
items, all paths: small, pieces, bounding rows, strided, objects), with and without checksums, with the staging pool
never over its size; resharded loads on 2 gloo ranks (2 -> whole, whole -> 2 along dim 0 and dim 1); partial reads
read fewer bytes than the item; a flipped byte in a tensor's data (staged and small items), header, or in bytes
only the checksum needs is named by key, file and byte range; a planted pickle in data.pkl is refused unrun; CUDA
destinations (pinned staging, streaming planner) equal a CPU load (``gpu``). A fallback item (DCP stream transform,
unparsed archive) split into several read items (chunked streaming planner, row halves) is read, checksummed and
torch.loaded once for its consecutive read items, exactly. Overlapping and duplicate read items on one stored item
load exactly and verified, ten times over; a flipped byte in the overlap is named; a read of a shared range that
returns different bytes is detected whether it finishes before or after the other reads (forced orders)."""
import dataclasses
import io
import os
import pickle
import threading
import time
import warnings
import zipfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem as fs_mod
from megatron.core.dist_checkpointing.strategies import staged_read as sr
from megatron.core.dist_checkpointing.strategies.filesystem import (
    ALGORITHMS,
    CHECKSUM_ATTR,
    ChecksummedFileSystemReader,
    ChecksummedFileSystemWriter,
)
from tests.unit_tests.dist_checkpointing.test_integrity import _flip, _inner
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.test_safe_globals import Payload

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _set_sizes(monkeypatch, **sizes):
    """The staged reader's size constants (``staged_read.<NAME>``) set for one test."""
    for name, value in sizes.items():
        monkeypatch.setattr(sr, name, value)


@pytest.fixture
def small_pool(monkeypatch):
    """A tiny staging pool, so that ordinary test tensors take every path (pieces, recycling, bounding rows)."""
    _set_sizes(monkeypatch, STAGING_BUFFER_BYTES=4096, STAGING_BUFFERS=2, SMALL_ITEM_BYTES=2048, HEAD_BYTES=512,
               TAIL_BYTES=256, GAP_CHUNK_BYTES=1000)


@pytest.fixture
def readers(monkeypatch):
    """Every ChecksummedFileSystemReader that read data (for its ``last_read_stats``)."""
    seen = []
    orig = ChecksummedFileSystemReader.read_data

    def read_data(self, plan, planner):
        seen.append(self)
        return orig(self, plan, planner)

    monkeypatch.setattr(ChecksummedFileSystemReader, "read_data", read_data)
    return seen


# ---- pieces -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", sorted(set(ALGORITHMS) & set(sr.CRC_POLYNOMIALS)))
def test_crc_combine_equals_checksum_of_joined_bytes(algorithm):
    update = ALGORITHMS[algorithm]
    g = torch.Generator().manual_seed(1)
    for la, lb in ((0, 5), (5, 0), (1, 1), (1000, 333), (4096, 70000)):
        a = bytes(torch.randint(0, 256, (la,), generator=g, dtype=torch.uint8).tolist())
        b = bytes(torch.randint(0, 256, (lb,), generator=g, dtype=torch.uint8).tolist())
        assert sr.crc_combine(algorithm, update(a, 0), update(b, 0), lb) == update(a + b, 0), (la, lb)


def _archive(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _item_bytes(data: bytes, head=64, tail=64) -> sr.ItemBytes:
    reads = []

    def fetch(pos, n):
        reads.append((pos, n))
        return bytearray(data[pos:pos + n])

    item = sr.ItemBytes(len(data), fetch, head, tail, 1 << 20)
    item.reads = reads
    return item


def _tensor_from(data: bytes, rec: sr.TensorRecord) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data[rec.data_start:rec.data_start + rec.data_nbytes]) or bytearray(1),
                           dtype=torch.uint8)[: rec.data_nbytes]
    t = raw.view(rec.dtype)
    return t.as_strided(rec.size, rec.stride, rec.storage_offset)


@pytest.mark.parametrize("case", ["contiguous", "transposed", "offset_storage", "scalar", "empty", "float8", "bf16_3d"])
def test_tensor_record_finds_the_bytes(case):
    base = torch.arange(2000, dtype=torch.float32).view(40, 50)
    t = {
        "contiguous": base,
        "transposed": base.t(),
        "offset_storage": base[3:7, 5:9],  # torch.save keeps the whole storage, with a storage offset
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7),
        "float8": (base / 100).to(torch.float8_e4m3fn),
        "bf16_3d": base.view(4, 10, 50).to(torch.bfloat16),
    }[case]
    data = _archive(t)
    item = _item_bytes(data)
    rec = sr.tensor_record(item, "x")
    assert rec.dtype == t.dtype and rec.size == tuple(t.shape) and rec.stride == t.stride()
    assert rec.storage_offset == t.storage_offset() and rec.data_start % 64 == 0
    got = _tensor_from(data, rec)
    assert torch.equal(got.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else got,
                       t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    assert rec.is_c_contiguous() == (case not in ("transposed", "offset_storage"))
    # only the ends of a large archive were read (header + central directory), not its data
    if len(data) > 4096:
        assert sum(n for _, n in item.reads) < 4096, item.reads


@pytest.mark.parametrize("obj", ["parameter", "two_tensors", "not_an_archive"])
def test_tensor_record_unsupported_falls_back(obj):
    data = {
        "parameter": lambda: _archive(torch.nn.Parameter(torch.ones(3))),
        "two_tensors": lambda: _archive((torch.ones(3), torch.zeros(2))),
        "not_an_archive": lambda: b"\x00" * 300,
    }[obj]()
    with pytest.raises(sr._Unsupported):
        sr.tensor_record(_item_bytes(data), "x")


def test_planted_pickle_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(Payload(marker), protocol=2))
        z.writestr("archive/data/0", b"\x00" * 64)
        z.writestr("archive/version", b"3\n")
    # an unknown global is not this reader's business: it hands the item to the per-item path...
    with pytest.raises(sr._Unsupported, match=r"io\.open|builtins\.open"):
        sr.tensor_record(_item_bytes(buf.getvalue()), "checkpoint item 'w'")
    assert not marker.exists()
    # ... whose torch.load(weights_only=True) refuses it, running nothing either
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert not marker.exists()


def test_plan_pieces_cover_the_region():
    rec = sr.TensorRecord(torch.float32, (10, 6, 4), (24, 4, 1), 0, 64, 960)
    cap = 4 * 24 * 3  # three rows of dim 0
    full = torch.arange(240, dtype=torch.float32).view(10, 6, 4)
    raw = torch.cat([torch.zeros(16), full.flatten()]).view(torch.uint8)  # 64 header bytes, then the data
    for offsets, lengths, contiguous in (((0, 0, 0), (10, 6, 4), True), ((2, 0, 0), (7, 6, 4), True),
                                         ((3, 2, 0), (1, 3, 4), True), ((1, 2, 0), (5, 3, 4), False),
                                         ((0, 0, 1), (10, 6, 2), False)):
        pieces = sr.plan_pieces(rec, offsets, lengths, cap, whole=False)
        target = torch.full(lengths, -1.0)
        for p in pieces:
            assert p.nbytes <= cap
            src = p.source(raw[p.start:p.start + p.nbytes].clone(), torch.float32)
            dst = target if p.tgt_box is None else target[tuple(slice(o, o + n) for o, n in zip(*p.tgt_box))]
            dst.copy_(src)
        want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        assert torch.equal(target, want), (offsets, lengths)
        if contiguous:  # only the region's own bytes
            assert sum(p.nbytes for p in pieces) == want.numel() * 4, (offsets, lengths)


# ---- the reader ---------------------------------------------------------------------------------------------------
def _state():
    g = torch.Generator().manual_seed(0)
    return {
        **{f"w{i}": torch.randn(37 + i, 29, generator=g) for i in range(6)},  # pieces (4 KiB buffers)
        "b": torch.randn(64, generator=g).to(torch.bfloat16),  # small item
        "wide": torch.randn(3, 2000, generator=g),  # one row > a buffer: pieces inside a row
        "tr": torch.randn(40, 30, generator=g).t(),  # stored transposed: the strided whole read
        "cube": torch.randn(6, 9, 11, generator=g).to(torch.float64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "i64": torch.arange(900, dtype=torch.int64),
        "obj": (7, "x" * 50),
    }


def _zeros(sd):
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}


@pytest.mark.parametrize("writer", ["checksummed", "plain"])
def test_reader_equals_torch_reader(tmp_path, small_pool, readers, writer):
    ckpt = str(tmp_path / "ckpt")
    sd = _state()
    dcp_save(sd, storage_writer=(ChecksummedFileSystemWriter if writer == "checksummed" else FileSystemWriter)(ckpt))
    ref, out = _zeros(sd), _zeros(sd)
    dcp_load(ref, storage_reader=FileSystemReader(ckpt))
    dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], ref[k]) and torch.equal(out[k], v), k
        else:
            assert out[k] == ref[k] == v
    stats = readers[-1].last_read_stats
    tensors = [v for v in sd.values() if isinstance(v, torch.Tensor) and v.numel()]  # DCP skips empty ones
    assert stats.items_fallback == 0 and stats.items_staged == len(tensors)
    assert stats.pool_buffers == sr.STAGING_BUFFERS and 1 <= stats.pool_peak_in_use <= sr.STAGING_BUFFERS
    assert stats.bytes_read > 4 * sr.STAGING_BUFFERS * sr.STAGING_BUFFER_BYTES  # buffers were recycled


def _strip_checksums(ckpt):
    meta = os.path.join(ckpt, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.__dict__.pop(CHECKSUM_ATTR, None)
    with open(meta, "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("checksums", [True, False])
def test_partial_read_reads_fewer_bytes(tmp_path, readers, checksums):
    """Loading half of a stored tensor (resharding along dim 0) reads that half only (no checksums) or the item once
    (checksums: the rest for the checksum only); before, every read item was read twice (checksum + torch.load)."""
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    full = torch.randn(512, 1024)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", full)}, ckpt)
    if not checksums:
        _strip_checksums(ckpt)
    out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(256, 1024), (0, 1, 2))},
                                  ckpt, validate_access_integrity=False)  # one process loads the half of rank 1
    assert torch.equal(out["w"], full[256:])
    md = fs_mod.read_dcp_metadata_file(os.path.join(ckpt, ".metadata"))
    length = sum(int(i.length) for x, i in md.storage_data.items() if x.fqn == "w")
    stats = readers[-1].last_read_stats
    assert stats.items_staged == 1 and stats.items_fallback == 0
    if checksums:
        assert length <= stats.bytes_read <= length + sr.HEAD_BYTES + sr.TAIL_BYTES
    else:
        assert stats.bytes_read <= length // 2 + sr.HEAD_BYTES + sr.TAIL_BYTES


def _stored(ckpt, fqn):
    """(storage info, data file path, TensorRecord) of the stored item of ``fqn``."""
    md = fs_mod.read_dcp_metadata_file(os.path.join(ckpt, ".metadata"))
    info = next(info for index, info in md.storage_data.items() if index.fqn == fqn)
    path = os.path.join(ckpt, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    return info, path, sr.tensor_record(_item_bytes(data), fqn)


def _assert_named(exc, fqn, path, info):
    msg = str(_inner(exc))
    assert repr(fqn) in msg and path in msg, msg
    assert f"bytes [{info.offset}, {info.offset + info.length})" in msg and "fails its checksum" in msg, msg


@pytest.mark.parametrize("where", ["data_middle", "header", "tail", "small_item"])
def test_flipped_byte_named(tmp_path, small_pool, where):
    ckpt = str(tmp_path / "ckpt")
    sd = _state()
    dcp_save(sd, storage_writer=ChecksummedFileSystemWriter(ckpt))
    fqn = "b" if where == "small_item" else "w3"
    info, path, rec = _stored(ckpt, fqn)
    pos = {"data_middle": rec.data_start + rec.data_nbytes // 2, "header": 100, "tail": info.length - 30,
           "small_item": rec.data_start + 10}[where]
    _flip(path, info.offset + pos, n=4)
    with pytest.raises(BaseException) as e:
        dcp_load(_zeros(sd), storage_reader=ChecksummedFileSystemReader(ckpt))
    _assert_named(e.value, fqn, path, info)


def test_flipped_byte_in_rows_not_loaded_named(tmp_path, small_pool, readers):
    """A partial load (the second half of the rows) still checks the first half, read for the checksum only."""
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    full = torch.randn(64, 40)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", full)}, ckpt)
    info, path, rec = _stored(ckpt, "w")
    _flip(path, info.offset + rec.data_start + 8, n=4)  # row 0
    half = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(32, 40), (0, 1, 2))}
    with pytest.raises(CheckpointingException) as e:
        dist_checkpointing.load(half, ckpt, validate_access_integrity=False)
    _assert_named(e.value, "w", path, info)
    assert readers[-1].last_read_stats is None or readers[-1].last_read_stats.items_fallback == 0


# ---- resharding on 2 gloo ranks -------------------------------------------------------------------------------------
def _reshard_body(rank, world, ckpt, save_axis, load_axis):
    sr.STAGING_BUFFER_BYTES, sr.SMALL_ITEM_BYTES, sr.STAGING_BUFFERS = 1024, 1024, 2  # this process only
    full = torch.arange(48 * 30, dtype=torch.float32).view(48, 30)

    def sharded(t, axis):
        if axis is None:  # the whole tensor on every rank (rank 0's copy is the main replica)
            return ShardedTensor.from_rank_offsets("w", t.clone(), replica_id=rank)
        return ShardedTensor.from_rank_offsets("w", t.chunk(world, axis)[rank].clone(), (axis, rank, world))

    dist_checkpointing.save({"w": sharded(full, save_axis)}, ckpt)
    dist.barrier()
    dest = sharded(torch.zeros_like(full), load_axis)
    loaded = dist_checkpointing.load({"w": dest}, ckpt)
    want = full if load_axis is None else full.chunk(world, load_axis)[rank]
    assert torch.equal(loaded["w"], want)


@pytest.mark.parametrize("save_axis,load_axis", [(0, None), (None, 0), (None, 1), (0, 1)])
def test_resharded_loads_2_ranks(tmp_path, save_axis, load_axis):
    os.makedirs(tmp_path / "ckpt")
    run_distributed(_reshard_body, 2, str(tmp_path / "ckpt"), save_axis, load_axis)


# ---- CUDA destinations ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_destinations_equal_cpu_load(tmp_path, readers):
    """Plain bf16 CUDA destinations (pinned staging, asynchronous copies) and quantized CUDA destinations through the
    streaming planner (whole and chunked) load exactly what a CPU load gives."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor

    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    g = torch.Generator().manual_seed(0)
    src = {f"w{i}": torch.randn(1024 + 64 * i, 2048, generator=g).to(torch.bfloat16) for i in range(4)}
    src["q"] = torch.randn(4096, 1024, generator=g).to(torch.bfloat16)
    dist_checkpointing.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in src.items()}, ckpt)

    cpu = dist_checkpointing.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in src.items()},
                                  ckpt)
    gpu = dist_checkpointing.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v, device="cuda")) for k, v in src.items()}, ckpt)
    torch.cuda.synchronize()
    assert readers[-1].last_read_stats.pinned and readers[-1].last_read_stats.items_fallback == 0
    for k in src:
        assert gpu[k].is_cuda and torch.equal(gpu[k].cpu(), cpu[k]) and torch.equal(cpu[k], src[k]), k

    for chunk_mb in (0, 1):  # whole scratch; chunks of 1 MiB (the reader gives the capture target whole tensors)
        strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=chunk_mb)
        dest = FakeQuantizedTensor.quantize(torch.zeros(4096, 1024, dtype=torch.bfloat16, device="cuda"), "tensorwise")
        dist_checkpointing.load({"q": ShardedTensor.from_rank_offsets("q", dest)}, ckpt, sharded_strategy=strategy)
        want = FakeQuantizedTensor.quantize(cpu["q"].cuda(), "tensorwise")
        assert torch.equal(dest._data.view(torch.uint8), want._data.view(torch.uint8)), chunk_mb
        assert torch.equal(dest._scale_inv, want._scale_inv), chunk_mb


@pytest.mark.parametrize("checksums", [True, False])
def test_metadata_larger_than_stored_tensor_refused(tmp_path, monkeypatch, checksums):
    """A .metadata that claims more of a tensor than its item stores is refused naming the key; nothing is read
    past the item (the next item's bytes are never loaded as data)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    monkeypatch.setattr(sr, "SMALL_ITEM_BYTES", 256)
    ckpt = str(tmp_path / "ckpt")
    a, b = torch.arange(32, dtype=torch.float32).view(8, 4), torch.full((8, 4), 777.0)
    dcp_save({"a": a, "b": b}, storage_writer=(ChecksummedFileSystemWriter if checksums else FileSystemWriter)(ckpt))
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    m = md.state_dict_metadata["a"]
    m.size = torch.Size([16, 4])
    m.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([16, 4]))]
    with open(path, "wb") as f:
        pickle.dump(md, f)
    out = {"a": torch.zeros(16, 4)}
    with pytest.raises(BaseException) as e:
        dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    msg = str(_inner(e.value))
    assert "'a'" in msg and "[16, 4]" in msg and "[8, 4]" in msg and "disagree" in msg, msg
    assert not (out["a"] == 777.0).any()


@pytest.mark.parametrize("name", ["gpt_dense", "gpt_moe"])
def test_upstream_written_checkpoint_read_staged(name):
    """Checkpoints upstream megatron-core 0.19.2 really wrote: every tensor item goes through the staged path (no
    torch.load fallback) and equals what torch's own reader loads."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tests.unit_tests.fixtures import UPSTREAM_FIXTURES

    ckpt = os.path.join(str(UPSTREAM_FIXTURES), name, "ckpt")
    md = fs_mod.read_dcp_metadata_file(os.path.join(ckpt, ".metadata"))
    keys = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    ours = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in keys.items()}
    ref = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in keys.items()}
    reader = ChecksummedFileSystemReader(ckpt)
    dcp_load(ours, storage_reader=reader, no_dist=True)
    dcp_load(ref, storage_reader=FileSystemReader(ckpt), no_dist=True)
    stats = reader.last_read_stats
    assert stats.items_fallback == 0 and stats.items_staged == sum(len(m.chunks) for m in keys.values()), stats
    for k in keys:
        assert torch.equal(ours[k], ref[k]), k


# ---- fallback items split into several read items: one torch.load per stored item ---------------------------------
class _Xor(StreamTransformExtension):
    """A DCP stream transform (bytes XOR 0x5A): its items are not zip archives on disk, so they take the fallback."""

    @staticmethod
    def registry_name() -> str:
        return "mcore_test.xor"

    @staticmethod
    def from_descriptor(version: str) -> "_Xor":
        return _Xor()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                data = bytes(memoryview(b).cast("B"))
                output.write(bytes(x ^ 0x5A for x in data))
                return len(data)

            def flush(self):
                output.flush()

        return Writer()

    def transform_from(self, input):
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def _unparsed(item, what):
    """``tensor_record`` for an archive this reader does not parse (an unknown global, an odd record)."""
    raise sr._Unsupported("test: not parsed")


@pytest.mark.parametrize("why", ["stream_transform", "unparsed_archive"])
def test_split_fallback_item_loaded_once(tmp_path, monkeypatch, readers, why):
    """The chunked streaming planner splits the one saved item of a quantized destination into one read item per
    chunk (8 here); when that item falls back to torch.load, it is read, checksummed and unpickled once for all 8
    (before: 8 times each), and every chunk lands exactly."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    from tests.unit_tests.dist_checkpointing.test_stream_chunked import (
        CHUNK,
        _assert_whole_equal,
        _dest,
        _full,
        _Planner,
    )

    ckpt = str(tmp_path / "ckpt")
    full = _full()  # 1000 x 256 bf16: 8 chunks of 128 rows
    registry = ExtensionRegistry()
    registry.register(_Xor)
    extensions = [_Xor()] if why == "stream_transform" else None
    dcp_save({"w": full, "plain": torch.arange(10.0)},
             storage_writer=ChecksummedFileSystemWriter(ckpt, _extensions=extensions))
    if why == "unparsed_archive":
        monkeypatch.setattr(sr, "tensor_record", _unparsed)
    calls = {"load": 0, "checksum": 0}
    from megatron.core.dist_checkpointing.strategies import item_checks

    orig_load, orig_range = torch.load, item_checks.checksum_range

    def counting_load(*args, **kwargs):
        calls["load"] += 1
        return orig_load(*args, **kwargs)

    def counting_range(*args, **kwargs):
        calls["checksum"] += 1
        return orig_range(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    monkeypatch.setattr(item_checks, "checksum_range", counting_range)
    monkeypatch.setattr(sr, "checksum_range", counting_range)  # the name the staged engine imported
    monkeypatch.setattr(fs_mod, "checksum_range", counting_range)  # and the reader's
    dest = _dest(full, "delayed", float(full.float().abs().max()))
    scale = dest._quantizer.scale.clone()
    plain = torch.zeros(10)
    planner = _Planner(stream_chunk_bytes=CHUNK)
    dcp_load({"w": dest, "plain": plain}, planner=planner, no_dist=True,
             storage_reader=ChecksummedFileSystemReader(ckpt, _extension_registry=registry))
    planner.finish_quantized_load()
    stats = readers[-1].last_read_stats
    assert stats.items_staged == 0 and stats.items_fallback == 8 + 1, stats  # 8 chunks of w, plain
    assert stats.fallback_loads == 2, stats
    assert calls == {"load": 2, "checksum": 2}, calls  # one torch.load and one checksum read per stored item
    assert torch.equal(plain, torch.arange(10.0))
    _assert_whole_equal(dest, full, "delayed", scale, why)


class _RowSplitPlanner(DefaultLoadPlanner):
    """Every tensor read item split in two along dim 0 (as the chunked streaming planner splits); ``interleave``:
    the halves of different items alternate in the plan."""

    def __init__(self, interleave=False):
        super().__init__()
        self.interleave = interleave

    def finish_plan(self, plan):
        plan = super().finish_plan(plan)
        halves = []
        for item in plan.items:
            n = int(item.lengths[0])
            first = dataclasses.replace(item, lengths=torch.Size([n // 2, *item.lengths[1:]]))
            second = dataclasses.replace(
                item, dest_offsets=torch.Size([int(item.dest_offsets[0]) + n // 2, *item.dest_offsets[1:]]),
                storage_offsets=torch.Size([int(item.storage_offsets[0]) + n // 2, *item.storage_offsets[1:]]),
                lengths=torch.Size([n - n // 2, *item.lengths[1:]]))
            halves.append((first, second))
        if self.interleave:
            items = [h[0] for h in halves] + [h[1] for h in halves]
        else:
            items = [x for h in halves for x in h]
        return dataclasses.replace(plan, items=items)


@pytest.mark.parametrize("interleave", [False, True])
def test_row_split_fallback_items_exact(tmp_path, monkeypatch, readers, interleave):
    """Two fallback items, each split in two read items: consecutive (a, a, b, b), each is loaded once; interleaved
    in the plan (a, b, a, b), at most one loaded item is kept, so each is loaded again. Every half lands exactly."""
    ckpt = str(tmp_path / "ckpt")
    a, b = torch.randn(12, 5), torch.randn(8, 3)
    dcp_save({"a": a, "b": b}, storage_writer=ChecksummedFileSystemWriter(ckpt))
    monkeypatch.setattr(sr, "tensor_record", _unparsed)
    out = {"a": torch.zeros(12, 5), "b": torch.zeros(8, 3)}
    dcp_load(out, planner=_RowSplitPlanner(interleave), no_dist=True, storage_reader=ChecksummedFileSystemReader(ckpt))
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
    stats = readers[-1].last_read_stats
    assert stats.items_fallback == 4 and stats.fallback_loads == (4 if interleave else 2), stats


# ---- overlapping read items on one stored item: every read verified, whatever order the threads finish in --------
class _OverlapPlanner(DefaultLoadPlanner):
    """Besides the saved 64 x 40 ``w`` (one stored item) into ``w``: the same item again into ``dup`` (identical
    byte ranges) and its rows [16, 56) into ``part`` (overlapping both): three read items on one stored item."""

    def __init__(self):
        super().__init__(allow_partial_load=True)  # dup and part are not in the checkpoint

    def create_local_plan(self):
        plan = super().create_local_plan()
        (w,) = [i for i in plan.items if i.dest_index.fqn == "w"]
        dup = dataclasses.replace(w, dest_index=MetadataIndex("dup", w.dest_index.offset))
        part = dataclasses.replace(w, dest_index=MetadataIndex("part", w.dest_index.offset),
                                   storage_offsets=torch.Size([16, 0]), lengths=torch.Size([40, 40]))
        return dataclasses.replace(plan, items=[w, dup, part])


@pytest.fixture
def one_piece_per_item(monkeypatch):
    """Each of the three read items is one piece (all in flight at once); the item is not read whole."""
    _set_sizes(monkeypatch, SMALL_ITEM_BYTES=2048, HEAD_BYTES=512, TAIL_BYTES=256, STAGING_BUFFER_BYTES=16384,
               STAGING_BUFFERS=4)


def _overlap_ckpt(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = torch.randn(64, 40, generator=torch.Generator().manual_seed(3))
    dcp_save({"w": full}, storage_writer=ChecksummedFileSystemWriter(ckpt))
    return ckpt, full


def _overlap_load(ckpt):
    out = {"w": torch.zeros(64, 40), "dup": torch.zeros(64, 40), "part": torch.zeros(40, 40)}
    dcp_load(out, planner=_OverlapPlanner(), no_dist=True, storage_reader=ChecksummedFileSystemReader(ckpt))
    return out


def test_overlapping_read_items_verified_repeatedly(tmp_path, monkeypatch, one_piece_per_item, readers):
    ckpt, full = _overlap_ckpt(tmp_path)
    combines = []
    orig = sr.crc_combine
    monkeypatch.setattr(sr, "crc_combine", lambda *a: combines.append(a) or orig(*a))
    for _ in range(10):
        combines.clear()
        out = _overlap_load(ckpt)
        assert torch.equal(out["w"], full) and torch.equal(out["dup"], full) and torch.equal(out["part"], full[16:56])
        stats = readers[-1].last_read_stats
        assert stats.items_staged == 3 and stats.items_fallback == 0, stats
        assert len(combines) >= 4  # the item's checksum was combined from its parts (head, 3 data ranges, tail)


def test_corrupted_overlap_on_disk_named(tmp_path, one_piece_per_item):
    ckpt, _ = _overlap_ckpt(tmp_path)
    info, path, rec = _stored(ckpt, "w")
    _flip(path, info.offset + rec.data_start + 30 * 40 * 4, n=4)  # row 30: read by all three read items
    with pytest.raises(BaseException) as e:
        _overlap_load(ckpt)
    _assert_named(e.value, "w", path, info)


@pytest.mark.parametrize("victim,finishes", [("part", "first"), ("part", "last"), ("dup", "first"), ("dup", "last")])
def test_differing_reads_of_one_range_detected(tmp_path, monkeypatch, one_piece_per_item, victim, finishes):
    """Two read items read the same bytes, and one read returns different bytes (a transient I/O fault, the file
    changed in between): the load fails naming the item, whether the bad read finishes before or after the good
    reads of the same range (before: the interval's checksum was the last thread's, so a bad read that finished
    first went unverified into its destination)."""
    ckpt, _ = _overlap_ckpt(tmp_path)
    info, path, rec = _stored(ckpt, "w")
    data_at = info.offset + rec.data_start
    row = 40 * 4
    ranges = {"part": (data_at + 16 * row, 40 * row), "dup": (data_at, 64 * row)}
    lock, seen = threading.Lock(), {"dup": 0}
    others_done, victim_done = threading.Event(), threading.Event()
    orig = sr._pread_into

    def pread_into(fd, mv, offset, path_, item):
        if (offset, len(mv)) not in ranges.values():  # header and tail reads
            return orig(fd, mv, offset, path_, item)
        with lock:
            if (offset, len(mv)) == ranges[victim] and victim == "dup":
                seen["dup"] += 1
                bad = seen["dup"] == 1  # the first of the two identical reads
            else:
                bad = (offset, len(mv)) == ranges[victim]
        if bad:
            if finishes == "last":
                assert others_done.wait(5)
                time.sleep(0.2)  # and their threads checksummed what they read
            orig(fd, mv, offset, path_, item)
            mv[30 * row - (offset - data_at)] ^= 0xFF  # a byte of row 30 comes back different
            victim_done.set()
        else:
            if finishes == "first":
                assert victim_done.wait(5)
                time.sleep(0.2)  # and the victim's thread checksummed what it read
            orig(fd, mv, offset, path_, item)
            with lock:
                seen["others"] = seen.get("others", 0) + 1
                if seen["others"] == 2:
                    others_done.set()

    monkeypatch.setattr(sr, "_pread_into", pread_into)
    with pytest.raises(BaseException) as e:
        _overlap_load(ckpt)
    _assert_named(e.value, "w", path, info)
    lo, hi = data_at + 16 * row, data_at + 56 * row  # the range of row 30 that all three read items share
    assert f"overlapping at bytes [{lo}, {hi}) of the file read them differently" in str(_inner(e.value))
    assert victim_done.is_set()
