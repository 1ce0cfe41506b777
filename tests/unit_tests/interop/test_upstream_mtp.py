"""Multi-token prediction interchanges with the REAL upstream megatron-core 0.19.2 (CPU, gloo, one process each;
the fork's in a rank forked from pytest):
a model with MTP + MoE with shared experts + expert bias + first layer dense, saved by upstream and loaded here, and
saved here and loaded by upstream; the same checkpoint keys, and the MTP block's output (decoder hidden states and
the depth's), the loss and the logits within 1e-5 after the load (far apart before), expert biases as set."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def upstream_site():
    from tests.unit_tests.interop.upstream_env import upstream_site_or_skip

    return upstream_site_or_skip()


def _launch(side: str, phase: str, workdir: Path, pythonpath: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, str(HERE)]), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(HERE / "mtp_worker.py"), side, phase, str(workdir)]
    done = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=600)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        pytest.fail(f"{side} {phase} exited {done.returncode}:\n{tail}")


def _fork_phases(rank, world_size, workdir: str) -> None:
    """The fork's load and save in one rank forked from this process (the fork imported already)."""
    from tests.unit_tests.interop import mtp_worker

    for phase in ("load", "save"):
        mtp_worker.run("fork", phase, workdir)


def test_mtp_shared_experts_expert_bias_round_trip_with_upstream(upstream_site, tmp_path):
    from tests.unit_tests.dist_utils import run_distributed
    from tests.unit_tests.interop import roundtrip_cases as rc

    _launch("upstream", "save", tmp_path, str(upstream_site))
    run_distributed(_fork_phases, 1, str(tmp_path))
    _launch("upstream", "load", tmp_path, str(upstream_site))
    keys = {side: json.loads((tmp_path / f"keys_{side}.json").read_text()) for side in ("upstream", "fork")}
    mtp_keys = [k for k in keys["upstream"] if k.startswith("mtp.")]
    assert "mtp.layers.0.eh_proj.weight" in mtp_keys and "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in \
        mtp_keys and any(".shared_experts." in k for k in mtp_keys), mtp_keys
    # the fork's decoder final norm always carries upstream's TE-norm _extra_state key (see TransformerBlock); the
    # upstream here runs without TE, whose local final norm has none: every other key is the same
    extra = {"decoder.final_layernorm._extra_state"}
    assert set(keys["fork"]) - extra == set(keys["upstream"]) - extra, sorted(set(keys["fork"]) ^ set(keys["upstream"]))
    for side in ("fork", "upstream"):
        result = json.loads((tmp_path / f"result_{side}.json").read_text())
        assert result["mtp_shape"] == [2 * rc.SEQ, rc.BATCH, 64]
        assert result["before"] > 0.1, result
        assert all(v <= rc.TOLERANCE for v in result["diffs"].values()), (side, result)
        assert result["expert_bias"] == [rc.EXPERT_BIAS, rc.EXPERT_BIAS], result  # decoder layer 2 and the MTP depth
