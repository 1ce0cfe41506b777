"""Context parallelism against the REAL upstream megatron-core 0.19.2 (CPU, gloo, CP 2; ``cp_worker.py``). The MoE
router's load-balancing losses: the same probs and routing maps, and - with ``aux_loss`` or ``seq_aux_loss`` and the
z-loss, the aux-loss gradient scaled by the CP size as upstream's schedule does - the same input gradients on each
CP rank and the same router weight gradient averaged over the data x context ranks (within 1e-6), where the router
losses move that gradient by far more. Upstream reduces the expert counts over its tensor x context group, this fork
over the context group (its TP ranks route the same tokens): with TP 1 the same ranks. Multi-token prediction's
``roll_tensor`` with ``cp_group`` (token ids, a loss mask; rolled once and twice) gives upstream's tensors and sums."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.unit_tests.interop.test_upstream_mtp import upstream_site  # noqa: F401 (the fixture)

HERE = Path(__file__).resolve().parent


def _fork_side(rank, world_size, workdir: str) -> None:
    from tests.unit_tests.interop import cp_worker

    cp_worker.run("fork", workdir)


def test_router_losses_and_mtp_roll_under_context_parallelism_equal_upstream(upstream_site, tmp_path):  # noqa: F811
    from tests.unit_tests.dist_utils import run_distributed

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(upstream_site), str(HERE)]), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "cp_worker.py"), "upstream", str(tmp_path)]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"upstream exited {done.returncode}:\n" + "\n".join((done.stdout + done.stderr).splitlines()[-40:]))
    run_distributed(_fork_side, 2, str(tmp_path))
    for rank in (0, 1):
        got = {side: json.loads((tmp_path / f"cp_{side}_{rank}.json").read_text())
               for side in ("upstream", "fork")}
        assert sorted(got["fork"]) == sorted(got["upstream"]) == ["aux_loss", "none", "roll", "seq_aux_loss"]
        roll = got["upstream"].pop("roll")
        assert got["fork"].pop("roll") == roll  # exactly
        assert roll["ids"] != roll["ids_twice"] and roll["mask_sum"] > 0
        for case, want in got["upstream"].items():
            for key, value in want.items():
                np.testing.assert_allclose(got["fork"][case][key], value, rtol=0, atol=1e-6,
                                           err_msg=f"rank {rank} {case} {key}")
        without = np.array(got["upstream"]["none"]["weight_grad"])
        assert without.shape == (4, 16)
        for case in ("aux_loss", "seq_aux_loss"):  # the router losses matter here
            moved = np.abs(np.array(got["upstream"][case]["weight_grad"]) - without).max()
            assert moved > 1e-2, (case, moved)
