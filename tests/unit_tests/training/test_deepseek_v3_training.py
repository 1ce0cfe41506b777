"""A DeepSeek-V3-shaped ``pretrain_gpt.py`` run on CPU (gloo, 4 ranks, TP2 x EP2 with sequence parallelism): every
feature of that job at once - multi-latent attention (q-LoRA and kv-LoRA) with YaRN, a sigmoid router with expert
bias, shared experts, grouped GEMM experts, multi-token prediction, the first layer dense (``--moe-layer-freq``) -
trains, saves and resumes exactly (losses, MTP losses and every router's ``expert_bias`` equal to the uninterrupted
run's; the same losses at TP1 x EP1 from that checkpoint), with the distributed data-parallel wrapper and with Megatron-FSDP + meta-device init (whose ``expert_bias``
keeps its values: the same as the DDP run's)."""
import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_mla_training import MLA
from tests.unit_tests.training.test_mtp_training import MTP_MOE, _model_of
from tests.unit_tests.training.test_training import TINY, _run, _same_on_all_ranks

# MTP_MOE: --mtp-num-layers 1, 4 experts top-2 with expert bias, "([0]*1+[1]*1)" (first layer dense), no dropout
DEEPSEEK_V3 = TINY + MTP_MOE + MLA + [
    "--moe-router-score-function", "sigmoid", "--moe-shared-expert-intermediate-size", 32, "--moe-grouped-gemm",
    "--tensor-model-parallel-size", 2, "--expert-model-parallel-size", 2, "--sequence-parallel",
    "--make-vocab-size-divisible-by", 64]
ITERS, SAVE_AT = 4, 2
PARALLEL = {"--tensor-model-parallel-size": 1, "--expert-model-parallel-size": 1, "--sequence-parallel": 0}


def _without_model_parallelism(args):
    """``args`` at TP1 x EP1 (data-parallel only)."""
    out, skip = [], 0
    for a in args:
        if skip or a in PARALLEL:
            skip = 0 if skip else PARALLEL[a]
            continue
        out.append(a)
    return out


def _biases(model_chunks):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.expert_bias.detach().clone() for c in model_chunks for m in c.modules() if isinstance(m, TopKRouter)]


def _train_save_resume(ckpt, extra):
    """(uninterrupted run, resumed run, {iteration: expert biases}) of each: the first run saves at SAVE_AT and goes on
    to ITERS; the second loads that checkpoint."""
    args = DEEPSEEK_V3 + extra + ["--train-iters", ITERS]
    out = []
    for more in (["--save", ckpt, "--save-interval", SAVE_AT], ["--load", ckpt, "--ckpt-step", SAVE_AT]):
        bias = {}
        res = _run(args + more, on_iteration_end=lambda it, model, loss: bias.__setitem__(it, _biases(model)))
        out.append((res, bias))
    return out


def _check_structure(model):
    """The model is the DeepSeek-V3 shape asked for, on this rank's TP/EP share."""
    from megatron.core import parallel_state as ps

    dense, moe = model.decoder.layers
    mtp_layer = model.mtp.layers[0].mtp_model_layer
    for layer in (dense, moe, mtp_layer):
        sa = layer.self_attention
        assert type(sa).__name__ == "MLASelfAttention" and type(sa.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
        assert tuple(sa.linear_q_up_proj.weight.shape) == (4 * (8 + 2) // 2, 16)  # q-LoRA, column-parallel
        assert tuple(sa.linear_kv_down_proj.weight.shape) == ((14 + 2) // 2, 32)  # kv-LoRA + RoPE key
    assert model.rotary_pos_emb is None  # MLA keeps its own rotary embedding (decoder and MTP layers alike)
    assert not dense.is_moe and moe.is_moe and mtp_layer.is_moe
    for layer in (moe, mtp_layer):
        mlp = layer.mlp
        assert mlp.router.config.moe_router_score_function == "sigmoid" and mlp.router.expert_bias is not None
        assert type(mlp.experts).__name__ == "GroupedMLP" and mlp.shared_experts is not None
        ep = ps.get_expert_model_parallel_rank()
        assert mlp.experts.local_expert_indices == [2 * ep, 2 * ep + 1]  # 2 of the 4 experts on each EP rank


def _body(rank, world_size, tmp):
    from megatron.core import parallel_state as ps

    runs = {}
    for engine, extra in (("ddp", []), ("fsdp", ["--use-megatron-fsdp", "--init-model-with-meta-device"])):
        (full, full_bias), (resumed, resumed_bias) = _train_save_resume(f"{tmp}/{engine}", extra)
        assert (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()) == (2, 2)
        model = _model_of(full)
        assert type(full.model[0]).__name__ == ("FullyShardedDataParallel" if engine == "fsdp"
                                                else "DistributedDataParallel")
        if engine == "ddp":
            _check_structure(model)
            # the same checkpoint at TP1 x EP1 x DP4: the same losses (the TP/SP/EP splits of MLA, the MTP depth,
            # the shared experts and the grouped experts, and their gradient reductions, are right)
            tp1 = _run(_without_model_parallelism(DEEPSEEK_V3) + ["--train-iters", ITERS, "--load", f"{tmp}/ddp",
                                                                  "--ckpt-step", SAVE_AT])
            assert ps.get_tensor_model_parallel_world_size() == ps.get_expert_model_parallel_world_size() == 1
            for i in range(SAVE_AT + 1, ITERS + 1):
                assert tp1.losses[i] == pytest.approx(full.losses[i], rel=1e-5, abs=0), (i, tp1.losses, full.losses)
                assert tp1.moe_losses[i]["mtp_1 loss"] == pytest.approx(full.moe_losses[i]["mtp_1 loss"], rel=1e-5,
                                                                        abs=0)
        assert sorted(full.losses) == list(range(1, ITERS + 1)) and sorted(resumed.losses) == [3, 4]
        curve = [full.losses[i] for i in range(1, ITERS + 1)]
        assert len(set(curve)) == ITERS, curve  # it trains
        _same_on_all_ranks(curve)
        # the resumed iterations: exactly the uninterrupted run's losses, MTP losses and expert biases
        for i in range(SAVE_AT + 1, ITERS + 1):
            assert resumed.losses[i] == full.losses[i], (engine, i, resumed.losses, full.losses)
            assert resumed.moe_losses[i]["mtp_1 loss"] == full.moe_losses[i]["mtp_1 loss"], (engine, i)
            assert len(resumed_bias[i]) == len(full_bias[i]) == 2  # the MoE decoder layer's and the MTP layer's
            for got, want in zip(resumed_bias[i], full_bias[i]):
                assert torch.equal(got, want), (engine, i, got, want)
        # the MTP loss is logged every iteration: a real cross entropy, about log(128) (padded vocabulary)
        assert all(4.0 < full.moe_losses[i]["mtp_1 loss"] < 5.5 for i in range(1, ITERS + 1)), full.moe_losses
        # sign updates of the sigmoid router's bias: a multiple of the rate (1e-3), never NaN or garbage
        for b in full_bias[ITERS]:
            assert torch.isfinite(b).all() and 0 < float(b.abs().max()) <= ITERS * 1e-3 + 1e-9, b
            assert torch.allclose(b / 1e-3, (b / 1e-3).round(), atol=1e-3), b
        runs[engine] = (curve, full_bias, full.moe_losses)
    # Megatron-FSDP with meta-device init trains as DDP (2 data-parallel ranks: the same sums): the expert bias kept
    # its zeros through the meta init and took the same updates
    (ddp, ddp_bias, ddp_mtp), (fsdp, fsdp_bias, fsdp_mtp) = runs["ddp"], runs["fsdp"]
    assert fsdp == pytest.approx(ddp, rel=1e-5, abs=0), (fsdp, ddp)
    for i in range(1, ITERS + 1):
        assert fsdp_mtp[i]["mtp_1 loss"] == pytest.approx(ddp_mtp[i]["mtp_1 loss"], rel=1e-5, abs=0)
        for got, want in zip(fsdp_bias[i], ddp_bias[i]):
            assert torch.equal(got, want), (i, got, want)


def test_deepseek_v3_shaped_tp2_ep2_sp_trains_and_resumes_exactly_ddp_and_fsdp_meta(tmp_path):
    run_distributed(_body, 4, str(tmp_path))
