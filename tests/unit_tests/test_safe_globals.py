"""megatron.core.safe_globals: planted pickle payloads are refused (the marker file they would create stays absent,
the error names the file/key), the plain state our checkpoints hold round-trips."""
import argparse
import io
import os
import pickle
import random
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
from megatron.core.safe_globals import (
    SAFE_GLOBALS,
    SafeUnpickler,
    register_safe_globals,
    safe_load_from_bytes,
    safe_np_load,
    safe_pickle_load,
    safe_torch_load,
)


class Payload:
    """Unpickling this calls ``open(marker, "w")``: the marker file appears iff the payload ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class HiddenInStorage:
    """Unpickles as ``torch.storage._load_from_bytes(<torch.save of a Payload>)``: torch's function runs
    ``torch.load(weights_only=False)`` on those bytes (upstream's SafeUnpickler admitted it)."""

    def __init__(self, marker):
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        self.inner = buf.getvalue()

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.inner,))


@dataclass
class MyPlainConfig:
    width: int = 3


def _common_state():
    args = argparse.Namespace(num_layers=4, hidden_size=64, lr=1e-3, data_path=["a", "b"], params_dtype=torch.bfloat16)
    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": None,
    }
    return {
        "args": args,
        "iteration": 12,
        "checkpoint_version": 3.0,
        "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 12, "decay_style": "cosine"},
        "rng_state": [rng],
        "content_metadata": {"singleton_local_shards": False, "distrib_optim_sharding_type": "fully_sharded"},
    }


def test_payload_is_live(tmp_path):
    """Control: the payload does create its marker under a plain load (so the refusals below mean something)."""
    marker = tmp_path / "ran"
    f = tmp_path / "evil.pt"
    torch.save({"args": Payload(marker)}, f)
    torch.load(f, weights_only=False)
    assert marker.exists()


def test_common_state_round_trip(tmp_path):
    state = _common_state()
    TorchCommonSaveStrategy().save_common(state, tmp_path)
    out = safe_torch_load(tmp_path / "common.pt", what=str(tmp_path / "common.pt"))
    assert vars(out["args"]) == vars(state["args"])
    assert out["opt_param_scheduler"] == state["opt_param_scheduler"]
    assert out["content_metadata"] == state["content_metadata"]
    rng, rng0 = out["rng_state"][0], state["rng_state"][0]
    assert rng["random_rng_state"] == rng0["random_rng_state"]
    assert rng["np_rng_state"][0] == "MT19937"
    assert np.array_equal(rng["np_rng_state"][1], rng0["np_rng_state"][1])
    assert rng["np_rng_state"][2:] == rng0["np_rng_state"][2:]
    assert torch.equal(rng["torch_rng_state"], rng0["torch_rng_state"])
    np.random.set_state(rng["np_rng_state"])  # usable as saved


def test_common_state_payload_refused(tmp_path):
    marker = tmp_path / "ran"
    state = _common_state()
    state["args"].evil = Payload(marker)
    path = tmp_path / "common.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointingException) as e:
        safe_torch_load(path, what=str(path))
    msg = str(e.value)
    assert str(path) in msg and re.search(r"(builtins|io)\.open", msg) and "nothing from it was run" in msg
    assert not marker.exists()


def test_rng_state_object_payload_refused(tmp_path):
    """The RNG state is a ShardedObject: ``torch.save([state])`` bytes read back from a BytesIO."""
    marker = tmp_path / "ran"
    good = io.BytesIO()
    torch.save(_common_state()["rng_state"], good)
    good.seek(0)
    assert safe_torch_load(good, what="rng_state/shard_0.0_1.1")[0]["np_rng_state"][0] == "MT19937"
    bad = io.BytesIO()
    torch.save([{"np_rng_state": Payload(marker)}], bad)
    bad.seek(0)
    with pytest.raises(CheckpointingException, match=r"rng_state/shard_0\.0_1\.1: refused to load.*(builtins|io)\.open"):
        safe_torch_load(bad, what="rng_state/shard_0.0_1.1")
    assert not marker.exists()


def test_damaged_file_named(tmp_path):
    path = tmp_path / "common.pt"
    path.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointingException, match="common.pt: cannot be read"):
        safe_torch_load(path, what=str(path))


def test_register_extra_class(tmp_path):
    path = tmp_path / "cfg.pt"
    torch.save({"cfg": MyPlainConfig(7)}, path)
    with pytest.raises(CheckpointingException, match="MyPlainConfig"):
        safe_torch_load(path, what="cfg.pt")
    assert safe_torch_load(path, what="cfg.pt", extra=[MyPlainConfig])["cfg"].width == 7
    before = torch.serialization.get_safe_globals()
    try:
        register_safe_globals(extra=[MyPlainConfig])
        assert torch.load(path, weights_only=True)["cfg"].width == 7
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert argparse.Namespace in SAFE_GLOBALS


def test_safe_unpickler_tensors_and_containers():
    obj = {"t": torch.arange(6.0).view(2, 3), "p": torch.nn.Parameter(torch.ones(2)), "d": torch.bfloat16,
           "l": [1, 2.5, "x", b"y", (3,)], "s": torch.Size([4, 5])}
    out = safe_pickle_load(io.BytesIO(pickle.dumps(obj)), what="extra_state")
    assert torch.equal(out["t"], obj["t"]) and out["t"].shape == (2, 3)
    assert torch.equal(out["p"], obj["p"]) and out["d"] is torch.bfloat16
    assert out["l"] == obj["l"] and out["s"] == torch.Size([4, 5])
    assert safe_load_from_bytes(_torch_save_bytes(torch.ones(3))).sum().item() == 3.0


def _torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_safe_unpickler_refuses_payload(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(CheckpointingException, match=r"layer1\._extra_state.*(builtins|io)\.open.*nothing from it was run"):
        safe_pickle_load(io.BytesIO(pickle.dumps({"x": Payload(marker)})), what="layer1._extra_state")
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="os.system"):
        SafeUnpickler(io.BytesIO(b"cos\nsystem\n(S'true'\ntR."), what="raw").load()


def test_safe_unpickler_payload_inside_storage_bytes(tmp_path):
    """``torch.storage._load_from_bytes`` is replaced by ``safe_load_from_bytes``: a payload nested in it is refused."""
    marker = tmp_path / "ran"
    data = pickle.dumps(HiddenInStorage(marker))
    with pytest.raises(CheckpointingException, match="extra_state"):
        safe_pickle_load(io.BytesIO(data), what="extra_state")
    assert not marker.exists()
    pickle.loads(data)  # control: the plain unpickler runs it
    assert marker.exists()


def test_safe_np_load(tmp_path):
    good = tmp_path / "idx.npy"
    np.save(good, np.arange(5, dtype=np.int64))
    assert safe_np_load(good).tolist() == [0, 1, 2, 3, 4]
    bad = tmp_path / "obj.npy"
    np.save(bad, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointingException, match=r"obj\.npy: refused to load.*pickled"):
        safe_np_load(bad)
    with pytest.raises(CheckpointingException, match="allow_pickle"):
        safe_np_load(good, allow_pickle=True)
    with pytest.raises(CheckpointingException, match="missing.npy"):
        safe_np_load(tmp_path / "missing.npy")
