"""The DeepSeek-V3-shaped ``pretrain_gpt.py`` run of ``test_deepseek_v3_training.py`` on one GPU with Transformer
Engine layers and blockwise FP8 weights (``@pytest.mark.gpu``; Hopper or newer): multi-latent attention (q-LoRA,
kv-LoRA) with YaRN, a sigmoid router with expert bias, shared experts, grouped GEMM (TE ``GroupedLinear``),
multi-token prediction and the first layer dense, under ``--bf16 --fp8-format e4m3 --fp8-recipe blockwise
--fp8-param-gather`` with ``--init-model-with-meta-device``, once with Megatron-FSDP and once with the distributed
optimizer. Each trains ``ITERS`` iterations saving at ``SAVE_AT``, then resumes from that checkpoint with
``--stream-ckpt-dequant``: the resumed iterations' losses, logged MTP losses and every router's ``expert_bias`` equal
the uninterrupted run's exactly, and the expert bias is a real one from the first iteration on (never NaN/garbage
after the meta-device init).

The ranks run through ``tests/unit_tests/models/test_gpt_te_resume.py``'s torchrun entry point (``_torchrun``: one
process, NCCL, its record of losses and expert biases per iteration, the log kept)."""
import re

import pytest
import torch

from tests.unit_tests.models.test_gpt_te_resume import _torchrun

ITERS, SAVE_AT = 6, 3
# Every linear's dimensions a multiple of 64 (most of 128): blockwise FP8 quantizes weights in 128 x 128 blocks and
# activations in 1 x 128 blocks; 2 micro-batches x 128 tokens per GEMM.
BASE = ("--num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 2 --seq-length 128 "
        "--max-position-embeddings 128 --vocab-size 1024 --micro-batch-size 2 --global-batch-size 4 "
        "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 "
        "--seed 1234 --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 "
        "--hidden-dropout 0 --attention-dropout 0 --ckpt-format torch_dist "
        "--transformer-impl transformer_engine --bf16 --fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather "
        "--init-model-with-meta-device").split()
# MLA: q 256 -> 128 -> 2 x (64 + 64); kv 256 -> 128 + 64 (the shared RoPE key) -> 2 x (64 + 128); out 2 x 128 -> 256
MLA = ("--multi-latent-attention --q-lora-rank 128 --kv-lora-rank 128 --qk-head-dim 64 --qk-pos-emb-head-dim 64 "
       "--v-head-dim 128 --qk-layernorm --rope-type yarn --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 0.7 "
       "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
       "--untie-embeddings-and-output-weights").split()
MOE_MTP = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256", "--moe-layer-freq",
           "([0]*1+[1]*1)", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-shared-expert-intermediate-size", "256", "--moe-grouped-gemm", "--mtp-num-layers", "1",
           "--mtp-loss-scaling-factor", "0.3"]
DEEPSEEK_V3 = BASE + MLA + MOE_MTP
ENGINES = {"fsdp": ["--use-megatron-fsdp"], "distopt": ["--use-distributed-optimizer"]}


def _cuda_te_hopper():
    """None when this machine can run the test, else why not."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        return "needs Transformer Engine"
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability()[0] < 9:
        return f"blockwise FP8 needs Hopper or newer (compute capability 9.0), not {torch.cuda.get_device_capability()}"
    return None


def _logged_mtp_losses(log_text):
    """{iteration: the 'mtp_1 loss' printed in that iteration's log line}."""
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|[^\n]*? mtp_1 loss: (\S+) \|", log_text):
        out[int(m.group(1))] = float(m.group(2))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_deepseek_v3_blockwise_fp8_resumes_exactly(engine, tmp_path, monkeypatch):
    why = _cuda_te_hopper()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # deterministic attention backward: exact resume
    ckpt = tmp_path / "ckpt"
    args = DEEPSEEK_V3 + ENGINES[engine] + ["--train-iters", ITERS]
    full = _torchrun(tmp_path / "full.pt", args + ["--save", ckpt, "--save-interval", SAVE_AT], tmp_path / "full.log")
    res = _torchrun(tmp_path / "res.pt", args + ["--load", ckpt, "--ckpt-step", SAVE_AT, "--stream-ckpt-dequant"],
                    tmp_path / "res.log")
    assert sorted(full["losses"]) == list(range(1, ITERS + 1))
    after = list(range(SAVE_AT + 1, ITERS + 1))
    assert sorted(res["losses"]) == after
    curve = [full["losses"][i] for i in range(1, ITERS + 1)]
    assert all(torch.isfinite(torch.tensor(curve))) and len(set(curve)) > 1, curve  # it trains
    assert [res["losses"][i] for i in after] == curve[SAVE_AT:], (res["losses"], full["losses"])
    # the MTP loss is logged every iteration (a real cross entropy over 1024 tokens) and resumes exactly too
    full_mtp, res_mtp = (_logged_mtp_losses((tmp_path / f"{n}.log").read_text()) for n in ("full", "res"))
    assert sorted(full_mtp) == list(range(1, ITERS + 1)) and sorted(res_mtp) == after, (full_mtp, res_mtp)
    assert all(5.0 < v < 9.0 for v in full_mtp.values()), full_mtp
    assert [res_mtp[i] for i in after] == [full_mtp[i] for i in after]
    # expert biases: the MoE decoder layer's and the MTP layer's, real from the first iteration (the meta-device init
    # kept the zeros: one sign update of the default rate 1e-3), equal after the resume
    first = full["expert_bias"][1]
    assert len(first) == 2, len(first)
    for b in first:
        assert torch.isfinite(b).all() and float(b.abs().max()) <= 1e-3 + 1e-9 and float(b.abs().max()) > 0, b
    for i in after:
        assert len(res["expert_bias"][i]) == len(full["expert_bias"][i]) == 2
        for got, want in zip(res["expert_bias"][i], full["expert_bias"][i]):
            assert torch.isfinite(got).all() and torch.equal(got, want), (engine, i, got, want)


def test_gpu_flags_validate_on_cpu():
    """The GPU runs' flags pass the argument check (nothing refused) and reach the config; runs here, without a GPU."""
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    for engine, extra in ENGINES.items():
        args = validate_args(parse_args(args=DEEPSEEK_V3 + extra + ["--train-iters", str(ITERS)]))
        cfg = core_transformer_config_from_args(args)
        assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_param, cfg.mtp_num_layers) == ("e4m3", "blockwise", True, 1), engine
        assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_type, cfg.moe_layer_freq) == (128, 128, "yarn", [0, 1])
        assert cfg.moe_router_enable_expert_bias and cfg.moe_grouped_gemm and cfg.moe_shared_expert_intermediate_size
        assert args.stream_ckpt_dequant is False and args.init_model_with_meta_device
        assert args.use_megatron_fsdp == (engine == "fsdp") and args.use_distributed_optimizer
