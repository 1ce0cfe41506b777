"""--ckpt-verify {auto,require,off} (issue 28, item 4): a checkpoint whose .metadata carries no item checksums, an
item without one, or a checksum of an algorithm this installation lacks is refused under "require", loads (said
once) under "auto", the default, and "off" verifies nothing; through pretrain_gpt on 2 ranks too."""
import logging
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save

from megatron.core import dist_utils
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies import filesystem as fs_mod
from megatron.core.dist_checkpointing.strategies.filesystem import (
    CHECKSUM_ATTR,
    ChecksummedFileSystemReader,
    ChecksummedFileSystemWriter,
    checksum_verification,
)
from tests.unit_tests.dist_checkpointing.test_integrity import _empty_like, _flip, _inner, _item, _state
from tests.unit_tests.dist_utils import run_distributed


def _strip_checksums(ckpt, fqns=None):
    """Rewrite ``.metadata`` without the checksums of ``fqns`` (all when None), as an upstream writer leaves it."""
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # the test's own checkpoint
    for index, info in md.storage_data.items():
        if (fqns is None or index.fqn in fqns) and hasattr(info, CHECKSUM_ATTR):
            delattr(info, CHECKSUM_ATTR)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _load(ckpt, verify=None):
    out = _empty_like(_state())
    try:
        dcp_load(out, storage_reader=ChecksummedFileSystemReader(ckpt, verify=verify))
    except BaseException as e:  # DCP wraps what the reader raised
        raise _inner(e) from e
    return out


def test_require_refuses_a_checkpoint_without_checksums(tmp_path, caplog):
    ckpt = str(tmp_path / "upstream")
    dcp_save(_state(), storage_writer=FileSystemWriter(ckpt))
    with pytest.raises(CheckpointingException, match=rf"--ckpt-verify require: checkpoint {ckpt}: 3 of 3 items have "
                                                     r"no checksum \(written by an older or upstream writer\), e\.g\. "
                                                     r"'\w+'; --ckpt-verify auto loads them unverified"):
        _load(ckpt, "require")
    with checksum_verification("require"):  # the process default (what --ckpt-verify sets for a training load)
        with pytest.raises(CheckpointingException, match="--ckpt-verify require: "):
            _load(ckpt)
    ours = lambda: [r.getMessage() for r in caplog.records if r.name == fs_mod.__name__]  # noqa: E731
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=fs_mod.__name__):
        assert torch.equal(_load(ckpt, "off")["w"], _state()["w"])
        assert ours() == []  # off: nothing said
        assert torch.equal(_load(ckpt)["w"], _state()["w"])  # auto (default): loads, said once
        assert len(ours()) == 1 and "no item checksums" in ours()[0]


def test_require_refuses_one_item_without_checksum(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dcp_save(_state(), storage_writer=ChecksummedFileSystemWriter(ckpt))
    assert torch.equal(_load(ckpt, "require")["w"], _state()["w"])  # every item has one: loads
    _strip_checksums(ckpt, {"h"})
    with pytest.raises(CheckpointingException, match=r"--ckpt-verify require: checkpoint \S+: 1 of 3 items have no "
                                                     r"checksum .* e\.g\. 'h' \(chunk at offset \(0,\)\);"):
        _load(ckpt, "require")
    assert torch.equal(_load(ckpt, "auto")["h"], _state()["h"])


def test_require_refuses_an_algorithm_not_installed(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    dcp_save(_state(), storage_writer=ChecksummedFileSystemWriter(ckpt, algorithm="crc32"))
    monkeypatch.setattr(fs_mod, "ALGORITHMS", {})
    monkeypatch.setattr(dist_utils, "_said_once", set())  # what auto says once here is not taken from other tests
    with pytest.raises(CheckpointingException, match=r"--ckpt-verify require: checkpoint item '\w+' .*in \S+\.distcp, "
                                                     r"bytes \[\d+, \d+\) has a 'crc32' checksum, which this "
                                                     r"installation cannot compute"):
        _load(ckpt, "require")
    assert torch.equal(_load(ckpt, "auto")["w"], _state()["w"])  # auto: unverified, said


def test_off_verifies_nothing_and_bad_mode_named(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dcp_save(_state(), storage_writer=ChecksummedFileSystemWriter(ckpt))
    _, info = _item(ckpt, "w")
    _flip(os.path.join(ckpt, info.relative_path), info.offset + info.length // 2)
    with pytest.raises(CheckpointingException, match="fails its checksum"):
        _load(ckpt, "auto")
    assert not torch.equal(_load(ckpt, "off")["w"], _state()["w"])  # read as stored, unverified
    with pytest.raises(CheckpointingException, match=r"--ckpt-verify\) must be one of \('auto', 'require', 'off'\), "
                                                     r"got 'always'"):
        ChecksummedFileSystemReader(ckpt, verify="always")


# ---- through training, 2 ranks ------------------------------------------------------------------------------------
def _training_body(rank, world_size, ckpt):
    import torch.distributed as dist

    from megatron.training.checkpointing import CheckpointError
    from tests.unit_tests.training.test_checkpoint_safety import TINY, _run

    _run(TINY + ["--train-iters", 1, "--save", ckpt])
    res = _run(TINY + ["--train-iters", 2, "--load", ckpt, "--ckpt-verify", "require"])  # ours: every item has one
    assert sorted(res.losses) == [2]
    dist.barrier()
    if rank == 0:
        _strip_checksums(os.path.join(ckpt, "iter_0000001"))
    dist.barrier()
    with pytest.raises((CheckpointError, CheckpointingException),
                       match=r"--ckpt-verify require: checkpoint \S+iter_0000001: \d+ of \d+ items have no checksum"):
        _run(TINY + ["--train-iters", 2, "--load", ckpt, "--ckpt-verify", "require"])
    res = _run(TINY + ["--train-iters", 2, "--load", ckpt])  # auto, the default: upstream's checkpoints load
    assert sorted(res.losses) == [2]


def test_ckpt_verify_flag_in_training(tmp_path):
    run_distributed(_training_body, 2, str(tmp_path / "ckpt"))
