"""The rerun state machine's checkpointed state (upstream 0.19's ``megatron.core.rerun_state_machine``): its layout,
a round trip through a torch_dist checkpoint on 2 gloo ranks, and a state pickled by the real upstream package loading
here with ``weights_only=True``."""
import os
import subprocess
import sys

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core import rerun_state_machine as rsm
from megatron.core.dist_checkpointing import ShardedObject
from tests.unit_tests.dist_utils import run_distributed


@pytest.fixture(autouse=True)
def _fresh_machine():
    rsm.destroy_rerun_state_machine()
    yield
    rsm.destroy_rerun_state_machine()


def test_disabled_or_other_format_saves_nothing():
    m = rsm.get_rerun_state_machine()
    assert m.get_mode() is rsm.RerunMode.DISABLED and m.state is rsm.RerunState.NOT_RUNNING_YET
    assert m.state_dict(None, "torch_dist") is None
    m.set_mode(rsm.RerunMode.VALIDATE_RESULTS)
    assert m.state_dict(None, "torch") is None
    sd = m.state_dict(None, "torch_dist")
    assert set(sd) == {"mode", "state", "current_iteration", "sharded"}
    sh = sd["sharded"]
    assert isinstance(sh, ShardedObject) and sh.key == "rerun_state_machine_state"
    assert sh.global_shape == (1,) and sh.global_offset == (0,)
    assert sh.data["data_iterator_checkpoints"] is None and sh.data["error_injector_checkpoint"] == {
        "error_injection_rate": 0, "error_injection_type": rsm.RerunDiagnostic.TRANSIENT_ERROR,
        "injected_error_type": None}
    assert not m.validate_state_dict(sd)
    with pytest.raises(RuntimeError, match="already initialized"):
        rsm.initialize_rerun_state_machine()


def _roundtrip_body(rank, world, tmp_path):
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    m = rsm.get_rerun_state_machine()
    m.state, m.current_iteration = rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT, 41
    m.suspicious_node, m.suspicious_device, m.max_values = f"node{rank}", rank, {"loss": 1.5 + rank}
    it = rsm.RerunDataIterator(iter([{"x": 1}, {"x": 2}, {"x": 3}]))
    assert next(it) == {"x": 1} and next(it) == {"x": 2}
    sd = m.state_dict(it, "torch_dist")
    assert sd["sharded"].global_shape == (world,) and sd["sharded"].global_offset == (rank,)
    d = str(tmp_path / "ckpt")
    os.makedirs(d, exist_ok=True)
    dist_checkpointing.save({"rerun_state_machine": sd}, d)

    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    fresh = rsm.get_rerun_state_machine()
    loaded = dist_checkpointing.load({"rerun_state_machine": fresh.state_dict(None, "torch_dist", force=True)}, d)
    state = loaded["rerun_state_machine"]
    assert fresh.validate_state_dict(state)
    fresh.load_state_dict(state)
    assert fresh.state is rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT and fresh.current_iteration == 41
    assert fresh.suspicious_node == f"node{rank}" and fresh.suspicious_device == rank  # each rank its own
    assert fresh.max_values == {"loss": 1.5 + rank}
    assert fresh.data_iterator_checkpoints == [
        {"saved_microbatches": [{"x": 1}, {"x": 2}], "replaying": False, "replay_pos": 0}]
    it2 = rsm.RerunDataIterator(iter([]))
    it2.load_state_dict(fresh.data_iterator_checkpoints[0])
    it2.rewind()
    assert next(it2) == {"x": 1} and next(it2) == {"x": 2}
    # a disabled machine ignores a checkpointed state
    rsm.destroy_rerun_state_machine()
    off = rsm.get_rerun_state_machine()
    off.load_state_dict(state)
    assert off.state is rsm.RerunState.NOT_RUNNING_YET and off.current_iteration == -1


def test_roundtrip_through_torch_dist_checkpoint(tmp_path):
    run_distributed(_roundtrip_body, 2, tmp_path)


_UPSTREAM = r"""
import sys, torch
import torch.distributed as dist
dist.get_world_size = lambda group=None: 2
dist.get_rank = lambda group=None: 1
from megatron.core.rerun_state_machine import (RerunDiagnostic, RerunErrorInjector, RerunMode, RerunState,
                                               initialize_rerun_state_machine, get_rerun_state_machine)
initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS,
                               error_injector=RerunErrorInjector(5, RerunDiagnostic.PERSISTENT_ERROR))
m = get_rerun_state_machine()
m.state, m.current_iteration, m.suspicious_node, m.large_value_counts = (
    RerunState.WILL_RERUN_FROM_CHECKPOINT, 9, "n7", {"grad": 2})
sd = m.state_dict(None, "torch_dist")
sh = sd["sharded"]
assert (sh.key, sh.global_shape, sh.global_offset) == ("rerun_state_machine_state", (2,), (1,)), sh
sd["sharded"] = sh.data
torch.save(sd, sys.argv[1])
"""


def test_upstream_pickled_state_loads(tmp_path):
    from tests.unit_tests.interop.upstream_env import EAGER_COMPILE, upstream_site_or_skip

    site = upstream_site_or_skip()
    path = tmp_path / "rsm.pt"
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", EAGER_COMPILE + _UPSTREAM, str(path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import megatron.core  # noqa: F401  (registers the safe globals, upstream's enums among them)

    state = torch.load(path, weights_only=True)
    assert state["mode"] is rsm.RerunMode.VALIDATE_RESULTS and state["state"] is rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    m = rsm.get_rerun_state_machine()
    m.load_state_dict(state)
    assert m.current_iteration == 9 and m.suspicious_node == "n7" and m.large_value_counts == {"grad": 2}
    assert m.error_injector.error_injection_rate == 5 and m.error_injector.should_inject_errors
    assert m.error_injector.error_injection_type is rsm.RerunDiagnostic.PERSISTENT_ERROR
