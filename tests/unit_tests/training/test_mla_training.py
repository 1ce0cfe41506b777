"""Multi-latent attention with YaRN through ``pretrain_gpt.py`` on CPU (gloo, 2 ranks): a TP2 checkpoint resumes at
TP1 x DP2, TP2 and TP2 + sequence parallelism with the same losses (the latents gathered / scattered and the shared
RoPE key's gradient summed over TP as they must be); a DeepSeek-V3-shaped MLA + sigmoid-routed MoE (expert bias, shared
experts, grouped GEMM, EP2) trains; ``--use-rope-scaling`` and ``--position-embedding-type yarn`` reach the model;
the MLA flags' refusals name the flag."""
import os

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

MLA = ["--multi-latent-attention", "--q-lora-rank", 16, "--kv-lora-rank", 14, "--qk-head-dim", 8,
       "--qk-pos-emb-head-dim", 2, "--v-head-dim", 6, "--qk-layernorm", "--rope-type", "yarn",
       "--rotary-scaling-factor", 4, "--mscale", 1.0, "--mscale-all-dim", 0.7, "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]


def _chunk(run):
    m = run.model[0]
    return m.module if hasattr(m, "module") else m


def _mla_tp_body(rank, world_size, tmp):
    ckpt = os.path.join(tmp, "mla")
    base = TINY + NO_DROPOUT + MLA + ["--lr", 3e-2, "--make-vocab-size-divisible-by", 64]
    first = _run(base + ["--train-iters", 1, "--save", ckpt, "--tensor-model-parallel-size", 2])
    sa = _chunk(first).decoder.layers[0].self_attention
    assert type(sa).__name__ == "MLASelfAttention" and type(sa.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
    assert tuple(sa.linear_kv_down_proj.weight.shape) == ((14 + 2) // 2, 32)  # column-parallel: half on each rank
    assert tuple(sa.linear_q_up_proj.weight.shape) == (4 * (8 + 2) // 2, 16)
    runs = {name: _run(base + ["--train-iters", 5, "--load", ckpt] + extra) for name, extra in (
        ("tp1", []), ("tp2", ["--tensor-model-parallel-size", 2]),
        ("tp2_sp", ["--tensor-model-parallel-size", 2, "--sequence-parallel"]))}
    tp1 = runs["tp1"].losses
    assert len({round(float(tp1[i]), 4) for i in range(2, 6)}) > 1  # it trains
    for name in ("tp2", "tp2_sp"):
        for i in range(2, 6):
            assert runs[name].losses[i] == pytest.approx(tp1[i], rel=1e-5, abs=0), (name, i, tp1, runs[name].losses)
    # the replicated latent norms moved and stayed equal on both TP ranks
    for name in ("tp2", "tp2_sp"):
        w = _chunk(runs[name]).decoder.layers[1].self_attention.kv_layernorm.weight.detach().clone()
        assert not torch.allclose(w, torch.ones_like(w))
        both = [torch.empty_like(w) for _ in range(world_size)]
        torch.distributed.all_gather(both, w)
        assert torch.equal(both[0], both[1]), name
    # --use-rope-scaling (Llama 3.1) reaches the model's rotary embedding
    scaled = _run(TINY + NO_DROPOUT + ["--train-iters", 1, "--position-embedding-type", "rope", "--use-rope-scaling",
                                       "--rope-scaling-factor", 16])
    rope = _chunk(scaled).rotary_pos_emb
    assert rope.rope_scaling and rope.rope_scaling_factor == 16.0
    # DeepSeek-V3-shaped: MLA + YaRN with a sigmoid-routed MoE (expert bias, shared experts, grouped GEMM), EP2
    ds = _run(TINY + NO_DROPOUT + MLA + ["--train-iters", 2, "--num-experts", 4, "--moe-router-topk", 2,
                                         "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                         "--moe-shared-expert-intermediate-size", 32, "--moe-grouped-gemm",
                                         "--expert-model-parallel-size", 2, "--moe-ffn-hidden-size", 32])
    layer = _chunk(ds).decoder.layers[0]
    assert type(layer.self_attention).__name__ == "MLASelfAttention" and layer.is_moe
    assert len(ds.losses) == 2 and all(torch.isfinite(torch.tensor(float(v))) for v in ds.losses.values())
    assert float(layer.mlp.router.expert_bias.abs().sum()) > 0  # updated by the training loop
    # --position-embedding-type yarn (standard attention, gpt-oss's rotary) trains
    yarn = _run(TINY + NO_DROPOUT + ["--train-iters", 2, "--position-embedding-type", "yarn",
                                     "--rotary-scaling-factor", 4, "--mscale-all-dim", 1.0])
    assert type(_chunk(yarn).rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
    assert all(torch.isfinite(torch.tensor(float(v))) for v in yarn.losses.values()) and len(yarn.losses) == 2


def test_mla_yarn_pretrain_tp2_checkpoint_resumes_at_tp1_tp2_and_sp(tmp_path):
    run_distributed(_mla_tp_body, 2, str(tmp_path))


def _grads_body(rank, world_size):
    """One forward/backward of the same MLA GPT at TP1 and at TP2 (without and with SP; TP2 holds TP1's weights
    split): the same loss, and every gradient (TP2's gathered, after finalize_model_grads' TP sums) equal to TP1's."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import MLATransformerConfig

    def build(tp, sp):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1)
        torch.manual_seed(1)
        cfg = MLATransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                   q_lora_rank=16, kv_lora_rank=14, qk_head_dim=8, qk_pos_emb_head_dim=2,
                                   v_head_dim=6, qk_layernorm=True, rotary_scaling_factor=4.0, mscale_all_dim=0.7,
                                   add_bias_linear=False, tensor_model_parallel_size=tp, sequence_parallel=sp)
        return GPTModel(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="rope")

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = build(1, False)
    with torch.no_grad():
        for p in ref.parameters():  # norms away from 1
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    ref_loss = ref(ids, None, labels=ids).sum()
    ref_loss.backward()
    weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ps.destroy_model_parallel()
    for sp in (False, True):
        model = build(2, sp)
        with torch.no_grad():
            for n, p in model.named_parameters():
                split = getattr(p, "tensor_model_parallel", False)
                p.copy_(weights[n].chunk(2, dim=p.partition_dim)[rank] if split else weights[n])
        loss = model(ids, None, labels=ids).sum()
        loss.backward()
        allreduce_sequence_parallel_grads([model])
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
        for n, p in model.named_parameters():
            g = p.grad
            if getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(g) for _ in range(world_size)]
                torch.distributed.all_gather(parts, g.contiguous())
                g = torch.cat(parts, dim=p.partition_dim)
            torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n} (sp={sp}): {m}")
        ps.destroy_model_parallel()


def test_mla_tp2_gradients_equal_tp1():
    run_distributed(_grads_body, 2)


@pytest.mark.parametrize("extra, message", [
    (["--rope-type", "yarn"], "--rope-type yarn needs --multi-latent-attention"),
    (MLA + ["--group-query-attention"], "--group-query-attention is mutually exclusive with --multi-latent-attention"),
    (["--use-rope-scaling"], "--use-rope-scaling needs --position-embedding-type rope"),
    (MLA + ["--tensor-model-parallel-size", 3, "--num-attention-heads", 6, "--ffn-hidden-size", 96, "--q-lora-rank",
            15],
     "kv_lora_rank + qk_pos_emb_head_dim (16) must be divisible by tensor_model_parallel_size"),
], ids=["rope_type", "gqa", "rope_scaling", "tp"])
def test_mla_flag_refusals_name_the_flag(extra, message, monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    if "--tensor-model-parallel-size" in extra:
        monkeypatch.setenv("WORLD_SIZE", "3")  # TP 3: a divisor of the world size

    args = parse_args(args=[str(a) for a in TINY + ["--train-iters", 1] + extra])
    with pytest.raises(SystemExit) as exc:
        validate_args(args)
    assert message in str(exc.value), str(exc.value)


def test_mla_flags_reach_the_config():
    from megatron.core.transformer import MLATransformerConfig
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    args = validate_args(parse_args(args=[str(a) for a in TINY + ["--train-iters", 1] + MLA]))
    cfg = core_transformer_config_from_args(args)
    assert isinstance(cfg, MLATransformerConfig) and cfg.multi_latent_attention and cfg.qk_layernorm
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        16, 14, 8, 2, 6)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == ("yarn", 4.0, 1.0, 0.7)
    # no --rope-type: MLATransformerConfig's default (yarn), as upstream; no MLA: a plain TransformerConfig
    args = validate_args(parse_args(args=[str(a) for a in TINY + ["--train-iters", 1, "--multi-latent-attention"]]))
    assert core_transformer_config_from_args(args).rope_type == "yarn"
    args = validate_args(parse_args(args=[str(a) for a in TINY + ["--train-iters", 1]]))
    assert not hasattr(core_transformer_config_from_args(args), "q_lora_rank")
    # --position-embedding-type yarn (standard attention): upstream's config.yarn_* attributes, its defaults
    args = validate_args(parse_args(args=[str(a) for a in TINY + [
        "--train-iters", 1, "--position-embedding-type", "yarn", "--rotary-scaling-factor", 32, "--yarn-beta-fast",
        16, "--no-yarn-correction-range-round-to-int"]]))
    cfg = core_transformer_config_from_args(args)
    assert (cfg.yarn_rotary_scaling_factor, cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_mscale,
            cfg.yarn_mscale_all_dim, cfg.yarn_original_max_position_embeddings,
            cfg.yarn_correction_range_round_to_int) == (32.0, 16.0, 1.0, 1.0, 0.0, 4096, False)


def test_resume_compares_the_mla_sizes():
    from types import SimpleNamespace

    from megatron.training.checkpoint_safety import checkpoint_args_mismatches

    base = dict(num_layers=2, hidden_size=32, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=14,
                qk_head_dim=8, qk_pos_emb_head_dim=2, v_head_dim=6)
    ckpt = SimpleNamespace(**base)
    assert checkpoint_args_mismatches(ckpt, SimpleNamespace(**base)) == []
    assert checkpoint_args_mismatches(ckpt, SimpleNamespace(**{**base, "kv_lora_rank": 16})) == [
        ("kv_lora_rank", 14, 16)]
    assert ("multi_latent_attention", True, False) in checkpoint_args_mismatches(
        ckpt, SimpleNamespace(**{**base, "multi_latent_attention": False}))
    # without MLA on either side the (default) MLA sizes do not count
    plain = dict(base, multi_latent_attention=False)
    assert checkpoint_args_mismatches(SimpleNamespace(**plain), SimpleNamespace(**{**plain, "q_lora_rank": 3})) == []
