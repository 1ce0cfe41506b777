"""strategies/filesystem.py: per-item checksums (written with the bytes, verified as read), the restricted
``.metadata`` reader, object items checked before the planner unpickles them; upstream fixtures and checkpoints
without checksums still load. Single process and 2 gloo ranks."""
import logging
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem as fs_mod
from megatron.core.dist_checkpointing.strategies.filesystem import (
    ALGORITHMS,
    CHECKSUM_ATTR,
    ChecksummedFileSystemReader,
    ChecksummedFileSystemWriter,
    read_dcp_metadata_file,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.fixtures import UPSTREAM_FIXTURES
from tests.unit_tests.test_safe_globals import Payload

FIXTURES = str(UPSTREAM_FIXTURES)  # in the repository: the tests never skip for want of them
FIXTURE_NAMES = ["api_stacked", "gpt_dense", "gpt_moe"]


def _inner(exc: BaseException) -> BaseException:
    """The CheckpointingException inside a DCP CheckpointException (DCP wraps what a rank raised)."""
    if isinstance(exc, CheckpointingException):
        return exc
    for failure in (getattr(exc, "failures", None) or {}).values():
        e = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(e, CheckpointingException):
            return e
    raise AssertionError(f"no CheckpointingException in {type(exc).__name__}: {exc}")


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=g),
        "h": torch.randn(40, generator=g).to(torch.bfloat16),
        "obj": (7, "x" * 50),  # one bytes item (a dict would be flattened by DCP)
    }


def _empty_like(sd):
    return {"w": torch.zeros(64, 32), "h": torch.zeros(40, dtype=torch.bfloat16), "obj": None}


def _item(ckpt, fqn):
    """(MetadataIndex, _StorageInfo) of the stored item of ``fqn`` (plain pickle: the test's own checkpoint)."""
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return index, info
    raise KeyError(fqn)


def _flip(path, pos, n=8):
    with open(path, "r+b") as f:
        f.seek(pos)
        data = f.read(n)
        f.seek(pos)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_round_trip_and_checksums_match_file_bytes(tmp_path, algorithm):
    ckpt = str(tmp_path / "ckpt")
    sd = _state()
    dcp_save(sd, storage_writer=ChecksummedFileSystemWriter(ckpt, algorithm=algorithm))
    md = read_dcp_metadata_file(os.path.join(ckpt, ".metadata"))
    assert len(md.storage_data) == 3
    for index, info in md.storage_data.items():  # each checksum is that of the item's bytes on disk
        with open(os.path.join(ckpt, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        assert getattr(info, CHECKSUM_ATTR) == f"{algorithm}:{ALGORITHMS[algorithm](data, 0):08x}", index.fqn
    out = _empty_like(sd)
    dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["h"], sd["h"]) and out["obj"] == sd["obj"]
    # upstream (torch's own reader, plain pickle) reads it unchanged
    out2 = _empty_like(sd)
    dcp_load(out2, storage_reader=FileSystemReader(ckpt))
    assert torch.equal(out2["w"], sd["w"]) and out2["obj"] == sd["obj"]


def test_writer_skips_torch_zip_crc_and_restores_it(tmp_path, monkeypatch):
    """Items are written without torch.save's zip CRC-32 (our CRC32C covers them; torch never checks it), the
    global torch option is restored afterwards, and torch's own reader still loads the items."""
    import zipfile

    if not hasattr(torch.serialization, "set_crc32_options"):
        pytest.skip("torch without set_crc32_options")
    ckpt = str(tmp_path / "ckpt")
    sd = {f"w{i}": torch.randn(16, 8) for i in range(4)}
    assert torch.serialization.get_crc32_options() is True
    dcp_save(sd, storage_writer=ChecksummedFileSystemWriter(ckpt, thread_count=2))  # torch's option is per thread
    assert torch.serialization.get_crc32_options() is True
    files = set()
    for fqn in sd:
        _, info = _item(ckpt, fqn)
        files.add(info.relative_path)
        with open(os.path.join(ckpt, info.relative_path), "rb") as f:
            f.seek(info.offset)
            archive = zipfile.ZipFile(__import__("io").BytesIO(f.read(info.length)))
        crcs = {i.filename.split("/", 1)[1]: i.CRC for i in archive.infolist()}
        assert crcs["data/0"] == 0 and crcs["data.pkl"] == 0, (fqn, crcs)
    assert len(files) == 2  # both writer threads' files
    out = {k: torch.zeros(16, 8) for k in sd}
    dcp_load(out, storage_reader=FileSystemReader(ckpt))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_writer_starts_writeback_as_it_writes(tmp_path, monkeypatch):
    """Every WRITEBACK_BYTES written, the file's new range is handed to the kernel's writeback
    (posix_fadvise DONTNEED), covering the data file without gaps; the checkpoint is intact."""
    calls = []
    monkeypatch.setattr(fs_mod, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(fs_mod, "_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    ckpt = str(tmp_path / "ckpt")
    sd = {f"w{i}": torch.randn(64, 64) for i in range(4)}  # 4 x 16 KiB items in one file: several writebacks
    dcp_save(sd, storage_writer=ChecksummedFileSystemWriter(ckpt, thread_count=1))
    assert len(calls) >= 3 and all(a == os.POSIX_FADV_DONTNEED for _, _, a in calls)
    assert [off for off, _, _ in calls] == [0] + [off + n for off, n, _ in calls[:-1]]  # contiguous ranges
    out = {k: torch.zeros(64, 64) for k in sd}
    dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.parametrize("fqn", ["w", "obj"])
def test_flipped_bytes_named(tmp_path, monkeypatch, fqn):
    from megatron.core.dist_checkpointing.strategies import item_checks

    monkeypatch.setattr(item_checks, "READ_CHUNK", 1000)  # several chunks per item
    ckpt = str(tmp_path / "ckpt")
    dcp_save(_state(), storage_writer=ChecksummedFileSystemWriter(ckpt))
    _, info = _item(ckpt, fqn)
    path = os.path.join(ckpt, info.relative_path)
    size = os.path.getsize(path)
    _flip(path, info.offset + info.length // 2)  # inside the item (tensor data / pickled object), size unchanged
    assert os.path.getsize(path) == size
    with pytest.raises(BaseException) as e:
        dcp_load(_empty_like(None), storage_reader=ChecksummedFileSystemReader(ckpt))
    msg = str(_inner(e.value))
    assert repr(fqn) in msg and path in msg, msg
    assert f"bytes [{info.offset}, {info.offset + info.length})" in msg and "fails its checksum" in msg


def test_flipped_bytes_silent_without_checksums(tmp_path):
    """Control: the same damage in a checkpoint without checksums loads wrong values without an error."""
    ckpt = str(tmp_path / "ckpt")
    sd = _state()
    dcp_save(sd, storage_writer=FileSystemWriter(ckpt))
    _, info = _item(ckpt, "w")
    _flip(os.path.join(ckpt, info.relative_path), info.offset + info.length // 2)
    out = _empty_like(sd)
    dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    assert not torch.equal(out["w"], sd["w"])


def test_old_checkpoint_loads_said_once(tmp_path, caplog):
    ckpt = str(tmp_path / "old")
    sd = _state()
    dcp_save(sd, storage_writer=FileSystemWriter(ckpt))
    with caplog.at_level(logging.WARNING, logger=fs_mod.__name__):
        for _ in range(2):
            out = _empty_like(sd)
            dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
            assert torch.equal(out["w"], sd["w"]) and out["obj"] == sd["obj"]
    said = [r for r in caplog.records if "no item checksums" in r.getMessage()]
    assert len(said) == 1 and ckpt in said[0].getMessage()


def test_unknown_algorithm_loads_unverified(tmp_path, monkeypatch, caplog):
    ckpt = str(tmp_path / "ckpt")
    sd = _state()
    dcp_save(sd, storage_writer=ChecksummedFileSystemWriter(ckpt, algorithm="crc32"))
    monkeypatch.setattr(fs_mod, "ALGORITHMS", {})
    with caplog.at_level(logging.WARNING, logger=fs_mod.__name__):
        out = _empty_like(sd)
        dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    assert torch.equal(out["w"], sd["w"])
    assert any("'crc32'" in r.getMessage() and "unverified" in r.getMessage() for r in caplog.records)


def test_writer_rejects_unknown_algorithm(tmp_path):
    with pytest.raises(CheckpointingException, match="'sha7' is not available"):
        ChecksummedFileSystemWriter(str(tmp_path), algorithm="sha7")


# ---- code in the checkpoint -------------------------------------------------------------------------------------
def test_planted_metadata_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dcp_save(_state(), storage_writer=ChecksummedFileSystemWriter(ckpt))
    meta = os.path.join(ckpt, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)
    marker = tmp_path / "ran"
    md.planner_data = {"evil": Payload(marker)}
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    FileSystemReader(ckpt).read_metadata()  # control: torch's reader runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointingException) as e:
        read_dcp_metadata_file(meta)
    assert meta in str(e.value) and "open" in str(e.value) and "nothing from it was run" in str(e.value)
    with pytest.raises(BaseException) as e:
        dcp_load(_empty_like(None), storage_reader=ChecksummedFileSystemReader(ckpt))
    assert meta in str(e.value)
    assert not marker.exists()


def test_metadata_not_metadata_refused(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointingException, match=r"holds a dict, not"):
        read_dcp_metadata_file(path)
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointingException, match=r"\.metadata"):
        read_dcp_metadata_file(path)


def test_planted_object_item_refused(tmp_path):
    """A bytes item holding a payload: DCP's DefaultLoadPlanner would ``torch.load(weights_only=False)`` it."""
    marker = tmp_path / "ran"
    ckpt = str(tmp_path / "ckpt")
    planted = {"w": torch.ones(4), "rng_state/shard_0_1": Payload(marker)}  # DCP torch.saves the object
    dcp_save(planted, storage_writer=ChecksummedFileSystemWriter(ckpt))
    assert not marker.exists()
    dcp_load({"w": torch.zeros(4), "rng_state/shard_0_1": None}, storage_reader=FileSystemReader(ckpt))
    assert marker.exists()  # control: torch's reader + DefaultLoadPlanner run it
    marker.unlink()
    _, info = _item(ckpt, "rng_state/shard_0_1")
    with pytest.raises(BaseException) as e:
        dcp_load({"w": torch.zeros(4), "rng_state/shard_0_1": None}, storage_reader=ChecksummedFileSystemReader(ckpt))
    msg = str(_inner(e.value))
    assert "'rng_state/shard_0_1'" in msg and os.path.join(ckpt, info.relative_path) in msg
    assert "refused to load" in msg and "open" in msg
    assert not marker.exists()


# ---- real checkpoints -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_upstream_fixture_metadata(name):
    meta = os.path.join(FIXTURES, name, "ckpt", ".metadata")
    with open(meta, "rb") as f:
        plain = pickle.load(f)
    md = read_dcp_metadata_file(meta)
    assert md.state_dict_metadata == plain.state_dict_metadata
    assert md.storage_data == plain.storage_data and len(md.storage_data) > 3


def test_upstream_fixture_loads(tmp_path, caplog):
    ckpt = str(tmp_path / "api_stacked")
    shutil.copytree(os.path.join(FIXTURES, "api_stacked", "ckpt"), ckpt)
    expected = torch.load(os.path.join(FIXTURES, "api_stacked", "expected.pt"), weights_only=True)
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in expected.items()}
    with caplog.at_level(logging.WARNING, logger=fs_mod.__name__):
        dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    for k, v in expected.items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, k
    assert any("no item checksums" in r.getMessage() for r in caplog.records)


def _mcore_ckpt_body(rank, world, ckpt):
    """Our own torch_dist writer (N-D flattened tensor -> mcore_data, a ShardedObject) on 2 ranks; its .metadata
    reads through the restricted reader and the checkpoint loads through the checksummed reader."""
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    local = full.chunk(world)[rank].clone()
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
        "f": [  # the local (4, 6) shard as two flat pieces
            ShardedTensor.from_rank_offsets_flat("f", local.flatten()[a:b].clone(), local.shape, (0, rank, world),
                                                 flattened_range=slice(a, b))
            for a, b in ((0, 10), (10, 24))
        ],
        "o": ShardedObject("misc.obj", {"it": 7}, (1,), (0,), replica_id=rank),
    }
    dist_checkpointing.save(sd, ckpt)
    md = read_dcp_metadata_file(os.path.join(ckpt, ".metadata"))
    assert getattr(md, "mcore_data", None), "our writer records mcore_data for the N-D flattened tensor"
    assert md.state_dict_metadata.keys() >= {"w", "f", "misc.obj/shard_0_1"}
    out = {"w": torch.zeros(8, 6)}
    dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    assert torch.equal(out["w"], full)
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, rank, world))},
                                     ckpt)
    assert torch.equal(loaded["w"], local)


def test_our_torch_dist_checkpoint_2_ranks(tmp_path):
    os.makedirs(tmp_path / "ckpt")
    run_distributed(_mcore_ckpt_body, 2, str(tmp_path / "ckpt"))


def _flip_2_ranks_body(rank, world, ckpt):
    sd = {f"t{r}": torch.full((1000,), float(r)) for r in range(world)}
    sd["shared"] = torch.arange(10.0)
    dcp_save(sd, storage_writer=ChecksummedFileSystemWriter(ckpt))
    dist.barrier()
    if rank == 0:
        _, info = _item(ckpt, "t1")
        _flip(os.path.join(ckpt, info.relative_path), info.offset + info.length - 100)
    dist.barrier()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(BaseException) as e:
        dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt))
    msg = str(_inner(e.value))
    assert "'t1'" in msg and "fails its checksum" in msg and ".distcp" in msg


def test_flipped_bytes_2_ranks(tmp_path):
    run_distributed(_flip_2_ranks_body, 2, str(tmp_path / "ckpt"))


def test_long_save_and_load_print_progress(tmp_path, monkeypatch, capsys):
    """A save or load that runs longer than PROGRESS_INTERVAL_S prints bytes done of the planned bytes on rank 0
    (here the interval is 0+: every write or item after the first prints); a short one prints nothing."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem

    monkeypatch.setattr(filesystem, "PROGRESS_INTERVAL_S", 1e-9)
    d = str(tmp_path / "ck")
    os.makedirs(d)
    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.ones(256, 256)) for i in range(4)}
    dist_checkpointing.save(sd, d)
    out = capsys.readouterr().out
    assert f"saving {d}:" in out and "of 1.0 MB on rank 0" in out and "(100%)" in out, out
    dist_checkpointing.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(256, 256)) for k in sd}, d)
    out = capsys.readouterr().out
    assert f"loading {d}:" in out and "(100%)" in out, out
    monkeypatch.setattr(filesystem, "PROGRESS_INTERVAL_S", 3600.0)
    dist_checkpointing.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(256, 256)) for k in sd}, d)
    assert "loading" not in capsys.readouterr().out
