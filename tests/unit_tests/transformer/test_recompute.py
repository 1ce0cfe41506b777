"""Activation recompute (--recompute-granularity full|selective, upstream's fields): loss and every gradient equal
those without recompute (fp32, CPU, dropout on: the recompute draws the same masks), dense and MoE (sequential and
grouped experts), on 1 rank and on 2 gloo ranks (tensor parallel; Megatron-FSDP with no extra parameter gathers);
bad combinations name the flag."""
import pytest
import torch

from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tensor_parallel._tp_common import SEQ, VOCAB, build, make_config, position_ids

RECOMPUTE = {
    "off": {},
    "full_uniform1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_uniform2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective_default": dict(recompute_granularity="selective"),
    "selective_all": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "mlp", "moe", "moe_act", "layernorm"]),
    "selective_moe_act": dict(recompute_granularity="selective", recompute_modules=["moe_act", "layernorm"]),
}
MODELS = {
    "dense": dict(hidden_dropout=0.1, attention_dropout=0.1),
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=20, moe_router_enable_expert_bias=True,
                moe_aux_loss_coeff=0.01, hidden_dropout=0.1, attention_dropout=0.1),
    "moe_grouped": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=20,
                        moe_router_enable_expert_bias=True, moe_grouped_gemm=True, hidden_dropout=0.1,
                        attention_dropout=0.1),
}


def _batch(b=4):
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, VOCAB, (b, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _run(model, seed=0):
    """Loss, grads, and the routers' token counts of one forward/backward (dropout drawn from ``seed``)."""
    tok, lab = _batch()
    torch.manual_seed(seed)
    model.zero_grad()
    loss = model(tok, position_ids(tok.shape[0]), labels=lab).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    counts = [m.local_tokens_per_expert.clone() for m in model.modules()
              if getattr(m, "local_tokens_per_expert", None) is not None]
    return loss.detach(), grads, counts


def _compare(a, b, what):
    torch.testing.assert_close(b[0], a[0], rtol=0, atol=1e-6, msg=what)
    assert set(b[1]) == set(a[1]) and len(a[1]) > 10, what
    for n, g in a[1].items():
        torch.testing.assert_close(b[1][n], g, rtol=1e-5, atol=1e-6, msg=f"{what}: {n}")
    assert len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y), f"{what}: router token counts (counted once per forward) {x} != {y}"


@pytest.mark.parametrize("model", list(MODELS))
def test_recompute_equals_no_recompute(model):
    ref = _run(build("gqa_swiglu", make_config("gqa_swiglu", **MODELS[model]), seed=3))
    for name, kw in RECOMPUTE.items():
        if name == "off" or (model == "dense" and name == "selective_moe_act"):
            continue
        cfg = make_config("gqa_swiglu", **MODELS[model], **kw)
        _compare(ref, _run(build("gqa_swiglu", cfg, seed=3)), f"{model} {name}")


def test_recompute_keeps_less_and_runs_again():
    """Full recompute saves fewer activations for backward, and the layers run again in backward."""
    from torch.autograd.graph import saved_tensors_hooks

    def saved_bytes(cfg):
        model = build("gqa_swiglu", cfg, seed=3)
        calls = []
        model.decoder.layers[0].self_attention.register_forward_hook(lambda *a: calls.append(1))
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        tok, lab = _batch()
        with saved_tensors_hooks(pack, lambda t: t):
            loss = model(tok, position_ids(tok.shape[0]), labels=lab).mean()
        n_fwd = len(calls)
        loss.backward()
        return total[0], n_fwd, len(calls)

    off = saved_bytes(make_config("gqa_swiglu"))
    full = saved_bytes(make_config("gqa_swiglu", **RECOMPUTE["full_uniform2"]))
    assert off[1:] == (1, 1) and full[1:] == (1, 2)
    assert full[0] < 0.5 * off[0], (full, off)


@pytest.mark.parametrize("kw, needle", [
    (dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
     "--recompute-modules mla_up_proj: this fork has no such module"),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "shared_experts"]),
     "--recompute-modules shared_experts: this fork has no such module"),
    (dict(recompute_granularity="selective", recompute_modules=["attn"]), r"unknown module\(s\) \['attn'\]"),
    (dict(recompute_granularity="full"), "needs --recompute-method"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3), "--recompute-num-layers"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), "need --recompute-granularity full"),
    (dict(recompute_modules=["core_attn"]), "needs --recompute-granularity selective"),
    (dict(recompute_granularity="partial"), "--recompute-granularity"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
          distribute_saved_activations=True), "--distribute-saved-activations"),
])
def test_bad_recompute_config_names_the_flag(kw, needle):
    with pytest.raises(ValueError, match=needle):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **{"transformer_impl": "local", **kw})


def test_selective_default_modules_are_upstreams():
    cfg = TransformerConfig(transformer_impl="local",
                            num_layers=2, hidden_size=32, num_attention_heads=4, recompute_granularity="selective")
    assert cfg.recompute_modules == ["core_attn"]


def test_cli_flags_reach_the_config(monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
            "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --distributed-backend gloo").split()

    def config(*extra):
        return core_transformer_config_from_args(validate_args(parse_args(args=base + list(extra))))

    cfg = config("--recompute-activations", "--recompute-modules", "core_attn", "mlp")
    assert cfg.recompute_granularity == "selective" and cfg.recompute_modules == ["core_attn", "mlp"]
    cfg = config("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
                 "--num-experts", "4", "--moe-grouped-gemm")
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 1)
    assert cfg.moe_grouped_gemm is True
    with pytest.raises((ValueError, SystemExit)):
        config("--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj")


# ---- 2 ranks: tensor parallel (dropout under the tracker's fork) and Megatron-FSDP -------------------------------
def _tp_body(rank, ws, model):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    results = {}
    for name in ("off", "full_uniform2", "selective_all"):
        model_parallel_cuda_manual_seed(123)
        cfg = make_config("gqa_swiglu", tp=2, **MODELS[model], **RECOMPUTE[name])
        results[name] = _run(build("gqa_swiglu", cfg, seed=3), seed=9)
    for name in ("full_uniform2", "selective_all"):
        _compare(results["off"], results[name], f"tp2 {model} {name}")


@pytest.mark.parametrize("model", ["dense", "moe_grouped"])
def test_recompute_equals_no_recompute_tensor_parallel(model):
    run_distributed(_tp_body, 2, model)


def _fsdp_body(rank, ws):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    parallel_state.initialize_model_parallel()
    gathers = [0]
    original = fsdp_group.foreach_all_gather  # FSDP2's parameter all-gather of one unit

    def counting(*a, **k):
        gathers[0] += 1
        return original(*a, **k)

    fsdp_group.foreach_all_gather = counting
    try:
        out = {}
        for name in ("off", "full_block1", "full_uniform1", "selective_all"):
            cfg = make_config("gqa_swiglu", **MODELS["moe"], **RECOMPUTE[name])
            model = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True),
                                             build("gqa_swiglu", cfg, seed=3))
            tok, lab = _batch()
            torch.manual_seed(rank)
            gathers[0] = 0
            loss = model(tok[rank::2], position_ids(2), labels=lab[rank::2]).mean()
            loss.backward()
            out[name] = (loss.detach(), gathers[0])
        assert out["off"][1] > 0
        for name, (loss, n) in out.items():
            torch.testing.assert_close(loss, out["off"][0], rtol=0, atol=1e-6, msg=name)
            assert n == out["off"][1], f"{name}: {n} parameter all-gathers, {out['off'][1]} without recompute"
    finally:
        fsdp_group.foreach_all_gather = original


def test_recompute_under_megatron_fsdp_gathers_no_more():
    run_distributed(_fsdp_body, 2)
