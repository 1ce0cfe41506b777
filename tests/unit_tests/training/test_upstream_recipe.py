"""Upstream megatron-core 0.19's training recipe (``upstream_recipe.py``: GPTModel from a layer spec, Float16Module
under bf16, DDP / DDP + distributed optimizer / the Megatron-FSDP adapter, ``get_megatron_optimizer``,
``get_forward_backward_func``, ``finalize_model_grads``, ``optimizer.step``) runs unchanged on the fork: on CPU (gloo,
2 ranks) its losses equal ``pretrain_gpt.py``'s for the same model and data (fp32, and bf16 with Float16Module),
and the real upstream package running the same script gives the same losses. GPU: the same with Transformer Engine layers, bf16 and FP8 weights
(``fp8_param=True``), next to ``pretrain_gpt.py --bf16 --fp8-format hybrid --fp8-param-gather``."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training import upstream_recipe as recipe

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WRAPPERS = ("ddp", "dist_opt", "fsdp")
FLAGS = {  # pretrain_gpt.py's flags for each wrapper of the recipe
    "ddp": [],
    "dist_opt": ["--use-distributed-optimizer"],
    "fsdp": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
             "--use-distributed-optimizer"],
}


def _pretrain_argv(wrapper: str, steps: int, extra=()):
    m = recipe.MODEL
    return [str(a) for a in [
        "--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"], "--num-attention-heads",
        m["num_attention_heads"], "--seq-length", recipe.SEQ, "--max-position-embeddings", recipe.SEQ,
        "--vocab-size", recipe.VOCAB, "--micro-batch-size", recipe.MBS, "--global-batch-size", recipe.GBS,
        "--lr", recipe.LR, "--min-lr", recipe.LR, "--lr-decay-style", "constant", "--weight-decay", 0.01,
        "--clip-grad", 1.0, "--seed", recipe.SEED, "--hidden-dropout", 0, "--attention-dropout", 0,
        "--train-iters", steps, "--log-interval", 1, "--eval-iters", 0, "--mock-data", *FLAGS[wrapper], *extra]]


def _recipe_dataset_provider(num_samples):
    """pretrain()'s dataset provider: the recipe's samples (the same data for both)."""
    return recipe.samples(num_samples[0]), None, None


def _pretrain_losses(wrapper: str, steps: int, extra=()):
    import pretrain_gpt
    from megatron.training.training import pretrain

    res = pretrain(_recipe_dataset_provider, pretrain_gpt.model_provider, None, pretrain_gpt.forward_step,
                   args=_pretrain_argv(wrapper, steps, extra))
    assert sorted(res.losses) == list(range(1, steps + 1))
    return [res.losses[i] for i in range(1, steps + 1)]


def _cpu_body(rank, world_size, steps):
    ours = {}
    for wrapper in WRAPPERS:
        reference = _pretrain_losses(wrapper, steps, ["--distributed-backend", "gloo", "--transformer-impl", "local"])
        got = recipe.run_recipe(wrapper, steps)["losses"]
        assert got == reference, (wrapper, got, reference)  # bitwise (python floats of the fp32 losses)
        ours[wrapper] = got
    assert ours["ddp"][-1] < ours["ddp"][0]  # it trains
    for wrapper in ("dist_opt", "fsdp"):  # the three wrappers: the same training in fp32
        assert ours[wrapper] == pytest.approx(ours["ddp"], rel=1e-6), (wrapper, ours)
    if rank == 0:
        with open(os.path.join(os.environ["RECIPE_OUT"], "ours.json"), "w") as f:
            json.dump(ours, f)


def test_upstream_recipe_cpu_matches_pretrain_gpt(tmp_path, monkeypatch):
    monkeypatch.setenv("RECIPE_OUT", str(tmp_path))
    run_distributed(_cpu_body, 2, 3, timeout=240)
    with open(tmp_path / "ours.json") as f:
        assert sorted(json.load(f)) == sorted(WRAPPERS)


def _run_upstream(site, wrapper, out, flags=(), nproc=2, timeout=300, env=None):
    """``upstream_recipe.py`` under ``torch.distributed.run`` with the real upstream first on ``PYTHONPATH``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), HERE, os.path.join(REPO, "tests", "unit_tests",
                                                                                      "interop")]),
               UPSTREAM_RECIPE_SHIMS="1" if "cuda" not in flags else "", OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(HERE, "upstream_recipe.py"), wrapper, str(out), *flags]
    done = subprocess.run(cmd, env=env, cwd=str(out.parent), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"upstream's recipe ({wrapper}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    with open(out) as f:
        return json.load(f)


def _bf16_body(rank, world_size, steps):
    for wrapper in ("ddp", "fsdp"):
        reference = _pretrain_losses(wrapper, steps, ["--distributed-backend", "gloo", "--transformer-impl", "local",
                                                      "--bf16"])
        got = recipe.run_recipe(wrapper, steps, bf16=True)["losses"]
        assert got == reference, (wrapper, got, reference)


def test_upstream_recipe_cpu_bf16_float16module_matches_pretrain_gpt():
    """bf16: the recipe's Float16Module-wrapped model (DDP with fp32 main params in the optimizer; Megatron-FSDP with
    fp32 sharded params and bf16 compute) trains bitwise as ``pretrain_gpt.py --bf16``."""
    run_distributed(_bf16_body, 2, 3, timeout=240)


# ---- the same script on the REAL upstream megatron-core 0.19.2 (CPU, gloo, 2 ranks) -----------------------------
def _save_init_body(rank, world_size, init_path, out_path):
    got = recipe.run_recipe("ddp", 3, save_init=init_path)["losses"]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(got, f)


def test_upstream_recipe_same_losses_on_real_upstream(tmp_path):
    """Upstream's package runs the recipe with DDP and with the distributed optimizer (its CPU shims:
    ``_shim_upstream_on_cpu``) from the fork's initial weights (the two draw them in different orders); the losses
    agree to fp32 rounding. (Upstream's Megatron-FSDP needs einops and CUDA streams: its run is the GPU test's.)"""
    from tests.unit_tests.interop.upstream_env import upstream_site_or_skip

    site = upstream_site_or_skip()
    init, ours_out = tmp_path / "init.pt", tmp_path / "ours.json"
    run_distributed(_save_init_body, 2, str(init), str(ours_out))
    with open(ours_out) as f:
        ours = json.load(f)
    upstream = _run_upstream(site, "ddp,dist_opt", tmp_path / "upstream.json", env={"RECIPE_LOAD_INIT": str(init)})
    for wrapper in ("ddp", "dist_opt"):
        got = upstream[wrapper]["losses"]
        assert got == pytest.approx(ours, rel=1e-6, abs=0), (wrapper, got, ours)
        assert got[0] == ours[0]  # the first forward, before any update: bitwise


# ---- GPU: Transformer Engine layers, bf16 (Float16Module) and FP8 weights (fp8_param=True) -------------------------
GPU_STEPS = 10
GPU_FLAGS = ["--bf16", "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--fp8-recipe",
             "delayed", "--fp8-param-gather"]


def _pretrain_main(out_path, wrapper, steps):
    """Entry point (``torch.distributed.run ... test_upstream_recipe.py pretrain OUT WRAPPER STEPS``): pretrain_gpt's
    losses for the recipe's model and data on the GPU, written to OUT by rank 0."""
    losses = _pretrain_losses(wrapper, steps, GPU_FLAGS)
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)


def _have_te():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE


def _gpu_torchrun(script_args, env, timeout=900):
    nproc = min(2, torch.cuda.device_count())
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script_args]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{(done.stdout + done.stderr)[-6000:]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _have_te(), reason="needs CUDA and Transformer Engine")
def test_upstream_recipe_gpu_te_fp8_param(tmp_path):
    """The recipe with TE layers, bf16 and FP8 weights (DDP, distributed optimizer, Megatron-FSDP; 1 or 2 GPUs, NCCL)
    next to ``pretrain_gpt.py --bf16 --fp8-format hybrid --fp8-param-gather`` for the same model and data: the losses
    agree (bf16 / FP8 rounding of two code paths), and the model trains. With upstream's package available
    (``MCORE_UPSTREAM_SITE`` or the cache), upstream runs the same script (DDP and distributed optimizer; its
    Megatron-FSDP too where einops is installed) from the fork's initial weights; tokens/s of both are printed
    (``-s``) for benchmarks/RESULTS.md."""
    recipe_py = os.path.join(HERE, "upstream_recipe.py")
    ours_out = tmp_path / "ours.json"
    _gpu_torchrun([recipe_py, ",".join(WRAPPERS), str(ours_out), "bf16", "fp8", "cuda"],
                  {"PYTHONPATH": REPO, "RECIPE_STEPS": str(GPU_STEPS)})
    with open(ours_out) as f:
        ours = json.load(f)
    for wrapper in WRAPPERS:
        ref_out = tmp_path / f"pretrain_{wrapper}.json"
        _gpu_torchrun([os.path.abspath(__file__), "pretrain", str(ref_out), wrapper, str(GPU_STEPS)],
                      {"PYTHONPATH": REPO})
        with open(ref_out) as f:
            reference = json.load(f)
        got = ours[wrapper]["losses"]
        assert all(map(torch.isfinite, torch.tensor(got))), (wrapper, got)
        assert got == pytest.approx(reference, rel=2e-2), (wrapper, got, reference)
        assert got[-1] < got[0], (wrapper, got)
        print(f"\nfork recipe {wrapper}: losses {got}, {ours[wrapper]['tokens_per_s']:.0f} tokens/s "
              f"(pretrain_gpt: {reference})")
    try:
        from tests.unit_tests.interop.upstream_env import ensure_upstream

        site = ensure_upstream()
    except Exception as e:  # no package index on the GPU machine and no MCORE_UPSTREAM_SITE
        pytest.skip(f"upstream megatron-core not available for the side-by-side run: {e}")
    init = tmp_path / "init.pt"
    _gpu_torchrun([recipe_py, "ddp", str(tmp_path / "ours_ddp.json"), "bf16", "fp8", "cuda"],
                  {"PYTHONPATH": REPO, "RECIPE_STEPS": "1", "RECIPE_SAVE_INIT": str(init)})
    import importlib.util

    upstream_wrappers = ["ddp", "dist_opt"] + (["fsdp"] if importlib.util.find_spec("einops") else [])
    up_out = tmp_path / "upstream.json"
    _gpu_torchrun([recipe_py, ",".join(upstream_wrappers), str(up_out), "bf16", "fp8", "cuda"],
                  {"PYTHONPATH": os.pathsep.join([str(site), HERE]), "RECIPE_STEPS": str(GPU_STEPS),
                   "RECIPE_LOAD_INIT": str(init)})
    with open(up_out) as f:
        upstream = json.load(f)
    for wrapper in upstream_wrappers:
        got = upstream[wrapper]["losses"]
        print(f"upstream recipe {wrapper}: losses {got}, {upstream[wrapper]['tokens_per_s']:.0f} tokens/s")
        assert got == pytest.approx(ours[wrapper]["losses"], rel=5e-2), (wrapper, got, ours[wrapper]["losses"])


# ---- entry point of the GPU test's pretrain_gpt runs ----------------------------------------------------------
if __name__ == "__main__" and sys.argv[1:2] == ["pretrain"]:
    sys.path.insert(0, REPO)
    _pretrain_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
