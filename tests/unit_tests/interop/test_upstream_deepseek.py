"""A DeepSeek-V3-shaped model interchanges with the REAL upstream megatron-core 0.19.2 (CPU, gloo, 4 ranks): multi-
latent attention (q-LoRA, kv-LoRA, YaRN) + multi-token prediction + MoE with shared experts and a sigmoid router with
expert bias + first layer dense, saved by upstream and loaded here, and saved here and loaded by upstream, at TP1 x
DP4 and TP2 + SP + EP2 (and TP2 + SP + EP2 -> TP1): the same checkpoint keys; after the load the logits and the MTP
block's output (decoder hidden states and the depth's) within 1e-5 of the saver's (far apart before), every expert
bias as the saver set it. Three launches: upstream saves -> the fork loads and saves -> upstream loads."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit_tests.interop import roundtrip_cases as rc
from tests.unit_tests.interop.test_upstream_mtp import upstream_site  # noqa: F401 (the fixture)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
WORLD = 4


def _launch(side: str, phases: str, workdir: Path, pythonpath: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, str(HERE)]), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           str(HERE / "deepseek_worker.py"), side, phases, str(workdir)]
    done = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=600)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        pytest.fail(f"{side} {phases} exited {done.returncode}:\n{tail}")


def test_deepseek_v3_shaped_round_trip_with_upstream_tp1_and_tp2_sp_ep2(upstream_site, tmp_path):  # noqa: F811
    for side, phases, path in (("upstream", "save", str(upstream_site)), ("fork", "load,save", str(REPO)),
                               ("upstream", "load", str(upstream_site))):
        _launch(side, phases, tmp_path, path)
    for layout in ("tp1", "tp2_sp_ep2"):
        keys = {side: set(json.loads((tmp_path / f"keys_{side}_{layout}.json").read_text()))
                for side in ("upstream", "fork")}
        for k in ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
                  "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight",
                  "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight",
                  "decoder.layers.0.self_attention.linear_q_up_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                  "decoder.layers.1.mlp.router.expert_bias"):
            assert k in keys["upstream"], (layout, k, sorted(keys["upstream"]))
        # the fork's decoder final norm always carries upstream's TE-norm _extra_state key (see TransformerBlock);
        # upstream without TE has none: every other key is the same
        extra = {"decoder.final_layernorm._extra_state"}
        assert keys["fork"] - extra == keys["upstream"] - extra, sorted(keys["fork"] ^ keys["upstream"])
        for side in ("fork", "upstream"):
            results = json.loads((tmp_path / f"deepseek_{side}_{layout}.json").read_text())
            assert sorted(results) == sorted({"tp1": ["tp1", "tp2_sp_ep2"]}.get(layout, [layout]))
            for src, r in results.items():
                assert r["mtp_shape"] == [2 * rc.SEQ, rc.BATCH, 64], r
                assert all(v > 1e-2 for v in r["before"].values()), (side, layout, src, r)
                assert all(v <= rc.TOLERANCE for v in r["after"].values()), (side, layout, src, r)
                assert r["expert_bias"] == [rc.EXPERT_BIAS, rc.EXPERT_BIAS], r  # decoder layer 2 and the MTP depth
