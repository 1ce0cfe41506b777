"""Upstream 0.19's async-strategy API, safe_globals names and exception type (issue 26)."""
import importlib.util
import inspect
import io
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing, safe_globals
from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor
from megatron.core.dist_checkpointing.strategies import async_utils, nvrx
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    get_async_strategy,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from tests.unit_tests.dist_utils import run_distributed


# ---- async strategy ------------------------------------------------------------------------------------------------
def test_async_signatures_are_upstreams():
    for fn in (TorchDistSaveShardedStrategy.async_save, FullyParallelSaveStrategyWrapper.async_save):
        assert list(inspect.signature(fn).parameters)[1:] == ["sharded_state_dict", "checkpoint_dir", "async_strategy"]
        assert inspect.signature(fn).parameters["async_strategy"].default == "nvrx"
    for fn in (TorchDistLoadShardedStrategy.load, FullyParallelLoadStrategyWrapper.load):
        assert inspect.signature(fn).parameters["async_strategy"].default == "mcore"
    params = inspect.signature(async_utils.AsyncCaller.is_current_async_call_done).parameters
    assert [(n, p.default is p.empty) for n, p in params.items()] == [("self", True), ("blocking", True),
                                                                       ("no_dist", True)]
    assert "__del__" in vars(async_utils.PersistentAsyncCaller)
    strategy, modules = get_async_strategy("mcore")
    assert strategy == "mcore" and modules["AsyncCallsQueue"] is async_utils.AsyncCallsQueue
    with pytest.raises(TypeError, match="async_strategy bogus is not supported"):
        get_async_strategy("bogus")


def test_nvrx_detection():
    installed = importlib.util.find_spec("nvidia_resiliency_ext") is not None
    assert nvrx.has_nvrx_async_support() is (installed and nvrx.is_nvrx_min_version())
    assert nvrx.NVRX_MIN_VERSION == "0.6.0"


def test_persistent_caller_del_stops_its_worker():
    caller = async_utils.PersistentAsyncCaller()
    caller.schedule_async_call(AsyncRequest(lambda: None, (), []))
    worker = caller.worker
    assert worker.is_alive()
    caller.__del__()
    worker.join(timeout=10)
    assert not worker.is_alive() and caller.worker is None


def _async_strategy_args(rank, world, tmp_path):
    d = os.path.join(str(tmp_path), "ckpt")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), float(rank)), (0, rank, world))}
    # upstream's positions: ..., content_metadata, async_strategy, verify_integrity
    request = dist_checkpointing.save(sd, d, None, True, True, None, None, "mcore", True)
    assert isinstance(request, AsyncRequest)
    queue = async_utils.AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert os.path.exists(os.path.join(d, "integrity.json"))  # verify_integrity, positionally
    dst = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, rank, world))}
    out = TorchDistLoadShardedStrategy().load(dst, d, "nvrx")
    assert torch.equal(out["w"], torch.full((2, 3), float(rank)))
    with pytest.raises(CheckpointingException, match=r"save: async_strategy must be 'nvrx' or 'mcore', got 'x'"):
        dist_checkpointing.save(sd, os.path.join(str(tmp_path), "never"), async_sharded_save=True, async_strategy="x")
    with pytest.raises(CheckpointingException, match=r"TorchDistLoadShardedStrategy.load: async_strategy"):
        TorchDistLoadShardedStrategy().load(dst, d, "x")
    # a missing key under ASSUME_OK_UNEXPECTED: catchable as torch's CheckpointException, as upstream raises
    missing = {"absent": ShardedTensor.from_rank_offsets("absent", torch.zeros(2, 3), (0, rank, world))}
    with pytest.raises(CheckpointException) as info:
        dist_checkpointing.load(missing, d, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    assert isinstance(info.value, CheckpointingException) and "absent" in str(info.value)


@pytest.mark.parametrize("world", [1, 2])
def test_async_strategy_arguments(tmp_path, world):
    run_distributed(_async_strategy_args, world, tmp_path)


# ---- exception type ------------------------------------------------------------------------------------------------
def test_checkpointing_exception_is_torchs_type_too():
    e = CheckpointingException("bad key 'x'", {0: (ValueError("v"), None)})
    assert isinstance(e, CheckpointException) and isinstance(e, Exception)
    assert str(e) == "bad key 'x'" and set(e.failures) == {0}
    back = pickle.loads(pickle.dumps(e))  # crosses process boundaries (async saves, test workers)
    assert type(back) is CheckpointingException and str(back) == "bad key 'x'" and set(back.failures) == {0}
    assert CheckpointingException("m").failures == {}


# ---- safe_globals ----------------------------------------------------------------------------------------------------
class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_safe_globals_upstream_names(tmp_path):
    with pytest.raises(pickle.UnpicklingError, match=r"^Refusing to unpickle disallowed class '(posix|nt)\.system'"):
        safe_globals._safe_pickle_load(io.BytesIO(pickle.dumps(_Evil())))
    assert safe_globals._safe_pickle_load(io.BytesIO(pickle.dumps({"a": [1, 2.0]}))) == {"a": [1, 2.0]}
    path = tmp_path / "a.npy"
    np.save(path, np.arange(5))
    assert np.array_equal(safe_globals.safe_numpy_load(path), np.arange(5))
    np.save(tmp_path / "o.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointingException, match="holds pickled Python objects"):
        safe_globals.safe_numpy_load(tmp_path / "o.npy")


def test_importing_megatron_core_registers_safe_globals(tmp_path):
    """In a fresh interpreter: ``import megatron.core`` alone lets torch.load(weights_only=True) read a checkpoint
    holding argparse.Namespace and upstream's AttnBackend (upstream registers them on import too)."""
    path = tmp_path / "args.pt"
    code = (
        "import argparse, sys, torch\n"
        "from megatron.core.transformer.enums import AttnBackend\n"
        f"torch.save({{'args': argparse.Namespace(lr=0.5, attention_backend=AttnBackend.flash)}}, {str(path)!r})\n"
        "import megatron.core\n"
        f"out = torch.load({str(path)!r}, weights_only=True)\n"
        "assert out['args'].lr == 0.5 and out['args'].attention_backend is AttnBackend.flash, out\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
