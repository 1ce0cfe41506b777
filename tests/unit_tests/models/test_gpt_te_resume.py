"""Exact resume of FP8 training with real Transformer Engine layers (GPU with TE; ``@pytest.mark.gpu``).

For each case: ``pretrain_gpt.py`` (torchrun, 1 GPU, NCCL) trains ``ITERS`` iterations with TE layers, FP8 (delayed
or tensorwise), ``--fp8-param-gather`` (FP8 weights) and a save at ``SAVE_AT``; then it resumes from that
checkpoint twice, with and without ``--stream-ckpt-dequant``. Asserted against the uninterrupted run:

- the losses of every iteration after the resume (exactly);
- delayed scaling: the amax history and scale of every TE layer right after the load and after every later
  iteration (exactly), so no unsafe pickle opt-in was needed (``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE`` is removed
  from the environment) and the FP8 state continued where it stopped;
- MoE case: every router's ``expert_bias`` finite and equal.

This file is also the per-process entry point (``python -m torch.distributed.run ... test_gpt_te_resume.py OUT
ARGS...``): it runs ``pretrain`` and writes what it recorded to OUT.
"""
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ITERS, SAVE_AT = 8, 4
BASE = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 512 --seq-length 128 "
        "--max-position-embeddings 128 --vocab-size 1024 --micro-batch-size 2 --global-batch-size 4 "
        "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 "
        "--seed 1234 --bf16 --transformer-impl transformer_engine --fp8-format hybrid --fp8-param-gather "
        "--fp8-amax-history-len 16 --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 "
        "--hidden-dropout 0 --attention-dropout 0 --ckpt-format torch_dist").split()
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-router-enable-expert-bias --use-megatron-fsdp "
       "--init-model-with-meta-device").split()
DIST_OPT = ("--num-experts 4 --moe-router-topk 2 --moe-router-enable-expert-bias --use-distributed-optimizer "
            "--init-model-with-meta-device").split()
CASES = {
    "delayed": ["--fp8-recipe", "delayed"],
    "tensorwise": ["--fp8-recipe", "tensorwise"],
    "delayed_moe_fsdp_meta": ["--fp8-recipe", "delayed"] + MOE,
    # the distributed optimizer (DDP) with FP8 weights: shards quantized into the weights, FP8 bytes gathered
    "delayed_moe_distopt_meta": ["--fp8-recipe", "delayed"] + DIST_OPT,
    "tensorwise_moe_distopt_meta": ["--fp8-recipe", "tensorwise"] + DIST_OPT,
}


# ---- per-process entry point ---------------------------------------------------------------------------------
def _fp8_state(model_chunks):
    """{module name: (scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd)} of every delayed-scaling TE layer."""
    out = {}
    for chunk in model_chunks:
        for name, m in chunk.named_modules():
            meta = getattr(m, "fp8_meta", None)
            if not isinstance(meta, dict) or "scaling_fwd" not in meta or not hasattr(meta["scaling_fwd"], "scale"):
                continue
            out[name] = tuple(getattr(meta[f"scaling_{d}"], a).detach().cpu().clone()
                              for d in ("fwd", "bwd") for a in ("scale", "amax_history"))
    return out


def _expert_bias(model_chunks):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.expert_bias.detach().cpu().clone() for c in model_chunks for m in c.modules() if isinstance(m, TopKRouter)]


def _main(out_path, argv):
    sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.training import training

    record = {"fp8": {}, "expert_bias": {}, "fp8_after_load": None}
    real_load = training.load_checkpoint

    def load_and_record(model, *args, **kwargs):
        ret = real_load(model, *args, **kwargs)
        record["fp8_after_load"] = _fp8_state(model if isinstance(model, list) else [model])
        return ret

    training.load_checkpoint = load_and_record

    def on_iteration_end(iteration, model, loss):
        record["fp8"][iteration] = _fp8_state(model)
        record["expert_bias"][iteration] = _expert_bias(model)

    res = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, None,
                            pretrain_gpt.forward_step, args=argv, on_iteration_end=on_iteration_end)
    record["losses"] = dict(res.losses)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(record, out_path)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])


# ---- the tests -----------------------------------------------------------------------------------------------
def _have_te():
    from megatron.core.tensor_parallel.te_layers import HAVE_TE

    return HAVE_TE


pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not _have_te(), reason="needs Transformer Engine")]


def _torchrun(out, argv, log, nproc=1):
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.pop("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", None)  # the resume must not need the unsafe opt-in
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.abspath(__file__), str(out)] + [str(a) for a in argv]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- output tail ---\n{(proc.stdout + proc.stderr)[-6000:]}"
    return torch.load(out, weights_only=False)  # our own record, written just now


def _assert_fp8_equal(got, want, where):
    assert got.keys() == want.keys(), where
    for name in want:
        for i, (g, w) in enumerate(zip(got[name], want[name])):
            assert torch.equal(g, w), f"{where}: {name} item {i} differs"


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_resume_with_and_without_streaming_continues_exactly(case, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = BASE + CASES[case] + ["--train-iters", ITERS]
    full = _torchrun(tmp_path / "full.pt", args + ["--save", ckpt, "--save-interval", SAVE_AT], tmp_path / "full.log")
    assert sorted(full["losses"]) == list(range(1, ITERS + 1))
    delayed = "delayed" in case
    if delayed:
        assert full["fp8"][SAVE_AT], "no delayed-scaling TE layer recorded"
        assert any(h[1].abs().sum() > 0 for h in full["fp8"][SAVE_AT].values()), "amax history never filled"
    for mode in ("stream", "upfront"):
        extra = ["--load", ckpt, "--ckpt-step", SAVE_AT] + (["--stream-ckpt-dequant"] if mode == "stream" else [])
        res = _torchrun(tmp_path / f"{mode}.pt", args + extra, tmp_path / f"{mode}.log")
        after = list(range(SAVE_AT + 1, ITERS + 1))
        assert sorted(res["losses"]) == after, mode
        assert [res["losses"][i] for i in after] == [full["losses"][i] for i in after], (mode, res["losses"], full["losses"])
        if delayed:
            _assert_fp8_equal(res["fp8_after_load"], full["fp8"][SAVE_AT], f"{mode}: right after the load")
            for i in after:
                _assert_fp8_equal(res["fp8"][i], full["fp8"][i], f"{mode}: iteration {i}")
        for i in after:
            assert len(res["expert_bias"][i]) == len(full["expert_bias"][i]), mode
            for g, w in zip(res["expert_bias"][i], full["expert_bias"][i]):
                assert torch.isfinite(g).all() and torch.equal(g, w), (mode, i)


def test_fsdp_unit_groups_train_exactly_like_one_unit_per_layer(tmp_path):
    """``--suggested-communication-unit-size``: Megatron-FSDP with the four layers joined into one FSDP2 unit (the
    default on one data-parallel rank) trains exactly like one unit per layer (``1``), with meta-device init, FP8
    delayed scaling and ``--fp8-param-gather`` (TE's FSDP2 all-gather hooks on the quantized weights)."""
    args = BASE + ["--fp8-recipe", "delayed", "--use-megatron-fsdp", "--init-model-with-meta-device",
                   "--num-layers", "4", "--train-iters", 4]
    runs = {}
    for name, extra in (("grouped", []), ("per_layer", ["--suggested-communication-unit-size", "1"])):
        runs[name] = _torchrun(tmp_path / f"{name}.pt", args + extra, tmp_path / f"{name}.log")
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in runs}
    assert "Megatron-FSDP units (besides the root): 1: decoder.layers.0..3" in logs["grouped"], logs["grouped"][-3000:]
    assert "Megatron-FSDP units (besides the root): 4: decoder.layers.0, decoder.layers.1" in logs["per_layer"]
    want = runs["per_layer"]
    assert sorted(want["losses"]) == [1, 2, 3, 4]
    assert runs["grouped"]["losses"] == want["losses"]
    for i in want["fp8"]:
        _assert_fp8_equal(runs["grouped"]["fp8"][i], want["fp8"][i], f"iteration {i}")


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_distributed_optimizer_fp8_param_gather_trains_like_the_replicated_optimizer(recipe, tmp_path):
    """``--use-distributed-optimizer --fp8-param-gather`` (DDP) on one GPU: the weights stay TE FP8 tensors, each
    quantized whole from its fp32 main (one data-parallel rank owns every element: ``quantize_whole_masters``, the
    replicated optimizer's cast), so the losses equal the replicated optimizer's exactly. (On several ranks the
    shards go through TE's quantize_master_weights, via bf16 as upstream's: see the CPU tests.)"""
    args = BASE + ["--fp8-recipe", recipe, "--train-iters", 6]
    ref = _torchrun(tmp_path / "ref.pt", args, tmp_path / "ref.log")
    got = _torchrun(tmp_path / "distopt.pt", args + ["--use-distributed-optimizer"], tmp_path / "distopt.log")
    assert sorted(got["losses"]) == sorted(ref["losses"]) == list(range(1, 7))
    for i in range(1, 7):
        assert got["losses"][i] == ref["losses"][i], (i, got["losses"], ref["losses"])
    assert got["losses"][6] < got["losses"][1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_ep2_fp8_param_gather_resumes_exactly(tmp_path):
    """Megatron-FSDP x EP=2 on 2 GPUs with meta init, FP8 (delayed) weights gathered in FP8 (experts over the
    expert-data-parallel mesh of one rank, dense weights over both): trains (the loss falls), and a resume with
    --stream-ckpt-dequant continues exactly."""
    ckpt = tmp_path / "ckpt"
    args = BASE + ["--fp8-recipe", "delayed", "--train-iters", ITERS, "--expert-model-parallel-size", 2] + MOE
    full = _torchrun(tmp_path / "full.pt", args + ["--save", ckpt, "--save-interval", SAVE_AT], tmp_path / "full.log",
                     nproc=2)
    assert full["losses"][ITERS] < full["losses"][1]
    res = _torchrun(tmp_path / "res.pt", args + ["--load", ckpt, "--ckpt-step", SAVE_AT, "--stream-ckpt-dequant"],
                    tmp_path / "res.log", nproc=2)
    after = list(range(SAVE_AT + 1, ITERS + 1))
    assert [res["losses"][i] for i in after] == [full["losses"][i] for i in after]
