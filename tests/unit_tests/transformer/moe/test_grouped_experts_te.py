"""--moe-grouped-gemm with Transformer Engine (TEGroupedMLP on TE's GroupedLinear): GPU only (``@pytest.mark.gpu``).

Grouped and sequential TE experts load each other's checkpoints and give the same loss; with FP8 delayed scaling and
FP8 primary weights (--fp8-param-gather) a grouped checkpoint loads back with --stream-ckpt-dequant (weights exactly
the saved ones, the streaming scratch bounded by the chunk size) and its per-expert scales load into sequential
experts."""
import os

import pytest
import torch

from megatron.core.tensor_parallel.te_layers import HAVE_TE
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (HAVE_TE and torch.cuda.is_available()),
                                                  reason="needs CUDA and Transformer Engine")]

VOCAB, SEQ, EXPERTS = 128, 64, 4


def _cfg(grouped, **kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=EXPERTS,
                moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_enable_expert_bias=True,
                transformer_impl="transformer_engine", params_dtype=torch.float32, moe_grouped_gemm=grouped,
                init_method_std=0.05)
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def _build(cfg, seed):
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    with torch.device("cuda"):  # GPTModel initialises its weights (init_weights) as it is built
        return GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)


def _batch(b=4):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (b, SEQ), device="cuda", generator=g)
    return ids, torch.arange(SEQ, device="cuda").unsqueeze(0).expand(b, SEQ)


def _loss(model):
    ids, pos = _batch()
    return model(ids, pos, labels=ids).mean()


def _save(model, path):
    from megatron.core import dist_checkpointing

    os.makedirs(path)
    dist_checkpointing.save(model.sharded_state_dict(), path)


def _load(model, path, **strategy):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    s = TorchDistLoadShardedStrategy(**strategy) if strategy else None
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path, sharded_strategy=s), strict=True)
    return s


@pytest.mark.parametrize("first", ["sequential", "grouped"])
def test_te_grouped_and_sequential_interchange(tmp_path, first):
    from megatron.core.tensor_parallel.te_layers import TEColumnParallelGroupedLinear

    a = _build(_cfg(first == "grouped"), 1)
    with torch.no_grad():
        loss_a = _loss(a)
    _save(a, str(tmp_path / "a"))
    b = _build(_cfg(first != "grouped"), 2)
    if first == "sequential":
        assert isinstance(b.decoder.layers[0].mlp.experts.linear_fc1, TEColumnParallelGroupedLinear)
    _load(b, str(tmp_path / "a"))
    with torch.no_grad():
        torch.testing.assert_close(_loss(b), loss_a, rtol=1e-4, atol=1e-4)


def _fp8_train(model, steps=3):
    from megatron.core.tensor_parallel.te_layers import te_quantization_autocast

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)  # scales move, weights stay
    for _ in range(steps):
        with te_quantization_autocast(model.config):
            _loss(model).backward()
        opt.zero_grad()


def test_te_grouped_fp8_param_gather_stream_load_and_scales(tmp_path):
    from megatron.core.extensions.transformer_engine import te_is_fp8_available

    if te_is_fp8_available is not None and not te_is_fp8_available():
        pytest.skip("no FP8 on this GPU")
    fp8 = dict(fp8="hybrid", fp8_recipe="delayed", fp8_param=True, fp8_amax_history_len=4,
               params_dtype=torch.bfloat16, bf16=True)
    a = _build(_cfg(True, **fp8), 1)
    _fp8_train(a)
    fc1 = a.decoder.layers[0].mlp.experts.linear_fc1
    assert type(fc1.weight0).__name__ == "Float8Tensor"
    scales = fc1.fp8_meta["scaling_fwd"].scale.detach().cpu().clone()
    _save(a, str(tmp_path / "a"))
    weights = {n: p.detach().float().cpu().clone() for n, p in a.named_parameters()}

    b = _build(_cfg(True, **fp8), 2)
    _fp8_train(b, 1)  # initialise its FP8 state
    strategy = _load(b, str(tmp_path / "a"), stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=0.01)
    stats = strategy.last_load_stats
    assert stats.streamed and stats.dequantized_upfront_bytes == 0
    assert 0 < stats.scratch_bytes_peak <= 2 * 0.01 * 2**20 + 64 * 2 * 4  # one chunk (+ a row) of scratch
    from megatron.core.extensions.transformer_engine import QuantizedTensor

    for n, p in b.named_parameters():
        if isinstance(p, QuantizedTensor):
            # a model-only load re-quantizes the saved values with the destination's scale (the checkpoint's scale
            # arrives with the extra state, after the tensors; upstream's copy into TE's FP8 weights does the same):
            # one E4M3 rounding, at most half a step: 2**-4 relative (3 mantissa bits) or 2**-10 * scale_inv
            # (subnormals), checked with a margin of 2; values beyond the destination's range (448 * scale_inv: b's
            # delayed scale came from its own, smaller, amax) saturate to it. (A training resume is exact: the
            # weights come from the optimizer's fp32 main params.)
            scale_inv = float(p._scale_inv.float().max())
            got, want, limit = p.detach().float().cpu(), weights[n], 448.0 * scale_inv
            inside = want.abs() <= limit
            torch.testing.assert_close(got[inside], want[inside], rtol=2**-3, atol=scale_inv * 2**-9)
            torch.testing.assert_close(got[~inside], torch.sign(want[~inside]) * limit, rtol=1e-6, atol=0)
        else:
            assert torch.equal(p.detach().float().cpu(), weights[n]), n
    torch.testing.assert_close(b.decoder.layers[0].mlp.experts.linear_fc1.fp8_meta["scaling_fwd"].scale.cpu(),
                               scales, rtol=0, atol=0)

    seq = _build(_cfg(False, **fp8), 3)
    _fp8_train(seq, 1)
    _load(seq, str(tmp_path / "a"))
    for i, expert in enumerate(seq.decoder.layers[0].mlp.experts.local_experts):
        got = expert.linear_fc1.fp8_meta["scaling_fwd"].scale.cpu()
        torch.testing.assert_close(got, scales.view(3, EXPERTS)[:, i], rtol=0, atol=0)


def test_recompute_fp8_delayed_scaling_equals_no_recompute():
    """Full and selective recompute under FP8 delayed scaling (TE's checkpoint): loss, gradients and the FP8 scales
    after the steps equal those without recompute (the recompute sees the original forward's scales)."""
    from megatron.core.tensor_parallel.te_layers import te_quantization_autocast
    from megatron.core.extensions.transformer_engine import te_is_fp8_available

    if te_is_fp8_available is not None and not te_is_fp8_available():
        pytest.skip("no FP8 on this GPU")
    fp8 = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, params_dtype=torch.bfloat16, bf16=True)
    results = {}
    for name, kw in {"off": {}, "full": dict(recompute_granularity="full", recompute_method="uniform",
                                             recompute_num_layers=1),
                     "selective": dict(recompute_granularity="selective",
                                       recompute_modules=["core_attn", "moe_act", "layernorm"])}.items():
        model = _build(_cfg(True, **fp8, **kw), 1)
        losses = []
        for _ in range(3):  # the scales move between steps: a recompute with other scales would differ
            model.zero_grad()
            with te_quantization_autocast(model.config):
                loss = _loss(model)
            loss.backward()
            losses.append(loss.detach().float())
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        scale = model.decoder.layers[0].mlp.experts.linear_fc1.fp8_meta["scaling_fwd"].scale.clone()
        results[name] = (torch.stack(losses), grads, scale)
    ref = results["off"]
    for name in ("full", "selective"):
        got = results[name]
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0, msg=name)
        assert set(got[1]) == set(ref[1])
        for n, g in ref[1].items():
            torch.testing.assert_close(got[1][n], g, rtol=0, atol=0, msg=f"{name}: {n}")
        torch.testing.assert_close(got[2], ref[2], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unquantized_te_grouped_experts_run_torch_grouped_mm_like_te(dtype, monkeypatch):
    """bf16 TE grouped experts (no FP8, TP 1) on Hopper run torch's grouped matmul on their own weights
    (fp32 and other GPUs stay on TE's grouped GEMM): the loss and every gradient equal those of TE's grouped GEMM
    (forced by turning the check off) up to rounding; FP8 stays on TE."""
    from megatron.core.tensor_parallel import te_layers

    calls = []
    real = te_layers.TEGroupedLinear.uses_torch_grouped_mm
    monkeypatch.setattr(te_layers.TEGroupedLinear, "uses_torch_grouped_mm",
                        lambda self, x: calls.append(real(self, x)) or calls[-1])
    results = []
    for torch_path in (True, False):
        if not torch_path:
            monkeypatch.setattr(te_layers.TEGroupedLinear, "uses_torch_grouped_mm", lambda self, x: False)
        model = _build(_cfg(True, params_dtype=dtype, bf16=dtype == torch.bfloat16, add_bias_linear=True), 0)
        loss = _loss(model)
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    torch_kernel = dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] == 9
    assert calls and all(c is torch_kernel for c in calls)  # every grouped linear call of the first model
    (loss_t, grads_t), (loss_te, grads_te) = results
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-3  # different GEMM kernels and summation order (measured: 2e-2, 2e-4)
    assert abs(loss_t - loss_te) / loss_te.abs() < tol
    for name, g in grads_te.items():
        assert (grads_t[name] - g).norm() <= tol * g.norm() + 1e-6, name
    fp8 = _build(_cfg(True, fp8="hybrid", fp8_recipe="delayed"), 0).decoder.layers[0].mlp.experts.linear_fc1
    assert not real(fp8, torch.zeros(4, 64, device="cuda"))
