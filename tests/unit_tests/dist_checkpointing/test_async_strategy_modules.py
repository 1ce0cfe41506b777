"""Upstream's async-strategy selection (get_async_strategy), filesystem_async names, NVRx detection and
safe_numpy_load(allow_pickle=True)."""
import inspect
import os
import sys
from unittest import mock

import numpy as np
import pickle
import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from megatron.core import safe_globals
from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async, nvrx
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.filesystem import ChecksummedFileSystemWriter
from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

NVRX_MODULES = [f"nvidia_resiliency_ext.checkpointing.async_ckpt.{m}" for m in
                ("core", "cached_metadata_filesystem_reader", "filesystem_async", "state_dict_saver")]


def test_mcore_strategy_modules():
    assert inspect.signature(get_async_strategy).parameters["async_strategy"].default == "nvrx"
    strategy, modules = get_async_strategy("mcore")
    assert strategy == "mcore"
    assert modules["FileSystemWriterAsync"] is filesystem_async.FileSystemWriterAsync
    assert modules["CachedMetadataFileSystemReader"] is CachedMetadataFileSystemReader
    assert modules["AsyncRequest"] is async_utils.AsyncRequest
    assert modules["get_write_results_queue"] is filesystem_async.get_write_results_queue
    assert get_async_strategy("mcore", module="AsyncCallsQueue") == ("mcore", async_utils.AsyncCallsQueue)
    with pytest.raises(KeyError, match="has no 'save_state_dict_async_plan'"):
        get_async_strategy("mcore", module="save_state_dict_async_plan")
    with pytest.raises(TypeError, match=r"^async_strategy x is not supported. Available strategies: nvrx, mcore.$"):
        get_async_strategy("x")


def test_nvrx_strategy_without_nvrx():
    with mock.patch.dict(sys.modules, {name: None for name in NVRX_MODULES}):
        with pytest.raises(ModuleNotFoundError, match=r"^A compatible `nvidia-resiliency-ext` installation is "
                                                      r"required for `async_strategy=\"nvrx\"`"):
            get_async_strategy()


def test_has_nvrx_async_support():
    fake = {name: mock.MagicMock() for name in NVRX_MODULES}
    with mock.patch.object(nvrx, "import_module", side_effect=lambda name: fake[name]):
        with mock.patch.object(nvrx, "is_nvrx_min_version", return_value=True):
            assert nvrx.has_nvrx_async_support() is True
        with mock.patch.object(nvrx, "is_nvrx_min_version", return_value=False):
            with pytest.raises(AssertionError, match="^Minimum required nvidia-resiliency-ext package version is "
                                                     "0.6.0.$"):
                nvrx.has_nvrx_async_support()
    fake[NVRX_MODULES[3]] = mock.MagicMock(spec=["CheckpointMetadataCache"])  # an NVRx without the saver functions
    with mock.patch.object(nvrx, "import_module", side_effect=lambda name: fake[name]):
        with mock.patch.object(nvrx, "is_nvrx_min_version", return_value=True):
            assert nvrx.has_nvrx_async_support() is False
    with mock.patch.dict(sys.modules, {name: None for name in NVRX_MODULES}):
        assert nvrx.has_nvrx_async_support() is False


def test_file_system_writer_async(tmp_path):
    writer = filesystem_async.FileSystemWriterAsync(tmp_path, thread_count=1)
    assert isinstance(writer, ChecksummedFileSystemWriter) and isinstance(writer, FileSystemWriter)
    assert writer.checkpoint_dir == tmp_path and writer.separation_hint is None and writer.use_msc is False
    torch.distributed.checkpoint.save({"w": torch.arange(6.0)}, storage_writer=writer, no_dist=True)
    out = {"w": torch.zeros(6)}
    torch.distributed.checkpoint.load(out, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(out["w"], torch.arange(6.0))
    assert filesystem_async.DEFAULT_SUFFIX == ".distcp"
    assert any(name.endswith(".distcp") for name in os.listdir(tmp_path))
    assert filesystem_async.FileSystemWriterAsync(tmp_path, separation_hint="opt").separation_hint == "opt"
    with pytest.raises(CheckpointingException, match="use_msc=True .* is not supported by this fork"):
        filesystem_async.FileSystemWriterAsync(tmp_path, use_msc=True)


def test_get_write_results_queue_is_made_once():
    with mock.patch.object(filesystem_async, "_results_queue", None):
        queue = filesystem_async.get_write_results_queue("spawn")
        assert filesystem_async.get_write_results_queue() is queue
        queue.put((0, []))
        assert queue.get(timeout=10) == (0, [])


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_safe_numpy_load_allow_pickle(tmp_path):
    plain = tmp_path / "a.npy"
    np.save(plain, np.array([1, 2, 3], dtype=np.uint32))
    got = safe_globals.safe_numpy_load(str(plain), allow_pickle=True)
    assert got.dtype == np.uint32 and got.tolist() == [1, 2, 3]
    objects = tmp_path / "o.npy"
    np.save(objects, np.asfortranarray(np.array([[{"x": 1}, "a"], [[2, 3], None]], dtype=object)), allow_pickle=True)
    got = safe_globals.safe_numpy_load(objects, allow_pickle=True)
    assert got.shape == (2, 2) and got[0, 0] == {"x": 1} and got[1, 0] == [2, 3] and got[1, 1] is None
    with open(objects, "rb") as f:  # an open file works too, and stays open
        assert safe_globals.safe_numpy_load(f, allow_pickle=True)[0, 1] == "a"
        assert not f.closed
    evil = tmp_path / "e.npy"
    np.save(evil, np.array([_Evil()], dtype=object), allow_pickle=True)
    with pytest.raises(pickle.UnpicklingError, match=r"^Refusing to unpickle disallowed class '(posix|nt)\.system'"):
        safe_globals.safe_numpy_load(evil, allow_pickle=True)
    archive = tmp_path / "z.npz"
    np.savez(archive, a=np.arange(3))
    assert safe_globals.safe_numpy_load(archive, allow_pickle=True)["a"].tolist() == [0, 1, 2]


def test_fully_parallel_save_wrapper_backend_and_version():
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    params = list(inspect.signature(FullyParallelSaveStrategyWrapper.__init__).parameters)
    assert params == ["self", "strategy", "parallelization_group", "do_cache_distribution", "backend", "version"]
    wrapper = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), None, False)
    assert (wrapper.backend, wrapper.version) == ("torch_dist", 1)
    assert (FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), None, False, "torch_dist", 2).version
            == 2)


def test_is_float8tensor():
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.extensions import transformer_engine as te_ext

    assert exchange_utils.HAVE_TE_FLOAT8TENSOR is (te_ext.Float8Tensor is not None)
    assert exchange_utils.is_float8tensor(torch.ones(2)) is False
    if te_ext.Float8Tensor is not None:  # pragma: no cover (GPU machines with TE)
        fake = mock.MagicMock(spec=te_ext.Float8Tensor)
        assert exchange_utils.is_float8tensor(fake) is True
